"""FSEP's deferred expert-gradient reduction under gloo: the restore's backward issues the gradient slices'
exchange and leaves it in flight until the next FSEP block's restore backward (the chain's first block, and
the end of the backward, complete theirs at once).

Every gradient is BIT-EQUAL to the non-deferred path (`Plan(defer_expert_grads=False)`: the restore's
backward waits at once, as before) and arrives through the normal accumulation path: `p.grad` accumulates over
two backward calls, post-accumulate-grad hooks fire once per parameter and backward, the DP replicas' sum (the
gradient hook, or `GradientSync` with `Plan(grad_sync="scheduler")`) and `clip_grad_norm_` see the finished
gradient, before `loss.backward()` returns; under activation checkpointing, a retain_graph double backward, an
exception in the backward (the next step works). The event log shows the overlap: the gradient slices of
layers 2 and 1 of a 3-layer model are in flight while the earlier layer's combine backward and expert backward
run, one reduction at a time.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_ep import CFG  # noqa: E402
from test_fsep import Reversed, rotating_planner  # noqa: E402

pytestmark = pytest.mark.distributed


# ----------------------------------------------------------------------------------------------
# Helpers that run inside the ranks.
# ----------------------------------------------------------------------------------------------


def compile_pair(model, waited_kw=None, **plan_kw):
    """The model compiled twice under FSEP (the placement changes every step): deferred (the default), and with
    the reduction waited at once in every block (`Plan(defer_expert_grads=False)`, the path before deferral;
    `waited_kw`: its plan's other fields)."""
    import moepass

    deferred = moepass.compile(model, moepass.Plan(form="fsep", planner=rotating_planner, **plan_kw))
    waited = moepass.compile(model, moepass.Plan(form="fsep", planner=rotating_planner, defer_expert_grads=False,
                                                 **{**plan_kw, **(waited_kw or {})}))
    return deferred, waited


def local_grads(cm) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
            for n, p in cm.named_parameters() if p.grad is not None}


def count_accumulations(cm) -> dict[str, int]:
    """Post-accumulate-grad hook calls per parameter (the dict fills as backward runs)."""
    params = {n: p for n, p in cm.named_parameters() if p.requires_grad}
    calls = dict.fromkeys(params, 0)
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


def unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [n for n in a if not torch.equal(a[n], b[n])]


