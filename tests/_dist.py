"""A pool of spawned gloo ranks shared by every distributed test of the session.

Spawning W ranks costs seconds (and ~4 s per rank with transformers imported), so each world size
gets ONE pool for the whole session; tests send it many cases:

    from tests._dist import pool              # or: from _dist import pool
    results = pool(4).run(my_case, arg1, key=value)   # my_case(rank, world, *args, **kw) on every rank
    results[r]                                # rank r's return value (picklable)

A case is a module-level function; ranks import it by module name (the tests directory and the repo
root are on their sys.path). If a case raises on any rank, `run` raises `CaseError` with every
failing rank's traceback. A case that does not finish within `timeout` seconds makes the pool
broken: it is killed and the next `pool(W)` starts a fresh one (so one hang cannot hang the session).

Workers: torch.set_num_threads(1); gloo with a 60 s default timeout; env MOEPASS_CHECK_COLLECTIVES=1
and MOEPASS_VERIFY=1. `shutdown()` (registered with atexit; call it from a session fixture too)
asks every worker to barrier + destroy_process_group, then joins; stragglers are killed by pid.
"""

from __future__ import annotations

import atexit
import importlib
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
WORKER_ENV = {"MOEPASS_CHECK_COLLECTIVES": "1", "MOEPASS_VERIFY": "1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class CaseError(RuntimeError):
    """A case raised on at least one rank."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(WORKER_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    for path in (REPO_DIR, TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results.put((rank, "ready", True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        case_id, module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            torch.manual_seed(0)
            results.put((rank, case_id, True, fn(rank, world, *args, **kwargs)))
        except BaseException:  # report, keep serving
            results.put((rank, case_id, False, traceback.format_exc()))
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, start_timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False
        self._next = 0
        self._collect("ready", start_timeout)

    def _collect(self, case_id: Any, timeout: float) -> list[Any]:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                rank, cid, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
                    continue
                self.broken = True
                self.kill()
                raise TimeoutError(f"case {case_id!r} did not finish on ranks "
                                   f"{sorted(set(range(self.world)) - set(got))} within {timeout:.0f} s; "
                                   f"the pool was killed") from None
            if cid == case_id:
                got[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            raise CaseError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return [got[r][1] for r in range(self.world)]

    def run(self, fn, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run `fn(rank, world, *args, **kwargs)` on every rank; their return values, by rank."""
        if self.broken:
            raise RuntimeError("this pool is broken (a case timed out); get a new one with pool(W)")
        self._next += 1
        case_id = self._next
        for q in self.tasks:
            q.put((case_id, fn.__module__, fn.__qualname__, args, kwargs))
        return self._collect(case_id, timeout)

    def close(self, timeout: float = 30.0) -> None:
        if not self.broken:
            for q in self.tasks:
                q.put(None)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


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
