"""Plan and MoESpec validation: bad input raises PlanError naming the field, the value and the fix."""

import dataclasses

import pytest

import moepass
from moepass import Plan, PlanError
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec


def test_defaults_follow_the_design_table():
    plan = Plan()
    assert (plan.form, plan.a2a_chunks, plan.packing, plan.lowering, plan.deterministic) == (
        "single", "auto", 1, "auto", False)
    assert plan.micro_op_bytes == 30 * 2**20 and plan.capacity_factor is None and plan.blocks == {}


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Plan().form = "ep"  # type: ignore[misc]


def test_unknown_form_suggests_the_nearest():
    with pytest.raises(PlanError, match=r"Plan.form='sinlge' is invalid: use one of .* Did you mean 'single'\?"):
        Plan(form="sinlge")


def test_misspelt_field_suggests_the_nearest():
    with pytest.raises(PlanError, match=r"unknown field 'capacity_factr'.*Did you mean 'capacity_factor'\?"):
        Plan(capacity_factr=1.0)


@pytest.mark.parametrize("value", [-1.0, 0, "big"])
def test_negative_capacity_names_field_value_and_fix(value):
    with pytest.raises(PlanError, match=rf"Plan.capacity_factor={value!r} is invalid: use a float > 0, or None"):
        Plan(capacity_factor=value)


@pytest.mark.parametrize("field,value", [("a2a_chunks", 0), ("packing", "autoo"), ("ep_size", 0),
                                         ("micro_op_bytes", -5), ("lowering", "cuda"), ("deterministic", 1),
                                         ("strict", "yes")])
def test_other_bad_values(field, value):
    with pytest.raises(PlanError, match=rf"Plan.{field}={value!r} is invalid"):
        Plan(**{field: value})


def test_top_k_above_num_experts_is_a_plan_error():
    router = RouterSpec(num_experts=4, top_k=2)
    with pytest.raises(PlanError, match=r"router.top_k=5 is invalid: top_k must lie in \[1, num_experts=4\]"):
        MoESpec(path="layers.0.mlp", recogniser="test", router=dataclasses.replace(router, top_k=5),
                experts=ExpertsSpec(num_experts=4, hidden_dim=8, ffn_dim=16))


def test_negative_spec_capacity():
    with pytest.raises(PlanError, match=r"capacity.capacity_factor=-2.0 is invalid"):
        MoESpec(path="moe", recogniser="test", router=RouterSpec(num_experts=4, top_k=1),
                experts=ExpertsSpec(num_experts=4, hidden_dim=8, ffn_dim=16, w_up=moepass.TensorSource.param("u")),
                capacity=CapacitySpec(capacity_factor=-2.0))


def test_block_overrides_exact_beats_glob_and_none_skips():
    plan = Plan(blocks={"layers.*.mlp": {"lowering": "torch"}, "layers.1.mlp": None})
    assert plan.for_block("layers.0.mlp").lowering == "torch"
    assert plan.for_block("layers.1.mlp") is None
    assert plan.for_block("other") is plan


def test_block_override_is_validated():
    with pytest.raises(PlanError, match=r"Plan.form='epp' is invalid.*Did you mean 'ep'"):
        Plan(blocks={"layers.0.mlp": {"form": "epp"}})


def test_compile_rejects_a_non_plan():
    with pytest.raises(PlanError, match="pass a moepass.Plan"):
        moepass.compile(__import__("torch").nn.Linear(2, 2), {"form": "single"})  # type: ignore[arg-type]


def test_blocks_key_matching_no_block_raises_with_the_nearest_paths():
    """A `Plan.blocks` key that names no detected block would silently leave nothing alone: compile refuses it,
    naming the key and the real paths (the key written from the block's parent, as on an HF model whose blocks
    live under `model.`), and explain says compile would raise; a matching key or glob is taken."""
    import moepass
    from samples.models import tiny_mixtral

    model = tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
    report = moepass.detect(model)
    with pytest.raises(PlanError) as err:
        moepass.compile(model, Plan(blocks={"mlp": None}), report=report)
    assert "Plan.blocks['mlp'] matches no MoE block of this model" in str(err.value)
    assert "Did you mean 'layers.0.mlp', 'layers.1.mlp'?" in str(err.value)
    assert "compile would raise PlanError: Plan.blocks['mlp']" in moepass.explain(model, Plan(blocks={"mlp": None}),
                                                                                  report=report, graphs=False)
    cm = moepass.compile(model, Plan(blocks={"layers.0.mlp": None}), report=report)
    assert sorted(cm.moepass_info.rewritten) == ["layers.1.mlp"]
    cm = moepass.compile(model, Plan(blocks={"layers.*.mlp": None}), report=report)
    assert not cm.moepass_info.rewritten