def case_bit_equal(rank, world, style, nodes=1, ep_size=None, steps=2, grad_sync="none", **plan_kw):
    """Per step, both models: two backward calls without zero_grad (accumulation), then the DP sum of the
    replicated gradients, `clip_grad_norm_`, SGD. Returns every mismatch (empty: bit-equal), the accumulate
    calls per parameter and backward, and how many reductions each backward deferred."""
    import moepass
    from moepass.runtime.fsep import deferred
    DEFERRED = deferred()  # the process's queue (moepass.process_state.FSEP_DEFERRED)
    from moepass.runtime.grads import all_reduce_replicated_grads, clip_grad_norm_
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    pair = compile_pair(model, topology=moepass.Topology(nodes, world // nodes), ep_size=ep_size,
                        grad_sync=grad_sync, **plan_kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in pair]
    calls = [count_accumulations(m) for m in pair]
    report = {"grads": [], "norms": [], "params": [], "calls": set(), "deferred": [], "in_flight": 0,
              "experts": sorted(n for n, p in pair[0].named_parameters() if hasattr(p, "to_local")),
              "dp_size": pair[0].layers[0].mlp.layout.groups.dp_size}
    for step in range(steps):
        grads, norms = [], []
        for m, opt, c in zip(pair, opts, calls):
            for micro in range(2):  # accumulate without zero_grad
                tokens = torch.randint(0, CFG["vocab_size"], (2, 9),
                                       generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                before = DEFERRED.deferred_total
                m.loss(tokens).backward()
                report["in_flight"] = max(report["in_flight"], len(DEFERRED))  # 0: all arrived before it returned
                if m is pair[0]:
                    report["deferred"].append(DEFERRED.deferred_total - before)
                report["calls"] |= set(c.values())  # every parameter accumulated once per backward
                for name in c:
                    c[name] = 0
            if grad_sync == "none":
                all_reduce_replicated_grads(m)
            grads.append(local_grads(m))
            norms.append(clip_grad_norm_(m.parameters(), 0.05))
            opt.step()
            opt.zero_grad()
        report["grads"].append(unequal(*grads))
        report["norms"].append(bool(torch.equal(*norms)))
        report["params"].append(unequal(*({n: p.detach().clone() for n, p in m.state_dict().items()
                                           if torch.is_tensor(p) and p.is_floating_point()} for m in pair)))
    for m in pair:
        sync = getattr(m, "moepass_grad_sync", None)
        if sync is not None:
            sync.close()
    return report


def check_bit_equal(reports, deferred_per_backward):
    for r in reports:
        assert r["grads"] == [[]] * len(r["grads"]) and all(r["norms"]), r
        assert r["params"] == [[]] * len(r["params"]), r
        assert r["calls"] == {1}, r  # every parameter's post-accumulate-grad hook: once per backward
        assert r["in_flight"] == 0, r
        assert r["deferred"] == [deferred_per_backward] * len(r["deferred"]), r


def case_hf(rank, world, nodes):
    """HF Mixtral, deferred vs waited: every gradient over two accumulated backward calls."""
    import moepass
    from moepass.runtime.fsep import deferred
    DEFERRED = deferred()  # the process's queue (moepass.process_state.FSEP_DEFERRED)
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples import hf_models as H

    model, _ = H.build("mixtral")
    pair = compile_pair(model, topology=moepass.Topology(nodes, world // nodes))
    grads, deferred = [], []
    for m in pair:
        for micro in range(2):
            gen = torch.Generator().manual_seed(21 + micro + 10 * rank)
            ids = torch.randint(1, H.VOCAB, (2, H.SEQ), generator=gen)
            before = DEFERRED.deferred_total
            m(input_ids=ids, labels=torch.randint(1, H.VOCAB, ids.shape, generator=gen)).loss.backward()
            deferred.append(DEFERRED.deferred_total - before)
        all_reduce_replicated_grads(m)
        grads.append(local_grads(m))
    return {"unequal": unequal(*grads), "deferred": deferred[:2], "waited": deferred[2:]}


class Stack(torch.nn.Module):
    """`n` MoE blocks with tanh between them, each optionally under activation checkpointing; `fail`: raise
    from the gradient of block 0's output (after the later blocks' restore backward ran)."""

    def __init__(self, n, checkpointed=None):
        super().__init__()
        from samples.models import LoopMoE

        self.blocks = torch.nn.ModuleList(LoopMoE(32, 64, 8, 2) for _ in range(n))
        self.checkpointed = checkpointed  # None, "reentrant" or "non_reentrant"
        self.fail = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i, block in enumerate(self.blocks):
            if self.checkpointed is None:
                y = block(x)
            else:
                y = checkpoint(block, x, use_reentrant=self.checkpointed == "reentrant")
            if i == 0 and self.fail:
                y.register_hook(_raise)
            x = torch.tanh(y)
        return x


class Injected(RuntimeError):
    """The error a test raises inside the backward."""


def _raise(grad):
    raise Injected("raised in the backward")


def case_stack(rank, world, checkpointed=None, retain=False, fail_step=None, steps=3):
    """A 3-block stack, deferred vs waited, per step: every gradient (with `retain`, two backward calls over
    one retained graph); with `fail_step`, that step's backward raises in both models on every rank, and the
    next steps must match again."""
    from moepass.runtime.fsep import deferred
    DEFERRED = deferred()  # the process's queue (moepass.process_state.FSEP_DEFERRED)

    torch.manual_seed(0)
    # the waited path's prefetch does not survive non-reentrant checkpointing of each block (its gather saves the
    # table in the earlier block's region, which the recompute does not prefetch): compare with it off there
    waited_kw = {"prefetch_depth": 0} if checkpointed == "non_reentrant" else None
    pair = compile_pair(Stack(3, checkpointed), waited_kw, slots_per_device=5)
    report = {"unequal": [], "x_equal": [], "failed": [], "dangling": [], "deferred": []}
    for step in range(steps):
        grads, xs = [], []
        for m in pair:
            m.fail = step == fail_step
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank)).requires_grad_(True)
            loss = m(x).pow(2).sum()
            before = DEFERRED.deferred_total
            try:
                loss.backward(retain_graph=retain)
                if retain:
                    loss.backward()
            except Injected:
                report["failed"].append(step)
                report["dangling"].append(len(DEFERRED))
                m.zero_grad(set_to_none=True)
                continue
            report["deferred"].append(DEFERRED.deferred_total - before)
            grads.append(local_grads(m))
            xs.append(x.grad)
            m.zero_grad(set_to_none=True)
        if len(grads) == 2:
            report["unequal"].append(unequal(*grads))
            report["x_equal"].append(bool(torch.equal(*xs)))
    report["in_flight"] = len(DEFERRED)
    return report


def case_unusual(rank, world, variant):
    """Deferred vs waited over 2 steps of a model off the usual path: "reversed" (two blocks that run in the
    other order than registered, prefetch off so the chain stays enabled), "frozen" (a 3-block stack whose
    block 0 experts are frozen: nothing completes block 1's reduction but the end of the backward)."""
    from moepass.runtime.fsep import deferred
    DEFERRED = deferred()  # the process's queue (moepass.process_state.FSEP_DEFERRED)

    torch.manual_seed(0)
    if variant == "reversed":
        pair = compile_pair(Reversed(), prefetch_depth=0, slots_per_device=5)
    else:
        pair = compile_pair(Stack(3), slots_per_device=5)
        for m in pair:
            for name, p in m.named_parameters():
                p.requires_grad_(not (name.startswith("blocks.0.") and hasattr(p, "to_local")))
    calls = [count_accumulations(m) for m in pair]
    report = {"unequal": [], "deferred": [], "in_flight": [], "calls": set()}
    for step in range(2):
        grads = []
        for m, c in zip(pair, calls):
            x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            before = DEFERRED.deferred_total
            m(x).pow(2).sum().backward()
            report["deferred"].append(DEFERRED.deferred_total - before)
            report["in_flight"].append(len(DEFERRED))
            report["calls"] |= set(c.values())
            for name in c:
                c[name] = 0
            grads.append(local_grads(m))
            m.zero_grad(set_to_none=True)
        report["unequal"].append(unequal(*grads))
    return report


def case_events(rank, world, defer):
    """The event log of one step (after a warm-up step) of a 3-layer FSEP model: restore_bwd transfers with
    what ran while each was in flight."""
    import moepass
    from moepass.runtime import events
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style="fused", **{**CFG, "layers": 3}),
                         moepass.Plan(form="fsep", planner=rotating_planner, slots_per_device=5,
                                      defer_expert_grads=defer))
    log = events.EventLog(rank)
    for step in range(2):
        tokens = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(step + 10 * rank))
        loss = cm.loss(tokens)
        if step == 1:
            log.start()
        loss.backward()
    log.stop()
    backward = sorted(log.events, key=lambda e: e.start)
    restores = [e for e in backward if e.kind == "restore_bwd"]
    windows = []
    for r in restores:  # layers 2, 1, 0: the order backward issues them
        inside = [e.kind for e in backward if e is not r and r.start < e.start and e.end <= r.waited]
        pending = sum(1 for o in restores if o is not r and o.start < r.start < o.waited)
        windows.append({"inside": inside, "pending_at_issue": pending})
    explained = [line for layer in cm.layers for line in layer.mlp.layout.describe(layer.mlp)
                 if line.startswith("gradient slices")]
    return {"windows": windows, "kinds": sorted({e.kind for e in backward}), "explained": explained}


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------

