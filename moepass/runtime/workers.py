"""A pool of spawned ranks, each in a process group, that run many cases: the test suite's distributed
cases (`tests/_dist.py`) and `python -m moepass selfcheck`'s training steps and bandwidth figures.

    pool = Pool(world=2)                              # gloo on CPU; Pool(world, backend="nccl") on GPUs
    results = pool.run(my_case, arg1, key=value)      # my_case(rank, world, *args, **kw) on every rank
    results[r]                                        # rank r's return value (picklable)
    pool.close()

A case is a module-level function; ranks import it by module name (`paths` are put on their sys.path).
If a case raises on any rank, `run` raises `CaseError` with every failing rank's traceback; so does a
return value that cannot be pickled (arguments and results are pickled by value in the sending process's own
thread, tensors included: nothing travels through shared-memory file descriptors). A case that
does not finish within `timeout` seconds makes the pool broken: it is killed (so one hang cannot hang the
caller), and `run` raises `TimeoutError` holding every live rank's Python stacks (all threads): before
killing, the pool sends each rank SIGUSR1, on which `faulthandler` writes them to a per-rank file; start a
new Pool for the next case.

Workers: `env` is set before torch is imported; torch.set_num_threads(`threads`); the process group with a
`pg_timeout` default timeout; with backend "nccl" rank r uses `cuda:r % device_count` (torch.cuda.set_device)
before the group is made. `close()` asks every worker to barrier + destroy_process_group, then joins;
stragglers are killed by pid.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp


class CaseError(RuntimeError):
    """A case raised on at least one rank."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a rank for its stacks (None: no such signal, e.g. Windows)
DUMP_WAIT_S = 5.0  # how long a timed-out run waits for the ranks' stacks before killing them


def worker(rank: int, world: int, port: int, backend: str, env: dict[str, str], paths: Sequence[str],
           threads: int, pg_timeout: float, tasks: Any, results: Any, stacks_path: str | None = None) -> None:
    """One rank: join the process group, then run the cases sent on `tasks` until None arrives. On
    `DUMP_SIGNAL`, faulthandler writes every thread's Python stack to `stacks_path` (works while the rank
    is blocked in C code: a collective, a lock)."""
    if stacks_path is not None and DUMP_SIGNAL is not None:
        stacks = open(stacks_path, "w")  # noqa: SIM115  # open for the process's lifetime: faulthandler writes to it
        faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    for path in paths:
        if path not in sys.path:
            sys.path.insert(0, path)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
    except BaseException:
        results.put((rank, "ready", False, pickle.dumps(traceback.format_exc())))
        return
    results.put((rank, "ready", True, pickle.dumps(None)))
    while True:
        task = tasks.get()
        if task is None:
            break
        case_id, module, name, payload = task
        try:
            args, kwargs = pickle.loads(payload)
            fn = getattr(importlib.import_module(module), name)
            torch.manual_seed(0)
            value = fn(rank, world, *args, **kwargs)
            # pickled here, by value: a return value that cannot be sent raises in this try and is reported. Left
            # to the queue's feeder thread (tensors through shared-memory file descriptors), a pickling error
            # (an unpicklable object, no file descriptor or /dev/shm left) is printed there and the result lost:
            # the case then looks hung on this rank until the parent's timeout, with no collective at fault
            reply = (rank, case_id, True, pickle.dumps(value))
        except BaseException:  # report, keep serving
            reply = (rank, case_id, False, pickle.dumps(traceback.format_exc()))
        results.put(reply)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, *, backend: str = "gloo", env: dict[str, str] | None = None,
                 paths: Sequence[str] = (), threads: int = 1, pg_timeout: float = 60.0,
                 start_timeout: float = 120.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Pool(backend={backend!r}) is invalid: use 'gloo' (CPU) or 'nccl' (CUDA GPUs)")
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.stacks_dir = tempfile.mkdtemp(prefix="moepass-pool-")  # rank r's stacks on a timeout: rank<r>.txt
        self.procs = [ctx.Process(target=worker, args=(r, world, port, backend, dict(env or {}), list(paths), threads,
                                                       pg_timeout, self.tasks[r], self.results,
                                                       os.path.join(self.stacks_dir, f"rank{r}.txt")), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False
        self._next = 0
        try:
            self._collect("ready", start_timeout)
        except CaseError:
            self.broken = True
            self.kill()
            raise

    def _collect(self, case_id: Any, timeout: float, label: str = "") -> list[Any]:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                # polled each second: a rank that died is noticed at once, not at the deadline
                rank, cid, ok, value = self.results.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                if time.monotonic() < deadline and any(self.procs[r].is_alive() for r in missing):
                    continue  # a rank still running may yet report (an error of its own, say): wait for it
                self.broken = True
                stacks = self.dump_stacks(missing)
                self.kill()
                failed = {r: v for r, (ok, v) in got.items() if not ok}
                if failed:  # a rank that raised and left: its error says more than the ranks still waiting
                    raise CaseError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))) from None
                why = "did not finish" if time.monotonic() >= deadline else "lost their processes (exited)"
                raise TimeoutError(f"case {label or case_id!r} {why} on ranks {missing} within {timeout:g} s; "
                                   f"the pool was killed. The ranks' stacks then:\n{stacks}") from None
            if cid == case_id:
                got[rank] = (ok, pickle.loads(value))  # every value comes pickled (see `worker`)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            raise CaseError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return [got[r][1] for r in range(self.world)]

    def run(self, fn, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run `fn(rank, world, *args, **kwargs)` on every rank; their return values, by rank."""
        if self.broken:
            raise RuntimeError("this pool is broken (a case timed out or a rank died); start a new Pool")
        self._next += 1
        case_id = self._next
        payload = pickle.dumps((args, kwargs))  # here, so arguments that cannot be sent raise in the caller
        for q in self.tasks:
            q.put((case_id, fn.__module__, fn.__qualname__, payload))
        return self._collect(case_id, timeout, label=f"{fn.__qualname__} (#{case_id})")

    def dump_stacks(self, ranks: Sequence[int]) -> str:
        """Every thread's Python stack of each live rank in `ranks` (faulthandler, on `DUMP_SIGNAL`), as text."""
        if DUMP_SIGNAL is None:
            return "(no stacks: this platform has no SIGUSR1)"
        asked = []
        for r in ranks:
            proc = self.procs[r]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, DUMP_SIGNAL)
                    asked.append(r)
                except OSError:
                    pass
        paths = {r: os.path.join(self.stacks_dir, f"rank{r}.txt") for r in asked}
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + DUMP_WAIT_S
        while paths and time.monotonic() < deadline:  # until every file has grown and stopped growing
            time.sleep(0.2)
            now = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
            if all(now.values()) and now == sizes:
                break
            sizes = now
        parts = []
        for r in ranks:
            text = ""
            if r in paths and os.path.exists(paths[r]):
                with open(paths[r], errors="replace") as f:
                    text = f.read().strip()
            why = "(no stacks: the rank did not answer)" if r in paths else "(no stacks: the process had exited)"
            parts.append(f"--- rank {r} (pid {self.procs[r].pid}) ---\n{text or why}")
        return "\n".join(parts)

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
        shutil.rmtree(self.stacks_dir, ignore_errors=True)
