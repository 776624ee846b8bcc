"""FSDP2 (`fully_shard`) models under the priority scheduler (issue 18 item 3), W=2 gloo, the shared pool.

Set-up: the demo LM (fused experts with a shared expert) compiled for EP with 2 chunks; every
attention, every shared expert and the root `fully_shard`-ed (the EP experts ignored: their own mesh).
The shared expert runs between the last combine issue and its wait, so its FSDP all-gather (forward)
falls inside an all-to-all's flight unless something delays it: the negative control (rank 1 holds
its combines back 50 ms, so rank 0's are certainly in flight then).

- `schedule_fsdp` vs the same model with FSDP's own comms: outputs, every gradient and the parameters
  after 3 Adam steps equal bit for bit (a reduce-scatter cut by columns reduces the same W values);
- event log: with the rule, no FSDP micro-op is queued while an all-to-all is queued or running (0);
  with the scheduler logging only (`enabled=False`, same micro-ops) some are: the count can fail;
- every FSDP collective goes through the scheduler, cut into micro-ops of <= micro_op_bytes of buffer;
- `on_completion` (what every collective's completion goes through): a work whose future is done at
  enqueue (NCCL) completes when `is_completed()` says so, a gloo one when its future does.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed

LM = dict(vocab_size=256, dim=64, ffn_dim=64, num_experts=4, top_k=2, layers=2, heads=4)
MICRO_OP_BYTES = 8 * 1024
STEPS = 3
FSDP_KINDS = ("fsdp_all_gather", "fsdp_reduce_scatter")


def tokens(rank, step):
    return torch.randint(0, LM["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))


def sharded_model(world, grad_sync="none"):
    """The compiled demo LM with attention, shared experts and root under fully_shard (experts ignored)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style="fused", **LM),
                         moepass.Plan(form="ep", a2a_chunks=2, topology=moepass.Topology(1, world),
                                      micro_op_bytes=MICRO_OP_BYTES, grad_sync=grad_sync))
    experts = {p for p in cm.parameters() if isinstance(p, DTensor)}
    for layer in cm.layers:
        fully_shard(layer.attn)
        fully_shard(layer.mlp.shared_expert)
    fully_shard(cm, ignored_params=experts)
    return cm


