"""Faults: a rank that stalls or dies in the middle of a collective never hangs the others.

The fault matrix: for each form and phase — EP's dispatch and combine, FSEP's weight restore, head
parallel's token exchange, and the expert-gradient all-reduce of replicated experts (EP with ep_size < W) —
rank 1 stops right before it would launch that collective, either stalled (alive, never joining) or killed
(`os._exit`). Rank 0 runs an ordinary training step and must raise within the plan's
`Topology(timeout=...)` (plus slack), with the timeout named in the message. The collective is caught where
every moepass collective is launched (`moepass.runtime.scheduler.issue_collective`, which names its kind),
so the fault lands exactly in the named phase whatever the graph looks like.

Stalled cases share the session's W=2 pool (each uses a timeout no other test uses, so the abandoned
groups are never handed out again: the group cache keys on the timeout); a killed rank breaks its pool, so
those run on a dedicated pool each, which is discarded.

Recovery: a logical checkpoint saved before a fault loads into a freshly compiled model, which resumes
with the losses an uninterrupted run has.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests._dist import Pool, pool

# phase -> (form, the collective kind rank 1 stops before, plan fields)
PHASES = {
    "ep-dispatch": ("ep", "dispatch", {}),
    "ep-combine": ("ep", "combine", {}),
    "fsep-restore": ("fsep", "restore", {}),
    "hp-exchange": ("hp", "hp_dispatch", {}),
    "grad-sync": ("ep", "grad_allreduce", {"ep_size": 1}),  # experts replicated over the 2 ranks
}
SLACK_S = 20.0  # compile + a step on a loaded 2-core machine, on top of the timeout


class _Stall(Exception):
    """Raised on the victim instead of launching the collective: it returns without ever joining."""


def _model(form: str):
    from samples.models import tiny_latent_lm, tiny_mixtral

    torch.manual_seed(0)
    if form == "hp":
        return tiny_latent_lm(dim=32, vocab_size=32)
    return tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32, style="loop")


def _plan(phase: str, timeout_s: float):
    import moepass

    form, _, fields = PHASES[phase]
    return moepass.Plan(form=form, topology=moepass.Topology(1, 2, timeout=timeout_s), **fields)


def _step(cm, rank: int, step: int) -> torch.Tensor:
    from moepass.runtime.grads import all_reduce_replicated_grads

    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1000 * step + rank))
    loss = cm.loss(tokens)
    loss.backward()
    all_reduce_replicated_grads(cm)
    return loss.detach()


def case_fault(rank: int, world: int, phase: str, how: str, timeout_s: float, path: str | None = None) -> dict | None:
    """Rank 1 stops before the phase's collective (stalled or killed); rank 0's result (also written to `path`:
    a killed peer breaks the pool, which may not collect rank 0's return value)."""
    import json

    import moepass
    from moepass.runtime import scheduler

    cm = moepass.compile(_model(PHASES[phase][0]), _plan(phase, timeout_s))
    if rank == 1:
        kind, launch = PHASES[phase][1], scheduler.issue_collective

        def faulty(k, *args, **kwargs):
            if k == kind:
                if how == "killed":
                    os._exit(3)
                raise _Stall(k)
            return launch(k, *args, **kwargs)

        scheduler.issue_collective = faulty
        try:
            _step(cm, rank, 0)
        except _Stall:
            return None
        finally:
            scheduler.issue_collective = launch
        raise AssertionError(f"rank 1 never reached the {kind!r} collective")
    start = time.monotonic()
    result: dict = {"raised": None}
    try:
        _step(cm, rank, 0)
    except Exception as err:  # the error rank 0 gets is the point
        result = {"raised": type(err).__name__, "message": str(err)[:600]}
    result["seconds"] = time.monotonic() - start
    if path:
        with open(path, "w") as f:
            json.dump(result, f)
    return result


def _assert_raised_in_time(result: dict | None, timeout_s: float, phase: str, how: str) -> None:
    assert result is not None and result["raised"] is not None, result
    assert result["seconds"] < timeout_s + SLACK_S, result
    print(f"\nfault matrix | {phase} | {how} | {result['raised']} after {result['seconds']:.2f} s "
          f"(timeout {timeout_s} s) | {result['message'][:100]}")


@pytest.mark.parametrize("phase", list(PHASES))
def test_stalled_rank_raises_on_the_other_within_the_timeout(phase):
    timeout_s = 2.0 + 0.1 * list(PHASES).index(phase)  # one timeout per case: fresh groups
    results = pool(2).run(case_fault, phase, "stalled", timeout_s, timeout=120)
    assert results[1] is None
    _assert_raised_in_time(results[0], timeout_s, phase, "stalled")
    assert results[0]["seconds"] >= timeout_s, results[0]  # it waited for the peer as long as the plan says
    assert f"{int(round(timeout_s * 1000))}ms" in results[0]["message"], results[0]  # the plan's timeout, not gloo's
    kind = PHASES[phase][1]
    assert results[0]["message"].startswith(f"moepass: the {kind!r} collective on process group "), results[0]
    assert "a peer rank died or did not join within the group's timeout" in results[0]["message"], results[0]


@pytest.mark.parametrize("phase", list(PHASES))
def test_killed_rank_raises_on_the_other_within_the_timeout(phase, tmp_path):
    """On a dedicated pool (a dead rank breaks it): rank 0 raises (gloo words a lost peer as closed, reset or
    timed out) within the timeout, and no process of that pool is left."""
    timeout_s, path = 3.0, str(tmp_path / "rank0.json")
    victim = Pool(2)
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):  # rank 1 never reports: the pool gives up on it
            victim.run(case_fault, phase, "killed", timeout_s, path=path, timeout=timeout_s + SLACK_S)
    finally:
        victim.kill()
        for q in (victim.results, *victim.tasks):
            q.close()
    assert not any(p.is_alive() for p in victim.procs)
    assert os.path.exists(path), "rank 0 did not return before the pool gave up: it hung"
    with open(path) as f:
        result = json.load(f)
    _assert_raised_in_time(result, timeout_s, phase, "killed")
    # the lost peer surfaces in whichever collective rank 0 reads next; moepass names it and what to do
    assert result["message"].startswith("moepass: the '"), result
    assert "a peer rank died or did not join" in result["message"], result


