"""The distributed-test harness (`moepass.runtime.workers.Pool`): a case that hangs makes `run` raise
`TimeoutError` holding every hung rank's Python stacks (faulthandler on SIGUSR1, sent before the kill),
also for a rank blocked inside a collective; a result that cannot be sent is an error at once, not a
rank that looks hung; deprecated APIs called from moepass's modules are errors, also in the ranks.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import Pool  # noqa: E402

from moepass.runtime import workers  # noqa: E402

pytestmark = pytest.mark.distributed


def stuck_in_a_named_function() -> None:
    time.sleep(600)


def case_hang(rank: int, world: int) -> None:
    """Rank 1 sleeps in a named function; rank 0 waits for it in a barrier (blocked in C code)."""
    import torch.distributed as dist

    if rank == 1:
        stuck_in_a_named_function()
    dist.barrier()


@pytest.mark.skipif(workers.DUMP_SIGNAL is None, reason="no SIGUSR1 on this platform")
def test_a_hung_case_reports_every_ranks_stack():
    victim = Pool(2)
    try:
        with pytest.raises(TimeoutError) as info:
            victim.run(case_hang, timeout=5)
        assert victim.broken
    finally:
        victim.kill()
    message = str(info.value)
    assert "did not finish on ranks [0, 1] within 5 s" in message, message
    rank0, rank1 = message.split("--- rank 1")
    assert "--- rank 0" in rank0 and "in case_hang" in rank0 and "barrier" in rank0, message
    assert "in stuck_in_a_named_function" in rank1 and "test_dist_harness.py" in rank1, message
    assert not any(p.is_alive() for p in victim.procs) and not os.path.exists(victim.stacks_dir)
    for q in (victim.results, *victim.tasks):
        q.close()


def case_unsendable(rank: int, world: int) -> object:
    """Rank 0 returns what pickle refuses (a lock); rank 1 a tensor (sent by value)."""
    import threading

    import torch

    return threading.Lock() if rank == 0 else torch.arange(3.0)


def test_a_result_that_cannot_be_sent_is_an_error_not_a_hang():
    from _dist import CaseError, pool

    start = time.monotonic()
    with pytest.raises(CaseError, match=r"(?s)rank 0.*pickle.dumps\(value\).*cannot pickle '_thread.lock'"):
        pool(2).run(case_unsendable, timeout=60)
    assert time.monotonic() - start < 30  # reported when the case returns, not at the timeout
    with pytest.raises(TypeError, match="cannot pickle"):  # an argument that cannot be sent raises here
        pool(2).run(case_unsendable, threading_lock())
    import torch

    assert pool(2).run(case_echo, torch.arange(4.0))[1].tolist() == [0.0, 1.0, 2.0, 3.0]  # the pool still serves


def threading_lock():
    import threading

    return threading.Lock()


def case_echo(rank: int, world: int, value: object) -> object:
    return value


def warn_from(module: str, category: type[Warning]) -> None:
    """A warning attributed to `module` (as one raised by a deprecated API that `module` calls)."""
    import warnings

    warnings.warn_explicit("a deprecated API", category, filename=f"{module.replace('.', '/')}.py", lineno=1,
                           module=module)


def case_warn(rank: int, world: int, module: str, category_name: str) -> str:
    warn_from(module, {"FutureWarning": FutureWarning, "DeprecationWarning": DeprecationWarning}[category_name])
    return "no error"


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
@pytest.mark.parametrize("module", ["moepass.runtime.collectives", "lowering.codegen", "cost_model.fsep",
                                    "samples.models"])
def test_a_deprecation_in_our_own_modules_is_an_error_here(module, category):
    with pytest.raises(category, match="a deprecated API"):
        warn_from(module, category)


def test_a_deprecation_in_our_own_modules_is_an_error_in_the_ranks():
    from _dist import CaseError, pool

    with pytest.raises(CaseError, match=r"(?s)rank 0.*FutureWarning: a deprecated API.*rank 1"):
        pool(2).run(case_warn, "moepass.runtime.collectives", "FutureWarning")
    with pytest.raises(CaseError, match=r"DeprecationWarning: a deprecated API"):
        pool(2).run(case_warn, "lowering.codegen", "DeprecationWarning")
    # another library's warning (not ours to fix) is not turned into an error
    assert pool(2).run(case_warn, "transformers.utils", "FutureWarning") == ["no error"] * 2
