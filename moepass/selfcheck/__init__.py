"""`python -m moepass selfcheck`: does moepass work on this machine? One table, one row per item, each with
its verdict (ok, FAIL and the one-line error, or skipped and the reason) and its time:

- kernel FAMILY: every kernel family of `lowering/` against its torch reference, forward and backward, fp32
  and 16-bit (`lowering.numerics`, the checks tests/test_kernels_gpu.py runs), in a child process: compiled
  Triton on a CUDA GPU (TRITON_INTERPRET=0), interpreted on CPU on small shapes (TRITON_INTERPRET=1);
- form FORM: one training step of each parallel form of the sample LM against the untouched model's step
  (`moepass.selfcheck.steps` says how), on W ranks: W = the CUDA GPUs with NCCL, or 2 CPU processes with gloo;
- collective OP SIZE: all_to_all_single and all_reduce across the W ranks, their result checked, their time
  and bandwidth (skipped at W=1);
above them a header: versions, devices, backend, world size.

Each item is isolated: an item that fails, raises or hangs (its time limit) is reported as its own FAIL and
the others still run (the ranks are restarted after a hang). `run` returns the exit status: 1 if any item
FAILed, else 0.

`faults` plant a failure on purpose (`--fault kernel:FAMILY` offsets that kernel's output, `--fault form:FORM`
scales that form's loss): how tests/test_selfcheck.py shows that a wrong result is reported.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from lowering import FAMILIES
from moepass.plan import FORMS

ROOT = Path(__file__).resolve().parents[2]  # the checkout: lowering/, moepass/ and samples/ side by side
CHECKED_FORMS = tuple(f for f in FORMS if f != "auto")  # auto picks one of these
COLLECTIVES = ("all_to_all_single", "all_reduce")
SIZES = (1 << 20, 16 << 20)
CPU_WORLD = 2  # gloo processes on a machine without CUDA
KERNEL_TIMEOUT_S = {"cpu": 150.0, "cuda": 240.0}
FORM_TIMEOUT_S = 180.0  # the first step on a GPU compiles its Triton kernels
COLLECTIVE_TIMEOUT_S = 60.0
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
NAME_WIDTH = 36


@dataclass
class Item:
    name: str  # "kernel gating", "form ep", "collective all_reduce 16 MiB"
    verdict: str  # "ok", "FAIL" or "skipped"
    detail: str  # figures (ok), the one-line error (FAIL) or the reason (skipped)
    seconds: float


@dataclass
class Machine:
    device: str  # "cuda" or "cpu"
    world: int
    backend: str  # "nccl" or "gloo"
    devices: list[str]


def machine() -> Machine:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        return Machine("cuda", n, "nccl", [torch.cuda.get_device_name(i) for i in range(n)])
    return Machine("cpu", CPU_WORLD, "gloo", [f"cpu ({platform.machine()}, {os.cpu_count()} cores)"])


def header(m: Machine) -> dict[str, Any]:
    return {"torch": torch.__version__, "triton": triton_version(), "python": platform.python_version(),
            "devices": m.devices, "backend": m.backend, "world_size": m.world,
            "kernels": "compiled Triton (TRITON_INTERPRET=0)" if m.device == "cuda"
            else "Triton interpreted on CPU (TRITON_INTERPRET=1)"}


def triton_version() -> str | None:
    from importlib import metadata

    for name in ("triton", "pytorch-triton", "triton-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def headline(text: str) -> str:
    """The one line of a traceback (or message) that says what failed: the exception line (the first line
    of its message), with assert_close's largest difference when there is one."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    rank = next((line.strip("- ") for line in lines if line.startswith("--- rank ")), None)
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    exc = next((line for line in lines[start:] if not line.startswith(" ")), lines[-1] if lines else "")
    diff = next((line.strip() for line in lines[start:]
                 if line.strip().startswith(("Greatest absolute difference", "Absolute difference"))), None)
    one = f"{rank}: {exc}" if rank else exc
    return one + (f" ({diff})" if diff else "")


# ----------------------------------------------------------------------------------------------
# The items.
# ----------------------------------------------------------------------------------------------