LAYERS = CFG["layers"]


@pytest.mark.parametrize("style", ["loop", "fused", "gshard"])
def test_bit_equal_w2_styles(style):
    """W=2, every sample style, placement changing every step, prefetch on (default), restore again."""
    check_bit_equal(pool(2).run(case_bit_equal, style, slots_per_device=5), LAYERS - 1)


def test_bit_equal_keep_restored_and_chunked():
    check_bit_equal(pool(2).run(case_bit_equal, "fused", slots_per_device=5, keep_restored=True), LAYERS - 1)
    check_bit_equal(pool(2).run(case_bit_equal, "fused", slots_per_device=5, a2a_chunks=2), LAYERS - 1)


def test_bit_equal_w4_two_nodes():
    check_bit_equal(pool(4).run(case_bit_equal, "fused", nodes=2, slots_per_device=3), LAYERS - 1)


@pytest.mark.parametrize("grad_sync", ["none", "scheduler"])
def test_bit_equal_w4_dp_replicas(grad_sync):
    """W=4, FSEP over pairs of ranks (dp 2): the replicas' sum (the blocking gradient hook, or GradientSync's
    micro-ops) sees the finished gradient."""
    reports = pool(4).run(case_bit_equal, "fused", ep_size=2, grad_sync=grad_sync, slots_per_device=5)
    check_bit_equal(reports, LAYERS - 1)
    assert reports[0]["experts"] and reports[0]["dp_size"] == 2, reports[0]


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_bit_equal_hf_mixtral(world, nodes):
    pytest.importorskip("transformers")
    for r in pool(world).run(case_hf, nodes, timeout=180):
        assert r["unequal"] == [], r
        assert min(r["deferred"]) > 0 and r["waited"] == [0, 0], r