class DelayCombine:
    """A registry listener that holds this rank's combine all-to-alls back `seconds` before their launch:
    the peer's combine is then certainly in flight when its shared expert's FSDP all-gather comes up."""

    def __init__(self, seconds):
        self.seconds = seconds

    def queued(self, kind, category, group_name, nbytes):
        if kind == "combine":
            time.sleep(self.seconds)

    def completed(self, token, end):
        pass

    def mark(self, name, phase):
        pass


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def case_fsdp(rank, world, mode):
    """mode "plain": FSDP's own comms; "priority": schedule_fsdp; "plan": schedule_fsdp on the scheduler of
    Plan(grad_sync="scheduler"); "log_only": the same micro-ops through a scheduler with the rule off. Per step: output, loss, every local gradient; then the parameters."""
    from moepass.runtime import events, grad_sync, scheduler

    cm = sharded_model(world, "scheduler" if mode == "plan" else "none")
    sched = None
    if mode == "plan":  # the scheduler moepass.compile installed for Plan(grad_sync="scheduler")
        sched = grad_sync.schedule_fsdp(cm)
        assert sched is cm.moepass_grad_sync.scheduler
    elif mode != "plain":
        sched = scheduler.PriorityScheduler(MICRO_OP_BYTES, enabled=mode == "priority")
        grad_sync.schedule_fsdp(cm, sched)
    opt = torch.optim.Adam(cm.parameters(), lr=1e-2)
    log = events.EventLog(rank).start()
    delay = DelayCombine(0.05)
    if rank == 1:
        scheduler.add_listener(delay)
    steps, during, fsdp_events, sizes, waits = [], 0, 0, [], []
    try:
        for step in range(STEPS):
            log.clear()
            out = cm(tokens(rank, step)[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                     tokens(rank, step)[:, 1:].reshape(-1))
            loss.backward()
            steps.append((out.detach(), loss.detach(),
                          {n: local(p.grad).clone() for n, p in cm.named_parameters() if p.grad is not None}))
            opt.step()
            opt.zero_grad()
            during += events.launched_during_a2a(log.events, FSDP_KINDS)
            mine = [e for e in log.events if e.kind in FSDP_KINDS]
            fsdp_events += len(mine)
            sizes += [e.nbytes for e in mine]
            waits += events.priority_waits(log.events)
    finally:
        log.stop()
        scheduler.remove_listener(delay)
        if mode == "plan":
            cm.moepass_grad_sync.close()
        elif sched is not None:
            sched.close()
    params = {n: local(p.detach()).clone() for n, p in cm.named_parameters()}
    return {"steps": steps, "params": params, "during": during, "fsdp_events": fsdp_events, "sizes": sizes,
            "max_wait": max(waits, default=0), "a2a": len(waits), "launched": sched.launched if sched else 0}


@pytest.mark.parametrize("mode", ["priority", "plan"])
def test_fsdp_priority_equals_plain_and_no_collective_during_a2a(mode):
    plain = pool(2).run(case_fsdp, "plain")
    prio = pool(2).run(case_fsdp, mode)
    for p, q in zip(plain, prio):
        for (y0, l0, g0), (y1, l1, g1) in zip(p["steps"], q["steps"]):
            assert torch.equal(y0, y1) and torch.equal(l0, l1)
            assert g0.keys() == g1.keys() and len(g0) == len(p["params"])
            for name in g0:
                assert torch.equal(g0[name], g1[name]), name
        for name in p["params"]:
            assert torch.equal(p["params"][name], q["params"][name]), name
        assert q["a2a"] > 0 and q["during"] == 0, q["during"]
        assert q["max_wait"] <= 1
        assert q["fsdp_events"] == q["launched"]  # every FSDP collective went through the scheduler
        assert max(q["sizes"]) <= MICRO_OP_BYTES // 2  # W=2: (W-1) of W blocks' columns move


def test_fsdp_log_only_control_launches_during_a2a():
    control = pool(2).run(case_fsdp, "log_only")
    # rank 0's last combine of each layer waits for rank 1's (held back): its shared expert's all-gather
    # micro-ops start while it is in flight, every layer of every step
    assert control[0]["during"] >= STEPS * LM["layers"], [r["during"] for r in control]


def test_micro_op_columns():
    from moepass.runtime.grad_sync import micro_op_columns

    # W=2 fp32, 16-byte micro-ops: 2 columns of both blocks per micro-op, the last one shorter
    assert micro_op_columns(2, 5, 4, 16) == [(0, 2), (2, 4), (4, 5)]
    assert micro_op_columns(4, 3, 4, 1) == [(0, 1), (1, 2), (2, 3)]  # never empty: at least one column
    assert micro_op_columns(2, 0, 4, 16) == []


class EnqueuedWork:
    """A work as NCCL gives it: its future is complete at enqueue, `is_completed()` when the GPU is done."""

    def __init__(self):
        self.finished = False
        self.future = torch.futures.Future()
        self.future.set_result(None)

    def get_future(self):
        return self.future

    def is_completed(self):
        return self.finished


def test_on_completion_waits_for_the_work_not_its_enqueue_future():
    from moepass.runtime.scheduler import on_completion

    work, called = EnqueuedWork(), []
    assert on_completion(work, lambda: called.append(time.perf_counter())) is work
    time.sleep(0.05)
    assert called == []  # the future was done at once: not a completion
    work.finished = True
    finished = time.perf_counter()
    deadline = finished + 5
    while not called and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert len(called) == 1 and called[0] >= finished
    time.sleep(0.01)
    assert len(called) == 1  # once

    done = torch.futures.Future()  # a gloo-like work: the future completes with the transfer
    gloo = EnqueuedWork()
    gloo.future = done
    on_completion(gloo, lambda: called.append(0.0))
    assert len(called) == 1
    done.set_result(None)
    assert len(called) == 2


def test_schedule_fsdp_without_fully_shard_says_so():
    from moepass.runtime.grad_sync import schedule_fsdp

    with pytest.raises(ValueError, match=r"schedule_fsdp: Linear has no fully_shard module: call "
                                         r"torch.distributed.fsdp.fully_shard on its dense parts first"):
        schedule_fsdp(torch.nn.Linear(2, 2), scheduler=object())  # type: ignore[arg-type]
