"""Expert parallel, bad input (issue 4's must-shows, gloo pools of tests/_dist.py at W=2): E not
divisible by ep_size, plan / world mismatches, a peer that stops before the combine and a rank killed
mid-step (the survivor raises within the topology's timeout; that pool is discarded, the shared one
unaffected).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import Pool, pool  # noqa: E402
from test_ep_parity import _routed  # noqa: E402

pytestmark = pytest.mark.distributed

# ----------------------------------------------------------------------------------------------
# Tests: bad input.
# ----------------------------------------------------------------------------------------------


def case_bad_plans(rank, world):
    """The PlanError message of each bad plan (every rank raises the same one, nobody hangs)."""
    import moepass
    from moepass.errors import PlanError

    messages = {}
    attempts = {
        "experts_not_divisible": (3, moepass.Plan(form="ep", topology=moepass.Topology(1, world))),
        "ep_size_not_dividing_world": (4, moepass.Plan(form="ep", ep_size=3, topology=moepass.Topology(1, world))),
        "topology_world_mismatch": (4, moepass.Plan(form="ep", topology=moepass.Topology(2, 2))),
    }
    for name, (E, plan) in attempts.items():
        torch.manual_seed(0)
        try:
            moepass.compile(_routed(8, E, 1), plan)
        except PlanError as err:
            messages[name] = str(err)
        else:
            messages[name] = None
    return messages


def test_bad_plans_raise_clear_errors():
    messages = pool(2).run(case_bad_plans, timeout=60)
    assert messages[0] == messages[1]
    m = messages[0]
    assert m["experts_not_divisible"] is not None and all(
        s in m["experts_not_divisible"] for s in ("Plan.ep_size=None (the world size, 2)", "block moe", "3 experts",
                                                 "dividing both 3 and the world size 2", "valid: [1]",
                                                 "Plan(blocks={'moe': None})")), m["experts_not_divisible"]
    assert m["ep_size_not_dividing_world"] == "Plan.ep_size=3 is invalid: it must divide the world size 2."
    assert m["topology_world_mismatch"] is not None and all(
        s in m["topology_world_mismatch"] for s in ("Plan.topology=Topology(nodes=2, ranks_per_node=2",
                                                   "4 ranks but the world has 2", "nodes*ranks_per_node=2"))


def case_peer_lost_before_combine(rank, world, how, timeout_s, path=None):
    """Rank 1 runs the dispatch, then either dies (`os._exit`) or never issues the combine (returns);
    rank 0 runs a normal step and must raise within the topology's timeout."""
    import json
    import time

    from torch.fx import Interpreter

    import moepass
    from moepass.runtime import collectives as comm

    case_start = time.monotonic()
    torch.manual_seed(0)
    cm = moepass.compile(_routed(8, 4, 2), moepass.Plan(form="ep", topology=moepass.Topology(1, world,
                                                                                               timeout=timeout_s)))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        class StopBeforeCombine(Interpreter):
            def call_function(self, target, args, kwargs):
                if target is comm.ALL_TO_ALL and args[4] == "combine":
                    if how == "killed":
                        os._exit(3)
                    raise StopIteration
                return super().call_function(target, args, kwargs)

        try:
            StopBeforeCombine(cm.moe).run(x)
        except StopIteration:
            return None
    start = time.monotonic()
    result = {"raised": None}
    try:
        cm(x).sum().backward()
    except Exception as err:
        result = {"raised": type(err).__name__, "message": str(err)[:800]}
    result["seconds"] = time.monotonic() - start
    result["case_seconds"] = time.monotonic() - case_start
    if path:
        with open(path, "w") as f:
            json.dump(result, f)
    return result


def test_peer_stops_before_combine_raises_within_timeout():
    """Rank 1 stops before the combine (alive, never joins): rank 0 gets a timeout error; the pool is fine."""
    timeout_s = 2.5  # a timeout no other test uses: the abandoned EP group is never reused
    result = pool(2).run(case_peer_lost_before_combine, "stalled", timeout_s, timeout=60)[0]  # a hang: fails at 60 s
    assert result["raised"] is not None and "Timed out" in result["message"], result
    assert "waiting 2500ms" in result["message"], result  # the topology's timeout fired, not gloo's 60 s default


def _ping(rank, world):
    import torch.distributed as dist

    import moepass  # noqa: F401  (a fresh pool's first case pays the import)

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_rank_killed_mid_step_raises_within_timeout(tmp_path):
    """Rank 1 `os._exit`s between dispatch and combine. On a dedicated pool (a killed rank breaks its
    pool): rank 0 raises within the timeout, the pool is discarded (no process left), and the shared
    W=2 pool still works."""
    timeout_s, path = 5.0, str(tmp_path / "rank0.json")
    victim = Pool(2)
    try:
        assert victim.run(_ping, timeout=120) == [3.0, 3.0]  # workers up, moepass imported
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):  # rank 1 never reports: the pool gives up
            victim.run(case_peer_lost_before_combine, "killed", timeout_s, path=path, timeout=10)
        assert victim.broken
    finally:
        victim.kill()
    assert not any(p.is_alive() for p in victim.procs)
    for q in (victim.results, *victim.tasks):
        q.close()
    import json

    assert os.path.exists(path), "rank 0 did not return before the pool killed it (10 s): it hung"
    with open(path) as f:
        result = json.load(f)
    # rank 0 wrote its result, so it returned before the pool gave up on rank 1 (10 s) and killed it: it
    # raised and did not hang (gloo words the lost peer differently from run to run: closed, reset, timed out)
    assert result["raised"] is not None, result
    print(f"\nrank 0 raised {result['raised']} after {result['seconds']:.2f} s (case {result['case_seconds']:.1f} s): "
          f"{result['message'][:120]}")
    assert pool(2).run(_ping) == [3.0, 3.0]  # the session's pool was never involved
