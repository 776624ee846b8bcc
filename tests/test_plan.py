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


@pytest.mark.parametrize("typo,meant", [("sinlge", "single"), ("SINGLE", "single"), ("Ep", "ep"), ("FSEP", "fsep")])
def test_unknown_form_suggests_the_nearest(typo, meant):
    with pytest.raises(PlanError, match=rf"Plan.form='{typo}' is invalid: use one of .* Did you mean '{meant}'\?"):
        Plan(form=typo)


def test_misspelt_field_suggests_the_nearest():
    with pytest.raises(PlanError, match=r"unknown field 'capacity_factr'.*Did you mean 'capacity_factor'\?"):
        Plan(capacity_factr=1.0)


@pytest.mark.parametrize("value", [-1.0, 0, "big", True])
def test_negative_capacity_names_field_value_and_fix(value):
    with pytest.raises(PlanError, match=rf"Plan.capacity_factor={value!r} is invalid: use a float > 0, or None"):
        Plan(capacity_factor=value)


@pytest.mark.parametrize("field,value", [("a2a_chunks", 0), ("packing", "autoo"), ("ep_size", 0),
                                         ("micro_op_bytes", -5), ("micro_op_bytes", True), ("lowering", "cuda"),
                                         ("deterministic", 1),
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
    "hardware": "h100", "strict": True, "routing_skew": 2.0, "keep_original_if_slower": False,
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


# ----------------------------------------------------------------------------------------------
# A Plan per form: each form's options in one frozen, typed, validated dataclass; the flat spelling maps onto it.
# ----------------------------------------------------------------------------------------------

from moepass.plan import (  # noqa: E402
    ACTS_UNDER,
    FORM_OPTIONS,
    PLAN_FIELDS,
    AutoOptions,
    EPOptions,
    HPOptions,
    LocalityOptions,
    SingleOptions,
)


def test_the_flat_spelling_is_the_forms_options():
    """`Plan(form="ep", a2a_chunks=4)` is the short way to `Plan(options=EPOptions(a2a_chunks=4))`; the flat
    names read the options back, and a field the form has not reads its default."""
    plan = Plan(form="ep", ep_size=2, a2a_chunks=4)
    assert plan.options == EPOptions(ep_size=2, a2a_chunks=4) and (plan.ep_size, plan.a2a_chunks) == (2, 4)
    assert Plan(options=EPOptions(ep_size=2, a2a_chunks=4)) == plan  # the form read off the options
    assert Plan(form="ep", options=EPOptions(ep_size=2), a2a_chunks=4) == plan  # flat names over the options
    assert hash(Plan(options=EPOptions(ep_size=2, a2a_chunks=4))) == hash(plan)
    assert repr(plan) == "Plan(form='ep', ep_size=2, a2a_chunks=4)" and eval(repr(plan), {"Plan": Plan}) == plan
    assert plan.replace(a2a_chunks=2).options == EPOptions(ep_size=2, a2a_chunks=2)
    assert plan.slots_per_device is None and plan.heads is None  # FSEP's and HP's fields: their defaults
    assert type(Plan().options) is SingleOptions and type(Plan(form="auto").options) is AutoOptions
    assert type(Plan(form="locality", mu=0.1).options) is LocalityOptions
    with pytest.raises(TypeError, match="a2a_chunks"):
        HPOptions(a2a_chunks=4)  # type: ignore[call-arg]  # HP's exchange is not chunked: no such field to set


def test_each_forms_options_are_the_fields_that_act_under_it():
    """`ACTS_UNDER` is read off the option classes: a form's class has exactly the fields that act under it
    (besides the plan-wide ones); a field several forms share has one type and one default in each."""
    for form, cls in FORM_OPTIONS.items():
        acting = {name for name, (forms, _) in ACTS_UNDER.items() if form in forms}
        assert set(cls.names()) == acting - set(PLAN_FIELDS) - {"form"}, form
    declared: dict[str, tuple[object, object]] = {}
    for cls in FORM_OPTIONS.values():
        for f in dataclasses.fields(cls):
            assert declared.setdefault(f.name, (f.type, f.default)) == (f.type, f.default), (cls.__name__, f.name)


def test_options_of_another_form_are_refused():
    with pytest.raises(PlanError, match=r"^Plan.options=HPOptions\(.*\) is invalid with form='ep': it holds the "
                                        r"options of form='hp'; use EPOptions\(...\), or leave form out.$"):
        Plan(form="ep", options=HPOptions())
    with pytest.raises(PlanError, match=r"^Plan.a2a_chunks=4 has no effect with form='hp': .*Use one of those "
                                        r"forms, or leave it 'auto'.$"):
        Plan(form="hp", a2a_chunks=4)


def test_option_groups_are_validated_on_their_own():
    """An options object is checked when it is made, by the same rule as the flat spelling."""
    with pytest.raises(PlanError, match=r"^Plan.a2a_chunks=0 is invalid: use an int >= 1 or 'auto'.$"):
        EPOptions(a2a_chunks=0)
    with pytest.raises(PlanError, match=r"Plan.hierarchical_a2a=True is invalid with Plan.topology=Topology\(nodes=1"):
        EPOptions(topology=moepass.Topology(1, 4), hierarchical_a2a=True)
    with pytest.raises(PlanError, match=r"Plan.head_ep_size=2 is invalid with Plan.ep_size=3"):
        HPOptions(ep_size=3, head_ep_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EPOptions().a2a_chunks = 2  # type: ignore[misc]


def test_the_fields_once_typed_any_are_checked():
    """topology, batch and routing_skew have types and checks: a tuple is not a Topology, a batch is two positive
    ints, recorded routing is kept as nested tuples."""
    with pytest.raises(PlanError, match=r"^Plan.topology=\(2, 4\) is invalid: use moepass.Topology\(nodes, "
                                        r"ranks_per_node\), or None for the torchrun environment.$"):
        Plan(form="ep", topology=(2, 4))
    with pytest.raises(PlanError, match=r"^Plan.batch=\(0, 8\) is invalid: use \(batch, seq\), two positive ints"):
        Plan(form="auto", batch=(0, 8))
    assert Plan(form="auto", batch=[2, 8]).batch == (2, 8)
    assert Plan(form="auto", routing_skew=[[1, 2], [3, 4]]).routing_skew == ((1.0, 2.0), (3.0, 4.0))


def test_block_options_hold_what_the_whole_plan_gives_blocks_of_another_form():
    plan = Plan(ep_size=2, blocks={"layers.1.mlp": {"form": "ep"}})
    assert plan.options == SingleOptions() and plan.block_options == (EPOptions(ep_size=2),)
    assert plan.ep_size == 2 and plan.for_block("layers.1.mlp").options == EPOptions(ep_size=2)


def test_the_plan_modules_type_no_field_any():
    from pathlib import Path

    import moepass.plan_options

    for module in (moepass.plan, moepass.plan_options):
        text = Path(module.__file__).read_text()
        assert "import Any" not in text and ": Any" not in text, module.__name__