def kernel_items(m: Machine, faults: list[str]) -> list[Item]:
    """The kernel families, run by `lowering.numerics` in a child process with the right TRITON_INTERPRET."""
    start = time.perf_counter()
    if triton_version() is None:
        return [Item(f"kernel {f}", "skipped", "triton is not installed (pip install triton): the torch "
                     "fallbacks run instead", 0.0) for f in FAMILIES]
    env = {**os.environ, "TRITON_INTERPRET": "0" if m.device == "cuda" else "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    # small shapes on the GPU as well: every family and dtype still compiles and runs, in a fraction of the time
    # of the full sweep (tests/test_kernels_gpu.py's)
    command = [sys.executable, "-m", "lowering.numerics", m.device, "--small", *[f"--fault={f}" for f in faults]]
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=KERNEL_TIMEOUT_S[m.device])
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[1:])}` exited with {out.returncode}: "
                               f"{headline(out.stderr or out.stdout)}")
        report = json.loads(out.stdout.splitlines()[-1])["families"]
    except subprocess.TimeoutExpired:
        why = f"the kernel checks did not finish within {KERNEL_TIMEOUT_S[m.device]:.0f} s (child process killed)"
        return [Item(f"kernel {f}", "FAIL", why, time.perf_counter() - start) for f in FAMILIES]
    except Exception as err:  # the child crashed or printed no report: every family FAILs with the reason
        return [Item(f"kernel {f}", "FAIL", headline(f"{type(err).__name__}: {err}"), time.perf_counter() - start)
                for f in FAMILIES]
    how = "compiled" if m.device == "cuda" else "interpreted"
    items = []
    for family in FAMILIES:
        r = report.get(family)
        if r is None:
            items.append(Item(f"kernel {family}", "FAIL", "lowering.numerics reported nothing for it", 0.0))
        elif r["ok"]:
            items.append(Item(f"kernel {family}", "ok", f"{r['checks']} cases vs torch, fwd+bwd, fp32+16-bit, "
                              f"Triton {how} (no fallback)", r["seconds"]))
        else:
            items.append(Item(f"kernel {family}", "FAIL", headline(r["error"]), r["seconds"]))
    return items


class Ranks:
    """The W ranks the form and collective items run on, restarted after a case that hung."""

    def __init__(self, m: Machine):
        self.machine = m
        self.pool: Any = None
        self.start_error: str | None = None

    def start(self) -> Item:
        """(Re)start the ranks; the item that says how it went."""
        from moepass.runtime.workers import Pool

        m, start = self.machine, time.perf_counter()
        try:
            self.pool = Pool(m.world, backend=m.backend, env=WORKER_ENV, paths=(str(ROOT),), threads=1,
                             pg_timeout=60.0)
        except Exception as err:
            self.start_error = f"could not start {m.world} {m.backend} ranks: {headline(str(err))}"
            return Item(f"ranks W={m.world} {m.backend}", "FAIL", self.start_error, time.perf_counter() - start)
        return Item(f"ranks W={m.world} {m.backend}", "ok", f"{m.world} rank process{'es' if m.world > 1 else ''} "
                    f"spawned, {m.backend} process group made", time.perf_counter() - start)

    def run(self, fn: Callable, *args: Any, timeout: float) -> list[Any]:
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        if self.pool is None or self.pool.broken:  # a case hung: fresh ranks for the next one
            self.start()
            if self.start_error is not None:
                raise RuntimeError(self.start_error)
        assert self.pool is not None
        return self.pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def form_item(ranks: Ranks, form: str, fault: bool) -> Item:
    from moepass.selfcheck import steps

    m = ranks.machine
    where = f"W={m.world} {m.backend}" if form != "single" else "each rank alone"
    start = time.perf_counter()
    try:
        results = ranks.run(steps.case_form_step, form, fault, timeout=FORM_TIMEOUT_S)
    except Exception as err:
        return Item(f"form {form}", "FAIL", f"{where}: {headline(str(err))}", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if form == "locality":
        r = max(results, key=lambda r: r["loss_vs_untouched"])
        return Item(f"form {form}", "ok", f"{where}: step finite; routing changed by design, loss vs untouched "
                    f"{r['loss_vs_untouched']:.1e} (reported, not judged)", seconds)
    worst = {k: max(r[k] for r in results) for k in ("loss", "grad", "param")}
    model = "latent-MoE LM" if form == "hp" else "sample LM"
    return Item(f"form {form}", "ok", f"{model}, {where}: |d loss| {worst['loss']:.1e}, grads {worst['grad']:.1e} "
                f"({min(r['grads'] for r in results)}+ tensors), params after SGD {worst['param']:.1e}", seconds)


def collective_item(ranks: Ranks, op: str, nbytes: int) -> Item:
    from moepass.selfcheck import steps

    m = ranks.machine
    name = f"collective {op} {nbytes >> 20} MiB"
    if m.world < 2:
        return Item(name, "skipped", f"needs 2 devices; this machine has {m.world} ({m.devices[0]})", 0.0)
    start = time.perf_counter()
    try:
        results = ranks.run(steps.case_bandwidth, op, nbytes, timeout=COLLECTIVE_TIMEOUT_S)
    except Exception as err:
        return Item(name, "FAIL", f"W={m.world} {m.backend}: {headline(str(err))}", time.perf_counter() - start)
    seconds = max(r["seconds"] for r in results)
    algbw = nbytes / seconds / 1e9
    bus = algbw * (2 if op == "all_reduce" else 1) * (m.world - 1) / m.world  # as nccl-tests count it
    return Item(name, "ok", f"W={m.world} {m.backend}: {seconds * 1e3:.3g} ms, algbw {algbw:.3g} GB/s, "
                f"busbw {bus:.3g} GB/s", time.perf_counter() - start)


# ----------------------------------------------------------------------------------------------
# The run and its table.
# ----------------------------------------------------------------------------------------------


def item_names() -> list[str]:
    return ([f"kernel:{f}" for f in FAMILIES] + [f"form:{f}" for f in CHECKED_FORMS])


def run(json_path: str | None = None, faults: tuple[str, ...] = (), out: TextIO | None = None) -> int:
    """Every item on this machine; prints the table to `out` (stdout) as the items finish, writes it as JSON to
    `json_path` if given; 1 if any item FAILed, else 0."""
    out = out or sys.stdout
    unknown = [f for f in faults if f not in item_names()]
    if unknown:
        raise ValueError(f"selfcheck --fault {unknown}: no such item; choose from {item_names()}")
    wall = time.perf_counter()
    m = machine()
    head = header(m)
    print(f"moepass selfcheck: torch {head['torch']}, triton {head['triton'] or 'not installed'}, "
          f"python {head['python']}", file=out)
    print(f"devices: {', '.join(m.devices)}; backend {m.backend}; world size {m.world}; kernels: {head['kernels']}",
          file=out)
    print(f"{'item':<{NAME_WIDTH}} {'verdict':<8} {'time':>7}  detail", file=out)
    items: list[Item] = []

    def show(new: list[Item]) -> None:
        for item in new:
            items.append(item)
            print(f"{item.name:<{NAME_WIDTH}} {item.verdict:<8} {item.seconds:>6.1f}s  {item.detail}", file=out, flush=True)

    show(kernel_items(m, [f.split(":", 1)[1] for f in faults if f.startswith("kernel:")]))
    ranks = Ranks(m)
    if m.device == "cuda" and not dist.is_nccl_available():
        why = "this torch build has no NCCL (torch.distributed.is_nccl_available() is False)"
        show([Item(f"form {f}", "skipped", why, 0.0) for f in CHECKED_FORMS])
        show([Item(f"collective {op} {s >> 20} MiB", "skipped", why, 0.0) for op in COLLECTIVES for s in SIZES])
    else:
        try:
            show([ranks.start()])
            for form in CHECKED_FORMS:
                show([form_item(ranks, form, f"form:{form}" in faults)])
            for op in COLLECTIVES:
                for nbytes in SIZES:
                    show([collective_item(ranks, op, nbytes)])
        finally:
            ranks.close()
    wall = time.perf_counter() - wall
    failed = [i.name for i in items if i.verdict == "FAIL"]
    print(f"{len(items) - len(failed)}/{len(items)} items ok or skipped in {wall:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=out)
    if json_path:
        Path(json_path).write_text(json.dumps({"header": head, "items": [asdict(i) for i in items],
                                               "failed": failed, "wall_s": wall}, indent=1))
    return 1 if failed else 0


__all__ = ["Item", "Machine", "headline", "item_names", "machine", "run"]
