"""`search` takes a plan space (which forms, and per form the option values to try) and the figures it prices with,
not one keyword per option; `Plan(form="auto")` searches the space its plan gives."""

import inspect

import pytest

from cost_model.search import BlockShape, EPSpace, FSEPSpace, HPSpace, PlanSpace, Pricing, search
from moepass import Plan

BLOCKS = [BlockShape(E=8, K=2, D=512, F=1024, m=3, cf=None)] * 2


def test_search_has_a_space_and_pricing_not_a_keyword_per_option():
    assert list(inspect.signature(search).parameters) == ["specs_or_model", "topology", "batch", "space", "profile",
                                                          "pricing"]


def test_the_space_names_the_forms_and_the_values_tried():
    every = search(BLOCKS, (1, 4), (4, 1024), profile="a100")
    assert {c.form for c in every.ranked} == {"single", "ep", "fsep", "hp"}
    assert [c.label for c in search(BLOCKS, (1, 4), (4, 1024), PlanSpace(), profile="a100").ranked] == [
        c.label for c in every.ranked]  # the default space is the search's own ranges
    ep_only = search(BLOCKS, (1, 4), (4, 1024), PlanSpace(forms=("ep",), ep=EPSpace(
        sizes=(4,), capacity_factors=(None,), a2a_chunks=(1, 2), packings=(1, 2))), profile="a100")
    assert sorted(c.label for c in ep_only.ranked) == ["ep=4 P=2 dropless n=1", "ep=4 P=2 dropless n=2",
                                                       "ep=4 dropless n=1", "ep=4 dropless n=2"]
    fsep = search(BLOCKS, (1, 4), (4, 1024), PlanSpace(forms=("fsep",), fsep=FSEPSpace(slots=(2, 3),
                                                                                       a2a_chunks=(4,))),
                  profile="a100")
    assert sorted(c.label for c in fsep.ranked) == ["fsep C=2 n=4", "fsep C=3 n=4"]
    hp = search(BLOCKS, (1, 4), (4, 1024), PlanSpace(forms=("hp",), hp=HPSpace(sizes=(2,), heads=4)),
                profile="a100")
    assert [c.label for c in hp.ranked] == ["hp=2 H=4 h=128"]


@pytest.mark.parametrize("make,message", [
    (lambda: PlanSpace(forms=("locality",)), r"PlanSpace.forms has 'locality': search prices \['single', 'ep', "
                                             r"'fsep', 'hp'\] \(locality is not modelled\)."),
    (lambda: EPSpace(a2a_chunks=(0,)), r"EPSpace.a2a_chunks=\(0,\) is invalid: use a tuple of ints >= 1."),
    (lambda: FSEPSpace(slots=[2]), r"FSEPSpace.slots=\[2\] is invalid: use a tuple of ints >= 1, or None for the "
                                   r"search's own range."),
    (lambda: EPSpace(capacity_factors=(0.0,)), r"EPSpace.capacity_factors=\(0.0,\) is invalid: use floats > 0"),
    (lambda: Pricing(imbalance=0.5), r"search got imbalance=0.5: it is max/mean routed rows per rank, >= 1"),
])
def test_a_bad_space_names_the_field_and_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_form_auto_searches_the_space_and_figures_its_plan_gives():
    plan = Plan(form="auto", batch=(2, 8), slots_per_device=3, prefetch_depth=1, heads=8, routing_skew=2.5,
                grad_sync="scheduler", micro_op_bytes=1 << 20, expert_recompute=True)
    assert PlanSpace.of(plan) == PlanSpace(fsep=FSEPSpace(slots=(3,), prefetch_depth=1), hp=HPSpace(heads=8))
    assert Pricing.of(plan, dense_params=10) == Pricing(imbalance=2.5, recompute=True, dense_params=10,
                                                        schedule="priority", micro_op_bytes=1 << 20)
    rows = ((1.0, 2.0), (3.0, 4.0))
    assert Pricing.of(Plan(form="auto", routing_skew=rows)) == Pricing(trace=rows, recompute=False)
    assert not PlanSpace.of(plan).allow_math_changes  # auto never picks a math change
