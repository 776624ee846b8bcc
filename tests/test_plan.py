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


# ----------------------------------------------------------------------------------------------
# One rule for every field: it acts under the chosen form, or Plan raises naming the field, the value and the form.
# ----------------------------------------------------------------------------------------------

SAMPLE = {  # a valid value away from each field's default
    "ep_size": 2, "topology": moepass.Topology(2, 2), "capacity_factor": 0.5, "a2a_chunks": 2,
    "hierarchical_a2a": True, "micro_op_bytes": 1 << 20, "packing": 2, "slots_per_device": 3, "planner": "static",
    "keep_restored": True, "prefetch_depth": 1, "defer_expert_grads": False, "heads": 4, "head_dim": 8,
    "head_ep_size": 2, "gate": "grap", "mu": 0.1, "alpha": 0.02, "lowering": "torch", "deterministic": True,
    "grad_sync": "scheduler", "expert_recompute": True, "blocks": {"layers.0.mlp": None}, "batch": (2, 8),
    "hardware": "h100", "strict": True, "routing_skew": 2.0,
}
FIELD_FORM = [(name, form) for name in SAMPLE for form in moepass.plan.FORMS]


def test_the_table_names_every_field():
    names = set(moepass.plan.FLAT_FIELDS)
    assert set(moepass.plan.ACTS_UNDER) == names and set(SAMPLE) == names - {"form"}
    assert all(set(forms) <= set(moepass.plan.FORMS) for forms, _ in moepass.plan.ACTS_UNDER.values())


@pytest.mark.parametrize("name,form", FIELD_FORM, ids=[f"{n}-{f}" for n, f in FIELD_FORM])
def test_every_field_acts_under_its_forms_or_raises_naming_field_value_and_form(name, form):
    """The field x form matrix: accepted where `ACTS_UNDER` says the field acts (what it does there is tested with
    each form), a PlanError naming the field, the value and the form everywhere else (never a silent no-op)."""
    kwargs = {"form": form, name: SAMPLE[name]}
    if form == "locality" and name != "mu":
        kwargs["mu"] = 0.1  # the form's one required field
    acts = form in moepass.plan.ACTS_UNDER[name][0]
    if acts:
        assert getattr(Plan(**kwargs), name) == SAMPLE[name]
        return
    with pytest.raises(PlanError) as err:
        Plan(**kwargs)
    assert str(err.value).startswith(f"Plan.{name}={SAMPLE[name]!r} has no effect with form={form!r}: "), err.value
    assert "Use form=" in str(err.value) or "Use one of those forms" in str(err.value)


def test_single_refuses_the_fields_the_issue_found_silent():
    """form='single' used to take capacity_factor=0.5 (dropping no token), ep_size, a2a_chunks and grad_sync;
    the three Plan fields now raise, and grad_sync='scheduler' (which acts under every form, on > 1 rank) makes
    compile raise on one process."""
    for name, value, what in (("capacity_factor", 0.5, "caps the tokens"), ("ep_size", 2, "EP degree"),
                              ("a2a_chunks", 2, "splits the token all-to-all")):
        with pytest.raises(PlanError, match=rf"Plan.{name}={value!r} has no effect with form='single': .*{what}"):
            Plan(**{name: value})
    import torch

    with pytest.raises(PlanError, match=r"Plan.grad_sync='scheduler' has no effect on one process: .* Leave it "
                                        r"'none'"):
        moepass.compile(torch.nn.Linear(2, 2), Plan(grad_sync="scheduler"))


def test_block_overrides_inherit_only_the_fields_that_act_under_their_form():
    """A field the whole plan sets acts in the blocks whose form it acts under and is at its default in the
    others; a field that acts under no form the plan or its overrides use raises; an override's own field that
    does not act under the override's form raises, naming the block key."""
    plan = Plan(form="ep", ep_size=2, capacity_factor=1.0, blocks={"layers.0.mlp": {"form": "single"}})
    assert plan.for_block("layers.0.mlp").form == "single"
    assert (plan.for_block("layers.0.mlp").ep_size, plan.for_block("layers.0.mlp").capacity_factor) == (None, None)
    assert (plan.for_block("layers.1.mlp").ep_size, plan.for_block("layers.1.mlp").capacity_factor) == (2, 1.0)
    assert Plan(ep_size=2, blocks={"layers.1.mlp": {"form": "ep"}}).for_block("layers.1.mlp").ep_size == 2
    with pytest.raises(PlanError, match=r"Plan.a2a_chunks=2 has no effect with form='single' \(nor with the forms "
                                        r"Plan.blocks names: 'hp'\)"):
        Plan(a2a_chunks=2, blocks={"layers.1.mlp": {"form": "hp"}})
    with pytest.raises(PlanError, match=r"Plan.blocks\['layers.1.mlp'\]: Plan.ep_size=2 has no effect with "
                                        r"form='single'"):
        Plan(form="ep", blocks={"layers.1.mlp": {"form": "single", "ep_size": 2}})


def test_form_auto_keeps_only_the_fields_that_act_under_the_chosen_form():
    """form='auto' weighs forms with fields that act under some of them (topology, batch, hardware, the FSEP
    fields): the chosen plan keeps those that act under the winner, the others back at their defaults."""
    plan = Plan(form="auto", topology=moepass.Topology(1, 4), batch=(2, 8), hardware="h100", keep_restored=True)
    single = plan.as_form("single")
    assert (single.topology, single.batch, single.hardware, single.keep_restored) == (None, None, None, False)
    ep = plan.as_form("ep", ep_size=4, a2a_chunks=2)
    assert (ep.topology, ep.batch, ep.hardware, ep.ep_size, ep.a2a_chunks, ep.keep_restored) == (
        moepass.Topology(1, 4), (2, 8), "h100", 4, 2, False)
    assert plan.as_form("fsep").keep_restored is True


@pytest.mark.parametrize("world,heads", [(1, 4), (2, 4), (3, 6), (4, 4), (5, 5), (8, 8)])
def test_heads_default_is_the_smallest_multiple_of_the_head_groups_from_4(world, heads):
    """Plan.heads=None, as its comment says: the smallest multiple of the head groups (world / head_ep_size) that is
    >= 4 (not the world size)."""
    from moepass.rewrite.latent import latent_shape
    from samples.models import LoopMoE

    spec = moepass.detect(LoopMoE(120, 64, num_experts=4, top_k=2)).blocks[0]
    assert latent_shape(spec, Plan(form="hp"), world).heads == heads
