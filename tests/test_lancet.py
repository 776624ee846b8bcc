"""Lancet (issue 18 item 4): the expert weight-gradient GEMMs run while the dispatch-backward all-to-all
is in flight (moepass/schedule.py `defer_weight_grads`, moepass/dialect.py `WeightGradSink`).

- op level (one process): `moe_sched.defer_wgrad` on the weights of `moe.expert_ffn` gives the same
  gradients bit for bit, the FFN's backward hands the weights placeholders and the sinks the real ones;
- W=2 gloo, EP with n = 1, 2, 4 chunks: outputs and every gradient bit for bit equal to the same graph
  with the deferral taken out, and to unchunked EP (outputs, input gradients bitwise; weights rtol 1e-6);
  every expert parameter's gradient arrives once (post-accumulate hooks); the event log has one
  "expert_wgrad" region per chunk, each inside the flight (issued before, waited after) of its chunk's
  "dispatch_bwd" all-to-all; without the deferral none is (the control: the weight GEMMs run in
  "expert_bwd", before that all-to-all is issued).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

D, F, E, K, T = 32, 64, 4, 2, 96  # block sizes; T tokens per rank (every expert chunk >= 4 rows: see schedule.py)


# ----------------------------------------------------------------------------------------------
# Op level.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["gate_up", "biases", "fused_gate_up"])
def test_defer_wgrad_op_bitwise_and_placeholders(layout):
    from moepass import dialect
    from moepass.runtime.scheduler import DEFER_WGRAD

    g = torch.Generator().manual_seed(0)
    counts_E = torch.tensor([5, 0, 7, 4])
    gate_rows = 2 * F if layout == "fused_gate_up" else F  # fused: w_gate holds gate and up, no w_up
    ops = [torch.randn(E, gate_rows, D, generator=g), None if layout == "fused_gate_up" else
           torch.randn(E, F, D, generator=g), torch.randn(E, D, F, generator=g)]
    ops += [torch.randn(E, F, generator=g), torch.randn(E, F, generator=g), torch.randn(E, D, generator=g)] \
        if layout == "biases" else [None] * 3
    params = [t.requires_grad_() for t in ops if t is not None]
    x_ND = torch.randn(int(counts_E.sum()), D, generator=g, requires_grad=True)
    grad_y = torch.randn(x_ND.shape, generator=g)

    def run(defer):
        for t in [*params, x_ND]:
            t.grad = None
        operands = [DEFER_WGRAD(t) if defer and t is not None else t for t in ops]
        seen = {}
        for i, t in enumerate(operands):
            if t is not None and defer:  # what the FFN's backward hands each operand: a stride-0 placeholder
                assert isinstance(getattr(t, dialect.WGRAD_SINK), dialect.WeightGradSink)
                t.register_hook(lambda grad, i=i: seen.update({i: (grad.stride(), bool((grad == 0).all()))}))
        y = torch.ops.moe.expert_ffn(x_ND, counts_E, *operands, "swiglu", 7.0, 1.702)
        y.backward(grad_y)
        return [t.grad.clone() for t in [*params, x_ND]], seen

    plain, _ = run(False)
    deferred, seen = run(True)
    for a, b in zip(plain, deferred):
        assert torch.equal(a, b)
    assert seen == {i: ((0,) * t.dim(), True) for i, t in enumerate(ops) if t is not None}


def test_defer_wgrad_passes_through_when_the_ffn_does_not_defer():
    """An operand with a sink that feeds something other than the torch expert FFN: gradient unchanged."""
    from moepass.runtime.scheduler import DEFER_WGRAD

    w = torch.randn(3, 4, requires_grad=True)
    (DEFER_WGRAD(w) * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3, 4), 2.0))


# ----------------------------------------------------------------------------------------------
# W=2 gloo.
# ----------------------------------------------------------------------------------------------


def block_input(rank):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(1000 + rank))


def without_deferral(cm):
    """The same compiled block with every defer_wgrad node taken out (what the schedule pass made before)."""
    from moepass.runtime.scheduler import DEFER_WGRAD

    for mod in [m for m in cm.modules() if hasattr(m, "graph")]:
        for node in [n for n in mod.graph.nodes if n.target is DEFER_WGRAD]:
            node.replace_all_uses_with(node.args[0])
            mod.graph.erase_node(node)
        mod.recompile()
    return cm


def run_block(cm, rank):
    """Output, input gradient, every parameter gradient, post-accumulate-hook calls, the event log."""
    from moepass.runtime import events

    calls = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
             for name, p in cm.named_parameters()]
    log = events.EventLog(rank).start()
    try:
        x = block_input(rank).requires_grad_()
        y = cm(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank)))
    finally:
        log.stop()
        for h in hooks:
            h.remove()
    grads = {name: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for name, p in cm.named_parameters()}
    return y.detach(), x.grad, grads, calls, log.events


def wgrad_windows(events):
    """Per "expert_wgrad" region: whether it lies inside the flight of the dispatch_bwd issued last before it."""
    a2a = sorted((e for e in events if e.kind == "dispatch_bwd"), key=lambda e: e.start)
    inside = []
    for w in sorted((e for e in events if e.kind == "expert_wgrad"), key=lambda e: e.start):
        issued = [a for a in a2a if a.start < w.start]
        inside.append(bool(issued) and issued[-1].waited > w.end)
    return inside


def case_lancet(rank, world, chunks):
    import moepass
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, F, E, top_k=K)
    topo = moepass.Topology(1, world)
    cm = moepass.compile(block, moepass.Plan(form="ep", a2a_chunks=chunks, topology=topo))
    deferred = next(h["stats"]["deferred_wgrad"] for h in cm.history if h["pass"] == "schedule")
    lancet = run_block(cm, rank)
    plain = run_block(without_deferral(moepass.compile(block, moepass.Plan(form="ep", a2a_chunks=chunks,
                                                                              topology=topo))), rank)
    single = run_block(moepass.compile(block, moepass.Plan(form="ep", a2a_chunks=1, topology=topo)), rank)
    (y, gx, g, calls, ev), (y0, gx0, g0, _, ev0), (y1, gx1, g1, _, _) = lancet, plain, single
    worst = max(((g[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-30)).item() for n in g1)
    return {"deferred": deferred, "equal_plain": torch.equal(y, y0) and torch.equal(gx, gx0)
            and all(torch.equal(g[n], g0[n]) for n in g0),
            "equal_single": torch.equal(y, y1) and torch.equal(gx, gx1), "param_rel": worst,
            "calls": calls, "params": sorted(g), "windows": wgrad_windows(ev), "control": wgrad_windows(ev0),
            "control_bwd": sum(1 for e in ev0 if e.kind == "expert_bwd"),
            "dispatch_bwd": sum(1 for e in ev if e.kind == "dispatch_bwd")}


@pytest.mark.distributed
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_lancet_wgrad_in_flight_and_bitwise(chunks):
    for r in pool(2).run(case_lancet, chunks):
        assert r["deferred"] == chunks  # every chunk's expert FFN
        assert r["equal_plain"], "deferring the weight GEMMs changed an output or a gradient"
        assert r["equal_single"] and r["param_rel"] <= 1e-6, r["param_rel"]
        assert r["calls"] == dict.fromkeys(r["params"], 1)  # every gradient arrives once
        assert r["dispatch_bwd"] == chunks
        assert r["windows"] == [True] * chunks, r["windows"]  # one region per chunk, each in flight
        assert r["control"] == [] and r["control_bwd"] == chunks  # no deferral: the GEMMs stay in expert_bwd


def case_lancet_locality(rank, world):
    import moepass
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, F, E, top_k=K)
    plan = moepass.Plan(form="locality", topology=moepass.Topology(world, 1), gate="learned", mu=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "changed the math": the locality router, as the plan names
        cm = moepass.compile(block, plan)
        plain_cm = without_deferral(moepass.compile(block, plan))
    deferred = next(h["stats"]["deferred_wgrad"] for h in cm.history if h["pass"] == "schedule")
    (y, gx, g, calls, ev), (y0, gx0, g0, _, ev0) = run_block(cm, rank), run_block(plain_cm, rank)
    return {"deferred": deferred, "equal_plain": torch.equal(y, y0) and torch.equal(gx, gx0)
            and all(torch.equal(g[n], g0[n]) for n in g0), "calls": calls, "params": sorted(g),
            "windows": wgrad_windows(ev), "control": wgrad_windows(ev0)}


@pytest.mark.distributed
def test_the_locality_form_defers_its_weight_gradients_too():
    """The locality form's exchanges are EP's: the schedule pass defers its expert weight GEMMs into the
    dispatch-backward's flight (not chunked), with the same outputs and gradients bit for bit."""
    for r in pool(2).run(case_lancet_locality):
        assert r["deferred"] == 1
        assert r["equal_plain"], "deferring the weight GEMMs changed an output or a gradient"
        assert r["calls"] == dict.fromkeys(r["params"], 1)
        assert r["windows"] == [True] and r["control"] == []