def case_resume(rank: int, world: int, path: str, steps: int, fault_at: int | None) -> list[float]:
    """Train `steps` SGD steps; save a logical checkpoint after step 1; with `fault_at`, rank 1 stalls in the
    dispatch of that step (rank 0 gets a timeout) and both resume from the checkpoint in a fresh compile."""
    import moepass
    from moepass.runtime import scheduler

    def fresh(timeout_s: float):
        cm = moepass.compile(_model("ep"), _plan("ep-dispatch", timeout_s))
        return cm, torch.optim.SGD(cm.parameters(), lr=0.1)

    timeout_s = 4.0 if fault_at is None else 4.5
    cm, opt = fresh(timeout_s)
    losses = []
    for step in range(steps):
        if step == fault_at:
            break
        opt.zero_grad()
        losses.append(_step(cm, rank, step).item())
        opt.step()
        if step == 1:
            torch.save(moepass.logical_state_dict(cm), f"{path}.{rank}")
    if fault_at is None:
        return losses
    launch = scheduler.issue_collective
    try:
        if rank == 1:
            def stall(k, *args, **kwargs):
                if k == "dispatch":
                    raise _Stall(k)
                return launch(k, *args, **kwargs)

            scheduler.issue_collective = stall
        opt.zero_grad()
        _step(cm, rank, fault_at)
        raise AssertionError("the faulty step completed")
    except _Stall:
        assert rank == 1
    except RuntimeError as err:
        assert rank == 0 and "4500ms" in str(err), err
    finally:
        scheduler.issue_collective = launch
    cm, opt = fresh(5.0)  # a new compile, as a restarted job would
    moepass.load_logical_state_dict(cm, torch.load(f"{path}.{rank}"))
    resumed = losses[:2]
    for step in range(2, steps):
        opt.zero_grad()
        resumed.append(_step(cm, rank, step).item())
        opt.step()
    return resumed


def test_checkpoint_before_a_fault_resumes_with_identical_losses(tmp_path):
    path = str(tmp_path / "ckpt")
    clean = pool(2).run(case_resume, path + ".clean", 4, None, timeout=120)
    resumed = pool(2).run(case_resume, path, 4, 2, timeout=120)
    assert resumed == clean  # bitwise: the same floats, step by step, on both ranks