@pytest.mark.parametrize("checkpointed", [None, "non_reentrant", "reentrant"])
def test_bit_equal_stack_and_checkpointing(checkpointed):
    for r in pool(2).run(case_stack, checkpointed):
        assert r["unequal"] == [[]] * 3 and all(r["x_equal"]) and r["in_flight"] == 0, r
        # blocks 2 and 1 defer (block 0, the chain's first, completes its own at once); the waited model: none
        assert r["deferred"] == [2, 0] * 3, r


def test_retain_graph_double_backward():
    for r in pool(2).run(case_stack, retain=True, steps=2):
        assert r["unequal"] == [[]] * 2 and all(r["x_equal"]) and r["in_flight"] == 0, r
        assert r["deferred"] == [4, 0] * 2, r  # two backward calls per step


def test_exception_in_backward_leaves_nothing_dangling():
    """Step 1 raises in the backward after block 1's reduction was deferred: it is dropped by the next forward
    (its transfer completed), and steps 2 and 3 are bit-equal again."""
    for r in pool(2).run(case_stack, fail_step=1, steps=4):
        assert r["failed"] == [1, 1] and r["dangling"] == [1, 0], r
        assert r["unequal"] == [[]] * 3 and all(r["x_equal"]) and r["in_flight"] == 0, r


def test_blocks_in_another_order_complete_at_once():
    """Blocks that run in another order than registered: the chain is not known to be the backward's order, so
    no block defers (every reduction is waited in its own restore backward)."""
    for r in pool(2).run(case_unusual, "reversed"):
        assert r["unequal"] == [[], []] and r["deferred"] == [0, 0, 0, 0] and r["calls"] == {1}, r


def test_end_of_backward_completes_what_is_left():
    """Block 0's experts frozen: its restore has no backward, so block 1's reduction is completed by the end of
    the backward (`queue_callback`), before `backward()` returns."""
    for r in pool(2).run(case_unusual, "frozen"):
        assert r["unequal"] == [[], []] and r["deferred"] == [2, 0, 2, 0] and r["in_flight"] == [0] * 4, r
        assert r["calls"] == {1}, r


def test_plan_field():
    from moepass import Plan, PlanError

    with pytest.raises(PlanError, match=r"Plan.defer_expert_grads=False has no effect with form='ep': it makes FSEP "
                                        r"wait for its expert-gradient exchange in each layer's backward. Use "
                                        r"form='fsep', or leave it True."):
        Plan(form="ep", defer_expert_grads=False)
    with pytest.raises(PlanError, match=r"Plan.defer_expert_grads=1 is invalid: use True or False."):
        Plan(form="fsep", defer_expert_grads=1)
    assert Plan(form="fsep").defer_expert_grads and not Plan(form="auto", defer_expert_grads=False).defer_expert_grads


def test_event_log_shows_the_overlap():
    """Deferred: the gradient slices of layers 2 and 1 are in flight while the earlier layer's combine backward
    and expert backward run; layer 0's (the chain's first) are waited at once; one in flight at a time.
    Waited at once (before): nothing runs inside any of them."""
    for r in pool(2).run(case_events, True):
        (w2, w1, w0) = r["windows"]
        for w in (w2, w1):
            assert "combine_bwd" in w["inside"] and "expert_bwd" in w["inside"], r
            assert "restore_bwd" not in w["inside"], r
        assert w0["inside"] == [], r
        assert [w["pending_at_issue"] for w in r["windows"]] == [0, 0, 0], r
        deferred = "gradient slices: in flight until the next FSEP block's restore backward (deferred)"
        waited = "gradient slices: waited in its restore backward"
        assert r["explained"] == [waited, deferred, deferred], r
    for r in pool(2).run(case_events, False):
        assert [w["inside"] for w in r["windows"]] == [[], [], []], r
        assert r["explained"] == ["gradient slices: waited in its restore backward"] * 3, r
