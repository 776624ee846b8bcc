"""`moepass.search` and `Plan(form="auto")` price on the simulator's function (`cost_model.systems.price`, via
`cost_model.model_cases`): every candidate's step is that price, auto's pick is the search's top plan for the
same inputs, and a routing skew or a recorded trace (`Plan.routing_skew`) lets auto pick FSEP for its balance
where memory alone would not."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cost_model import model_cases
from cost_model.presets import resolve_hardware
from cost_model.search import Pricing, search
from moepass.api import resolve_auto
from moepass.errors import PlanError
from moepass.plan import Plan
from moepass.runtime.topology import Topology
from tests.cost_by_hand import MIXTRAL_8, spec

SMALL = [spec(8, 2, 512, 1024)] * 4


def _skewed_trace(steps: int, W: int, E: int, T: int, K: int) -> np.ndarray:
    """[steps, W, E] routed rows: two hot experts whose share moves a little from step to step."""
    rng = np.random.default_rng(3)
    p = np.ones(E)
    p[[1, 5]] = 6.0
    out = np.empty((steps, W, E))
    for t in range(steps):
        q = p * np.exp(0.1 * rng.standard_normal(E))
        out[t] = np.tile(T * K * q / q.sum(), (W, 1))
    return out


def test_every_candidate_is_priced_on_the_timeline():
    result = search(SMALL, (1, 4), (4, 512), profile="a100", pricing=Pricing(imbalance=1.8))
    hw = resolve_hardware("a100")
    groups = model_cases.contexts(result.shapes, 1, 4, (4, 512), hw, imbalance=1.8)
    assert len(groups) == 1 and groups[0][1].case.layers == 4
    for c in result.ranked:
        plan = model_cases.step_plan(c.form, ep_size=c.ep_size, packing=c.packing, chunks=c.a2a_chunks,
                                     capacity=c.capacity_factor, slots=c.slots, schedule="fair",
                                     micro_op_bytes=30 * 2**20, prefetch=2)
        assert float(c.step) == pytest.approx(model_cases.timed(plan, groups, hw).priced[0].step_s, rel=1e-12), c.label
    steps = [float(c.step) for c in result.eligible()]
    assert steps == sorted(steps)


@pytest.mark.parametrize("routing", ["uniform", "skew", "trace"])
def test_auto_pick_is_the_search_top(routing):
    T, W = 2 * 4096, 8
    skew = {"uniform": None, "skew": 2.5, "trace": _skewed_trace(6, W, 8, T, 2)}[routing]
    auto = Plan(form="auto", batch=(2, 4096), topology=Topology(1, W), hardware="a100", routing_skew=skew)
    plan, result = resolve_auto(auto, SimpleNamespace(blocks=MIXTRAL_8))
    imbalance, trace = (2.5, None) if routing == "skew" else (1.0, skew if routing == "trace" else None)
    direct = search(MIXTRAL_8, (1, W), (2, 4096), profile="a100", pricing=Pricing(imbalance=imbalance, trace=trace))
    assert result.best.label == direct.best.label and float(result.best.step) == float(direct.best.step)
    assert plan == auto.as_form(**direct.to_plan_kwargs())
    assert plan.routing_skew is None  # acts under form="auto" only


def test_auto_picks_fsep_on_skew_where_memory_does_not_decide():
    base = Plan(form="auto", batch=(2, 4096), topology=Topology(1, 8), hardware="a100")
    report = SimpleNamespace(blocks=MIXTRAL_8)
    uniform, r0 = resolve_auto(base, report)
    skewed, r1 = resolve_auto(base.replace(routing_skew=2.5), report)
    traced, r2 = resolve_auto(base.replace(routing_skew=_skewed_trace(6, 8, 8, 2 * 4096, 2)), report)
    assert uniform.form == "ep" and skewed.form == "fsep" and traced.form == "fsep"
    for r in (r0, r1, r2):  # EP fits in every case: the choice is the routing's, not memory's
        assert any(c.feasible for c in r.ranked if c.form == "ep")
    assert "Zipf s=" in r1.routing and "recorded trace (6 steps)" in r2.routing


def test_search_says_what_it_priced_with():
    text = search(SMALL, (2, 2), (4, 512), profile="h100", pricing=Pricing(imbalance=1.5)).table()
    head = text.splitlines()[0]
    assert "W=4 (2 node(s) x 2)" in head and "hardware h100 (" in head and "routing Zipf s=" in head
    assert "cost_model.systems.price" in head


@pytest.mark.parametrize(("value", "match"), [
    (0.5, r"Plan.routing_skew=0.5 is invalid: a max/mean of routed rows per rank is >= 1"),
    ("hot", r"Plan.routing_skew of type str is invalid"),
    ([[1.0, -2.0]], r"Plan.routing_skew of type list is invalid: .*non-negative counts"),
])
def test_routing_skew_refused(value, match):
    with pytest.raises(PlanError, match=match):
        Plan(form="auto", batch=(1, 64), routing_skew=value)


def test_routing_skew_only_under_auto_and_trace_experts_checked():
    with pytest.raises(PlanError, match="routing_skew"):
        Plan(form="ep", routing_skew=2.0)
    with pytest.raises(ValueError, match="routing trace over 4 experts for a block of E=8"):
        search(SMALL, (1, 4), (4, 512), profile="a100", pricing=Pricing(trace=np.ones((3, 4, 4))))
