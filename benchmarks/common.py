"""Helpers the benchmark scripts share (import as `benchmarks.common`, the checkout on sys.path).

    wait_for_load(threshold, max_s, poll_s)   poll until the 1-minute load average falls below threshold
    stdlib_corpus(files, heldout_fraction)    a byte-level corpus from standard-library files, split per file
    write_json(path, doc)                     the results file (parents made), and a line saying so
    run_launch(cmd, env, cwd, result, ...)    one launch of a worker script: its JSON result and log tail
    results_header(name, what, argv, started) the keys every results file starts with
    benchmark_parser(doc, quick, counts)      the parser: description, --quick, the counts it changes
    add_counts / parse_args                   --quick-dependent counts from a table; parsing with them filled
    add_wait_options, add_netns_run_options   shared command-line options
    timed_max(fn)                             seconds of fn() after a barrier, the max over the ranks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def wait_for_load(threshold: float, max_s: float, poll_s: float = 30.0) -> float:
    """Poll every `poll_s` seconds until the 1-minute load average is below `threshold` (at most `max_s`);
    the seconds waited."""
    t0 = time.perf_counter()
    while os.getloadavg()[0] >= threshold and time.perf_counter() - t0 < max_s:
        print(f"load1 {os.getloadavg()[0]:.2f} >= {threshold}: waiting", flush=True)
        time.sleep(poll_s)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Corpus:
    """Bytes of standard-library files as token ids: each file's last `heldout_fraction` held out."""

    train_N: torch.Tensor  # int64 byte values, the files' leading parts concatenated
    heldout_M: torch.Tensor  # int64 byte values, the files' held-out tails concatenated
    file_bytes: dict[str, int]  # bytes of each file, in order
    sha256: str  # of every file's bytes, in order
    stdlib: Path


def stdlib_corpus(files: tuple[str, ...] | list[str], heldout_fraction: float) -> Corpus:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, heldout, sizes, digest = [], [], {}, hashlib.sha256()
    for name in files:
        data = (stdlib / name).read_bytes()
        digest.update(data)
        cut = len(data) - int(len(data) * heldout_fraction)
        train.append(data[:cut])
        heldout.append(data[cut:])
        sizes[name] = len(data)

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()

    return Corpus(as_tensor(train), as_tensor(heldout), sizes, digest.hexdigest(), stdlib)


def write_json(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


def run_launch(cmd: list[str], env: dict[str, str], cwd: Path, result: Path, ranks: int, timeout: float,
               progress: str) -> tuple[dict | None, str]:
    """Run one benchmark launch whose `ranks` processes each print "worker finished" and whose rank 0 writes
    `result` (JSON): (that result or None, the log's tail: empty when it exited cleanly). `progress` starts the
    per-step lines the log leaves out ("[ep_step rank")."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.strip() and not ln.startswith(("W1", "E1", "Loading weights", "  output = self._register", progress))
             and "returned a view tensor" not in ln]
    log = f"exit code {proc.returncode}; result file {'written' if result.exists() else 'missing'}\n" + \
        "\n".join(lines[-80:])
    finished = (proc.stdout + proc.stderr).count("worker finished")
    if result.exists() and finished == ranks:
        # every rank finished all its steps and tore its process group down: the figures are complete,
        # even if a process then died at interpreter exit (recorded as an exit abort by the caller)
        return json.loads(result.read_text()), ("" if proc.returncode == 0 else log)
    return None, log


def results_header(name: str, what: str, argv: list[str], started: str) -> dict:
    """The keys every results file starts with: the benchmark, what it measures, the command that wrote it
    (`python benchmarks/<name>.py` and its arguments) and when it started."""
    return {"benchmark": name, "what": what, "command": " ".join([f"python benchmarks/{name}.py", *argv]),
            "started": started}


def benchmark_parser(doc: str, quick: str, counts: dict[str, tuple[int, int, str]]) -> argparse.ArgumentParser:
    """The command line a benchmark starts with: described by its docstring's first line, --quick (`quick`
    says what it runs) and the counts whose defaults it changes (`add_counts`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    add_counts(parser, counts)
    return parser


def add_counts(parser: argparse.ArgumentParser, counts: dict[str, tuple[int, int, str]]) -> None:
    """Integer options whose default depends on --quick, from a table {"--steps": (full, quick, what)};
    `resolve_counts` fills the ones left unset."""
    for flag, (full, quick, what) in counts.items():
        parser.add_argument(flag, type=int, default=None, help=f"{what} (default {full}; --quick {quick})")


def resolve_counts(args: argparse.Namespace, counts: dict[str, tuple[int, int, str]]) -> None:
    for flag, (full, quick, _) in counts.items():
        name = flag.removeprefix("--").replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def add_wait_options(parser: argparse.ArgumentParser, poll_s: float = 30.0, max_s: float = 1200.0) -> None:
    """--wait-load / --wait-max: first wait for a quiet machine (`wait_for_load`)."""
    parser.add_argument("--wait-load", type=float, default=None,
                        help=f"first wait (polling every {poll_s:g} s) for the 1-minute load average to fall below this")
    parser.add_argument("--wait-max", type=float, default=max_s, help="seconds to wait for --wait-load at most")


def timed_max(fn: Callable[[], object]) -> float:
    """Seconds of `fn()` started after a barrier, the max over the ranks of the default process group."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None,
               counts: dict[str, tuple[int, int, str]]) -> argparse.Namespace:
    """A benchmark's arguments: parsed, `args.argv` kept for the results' command, the --quick counts filled."""
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    resolve_counts(args, counts)
    return args


def add_netns_run_options(parser: argparse.ArgumentParser, out: Path) -> None:
    """--timeout, --out and the internal --worker of a benchmark whose ranks run in network namespaces
    (`benchmarks.netns`), its results file `out` by default (the plot next to it)."""
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run of the ranks")
    parser.add_argument("--out", help=f"JSON path (the plot goes next to it, .png); default {out}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
