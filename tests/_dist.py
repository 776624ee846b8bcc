"""A pool of spawned gloo ranks shared by every distributed test of the session.

Spawning W ranks costs seconds (and ~4 s per rank with transformers imported), so each world size
gets ONE pool for the whole session (one per pytest-xdist worker), closed at its end by conftest's session
fixture, not per module; tests send it many cases:

    from tests._dist import pool              # or: from _dist import pool
    results = pool(4).run(my_case, arg1, key=value)   # my_case(rank, world, *args, **kw) on every rank
    results[r]                                # rank r's return value (picklable)

The pool itself is `moepass.runtime.workers.Pool` (selfcheck runs its steps on it too). A case is a
module-level function; ranks import it by module name (the tests directory and the repo root are on
their sys.path). If a case raises on any rank, `run` raises `CaseError` with every failing rank's
traceback. A case that does not finish within `timeout` seconds makes the pool broken: it is killed
and the next `pool(W)` starts a fresh one (so one hang cannot hang the session); its `TimeoutError` holds
every hung rank's Python stacks (faulthandler, asked for by SIGUSR1 before the kill).

Workers: torch.set_num_threads(1); gloo with a 60 s default timeout; env MOEPASS_CHECK_COLLECTIVES=1
and MOEPASS_VERIFY=1. `shutdown()` (registered with atexit; call it from a session fixture too)
asks every worker to barrier + destroy_process_group, then joins; stragglers are killed by pid.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from moepass.runtime import workers
from moepass.runtime.workers import CaseError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
WORKER_ENV = {"MOEPASS_CHECK_COLLECTIVES": "1", "MOEPASS_VERIFY": "1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

__all__ = ["CaseError", "OWN_MODULES", "Pool", "fake_process_group", "fake_values", "pool", "shutdown"]

# A DeprecationWarning or FutureWarning raised from moepass's own modules is an error, in the ranks as in the
# pytest process (pyproject.toml's filterwarnings, the same regex): spawned ranks do not see pytest's
# filters, and every test module that holds a case imports this one, so the ranks install them here.
OWN_MODULES = r"(moepass|lowering|cost_model|samples)(\.|$)"
for _category in (DeprecationWarning, FutureWarning):
    warnings.filterwarnings("error", category=_category, module=OWN_MODULES)


class Pool(workers.Pool):
    """`moepass.runtime.workers.Pool` on gloo with the test session's worker settings."""

    def __init__(self, world: int, start_timeout: float = 120.0):
        super().__init__(world, backend="gloo", env=WORKER_ENV, paths=(REPO_DIR, TESTS_DIR), threads=1,
                         pg_timeout=60.0, start_timeout=start_timeout)


_POOLS: dict[int, Pool] = {}


def pool(world: int) -> Pool:
    """The session's pool of `world` ranks (started on first use, restarted if broken)."""
    current = _POOLS.get(world)
    if current is None or current.broken or not all(p.is_alive() for p in current.procs):
        if current is not None:
            current.kill()
        _POOLS[world] = Pool(world)
    return _POOLS[world]


def shutdown() -> None:
    while _POOLS:
        _, p = _POOLS.popitem()
        p.close()


atexit.register(shutdown)


@contextlib.contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[None]:
    """torch's `fake` process group in this process: `world` ranks seen from `rank`, graphs and shapes only
    (no data moves); destroyed after, with moepass's cached groups."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import reset_groups

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        reset_groups()


def fake_values(gm: Any, x: Any) -> dict[str, Any]:
    """Each node's fake value after a fake `x` propagates through the graph module `gm`; row counts that depend
    on data are unbacked symbols (a ShapeEnv lets the fakes create them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True), allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(x))
    return {n.name: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
