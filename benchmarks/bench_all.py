"""Run the benchmarks, each in its own process, and build one report: `python -m moepass bench`.

    python -m moepass bench --all              # quick settings (< 15 min here) -> benchmarks/results/quick/
    python -m moepass bench --all --full       # each benchmark's own default sizes -> benchmarks/results/
    python -m moepass bench hp locality --out /tmp/bench

Every benchmark runs as a subprocess from the repository root (`python benchmarks/<script>.py ...`): it
sets its own threads and environment, and one that crashes, times out or writes no JSON is recorded
(exit status, the tail of its stderr) while the others go on. Around each run the runner records the
exact command, the wall time and `uptime` (with the 1/5/15-minute load averages) before and after;
`bench_run.json` in the output folder holds these and the machine (cores, torch, Python, the GPU or why
there is none, the git commit), rewritten after every benchmark so that a run cut short keeps what it
measured. `benchmarks/report.py` then turns bench_run.json and each benchmark's JSON into report.md,
report.html and the plots the benchmarks do not draw themselves.

Quick settings (`quick=` of each entry in BENCHMARKS) keep every comparison side by side in one process
or one launch sequence (A, B, A, B rounds or steps, as each benchmark's module doc describes): fewer
rounds, steps or scenarios, at the issue's sizes where that fits in the time (fsep, hp, locality, ep_layer,
schedule), smaller sizes where it does not (ep_step's and hp_quality's own --quick); never a system
measured alone. Where a benchmark has no quick mode of its own the smallest settings its command line
accepts are used, and the entry says so (`note`, shown in the report). Here (2 cores) --all --quick
took 11.7 min with other jobs on the cores (1-minute load 1.9 to 18.5).

The quick defaults write to benchmarks/results/quick/, not benchmarks/results/: the JSONs there are the
benchmarks' full runs, which the documentation quotes, and a quick run must not replace them.

Links: hp, locality and schedule put their ranks in network namespaces joined by a tc-limited veth
(benchmarks/netns.py, root). Before the first of them the runner makes a namespace and a tc qdisc in it
(`netns_blocker`); if that fails, they run on the loopback (`fallback` arguments) and the report says
why, in their section and in the summary table.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QUICK_OUT = RESULTS / "quick"
MANIFEST = "bench_run.json"
TAIL = 2000  # characters of a failed benchmark's stdout and stderr kept for the report


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script and how the runner calls it.

    quick / full: arguments for `--quick` / `--full`; always: for both, before them, "{out}" standing for
    the output folder. out: the script's flag for its JSON path; None when
    the script has none and writes `out_attr` (a module-level Path) itself: the runner then imports it
    and points that attribute into the output folder (the command it reports is the script's own).
    netns: needs network namespaces; `fallback` is appended when they cannot be made. A run past its
    timeout is ended with every process it started.
    """

    name: str
    script: str
    what: str
    quick: tuple[str, ...] = ()
    full: tuple[str, ...] = ()
    always: tuple[str, ...] = ()
    out: str | None = "--out"
    out_attr: str = "OUT"
    json_name: str = ""
    netns: bool = False
    fallback: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    quick_timeout_s: float = 300.0  # a hung benchmark must not eat the quick run's 15 minutes
    full_timeout_s: float = 3600.0

    @property
    def json_file(self) -> str:
        return self.json_name or f"{self.name}.json"


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("compile_time", "compile_time.py", "detection and compile time of a many-layer sample",
              quick=("--layers", "8", "--experts", "16"), out=None,
              note="no quick mode and no --out: quick = the smallest sizes of its own flags (8 layers x 16 "
                   "experts; it also measures 2 and 4 layers), its OUT pointed into the output folder"),
    Benchmark("ep_layer", "ep_layer.py", "one MoE layer vs transformers' EP and the compute floor (issue 12)",
              quick=("--quick", "--rounds", "3", "--workloads", "issue"),
              note="quick: issue 12's workload (the full run's shapes), 3 rounds of 3 timed iterations"),
    Benchmark("ep_step", "ep_step.py", "EP training step vs transformers' EP and the original at W=2",
              quick=("--quick", "--launches", "2"),
              note="quick: its own --quick (smaller shapes), 2 launches per system"),
    Benchmark("schedule", "schedule.py", "Lina (chunked, prioritised) vs plain EP + DDP under contention (issue 18)",
              quick=("--lina-w2",), full=("--lina-w2",), json_name="schedule_lina_w2.json", netns=True,
              fallback=("--loopback",),
              note="no quick mode: --lina-w2 at its own sizes (its --tiny is a no-link smoke run)"),
    Benchmark("fsep", "fsep.py", "FSEP vs EP vs FSDP under skewed and balanced routing (issue 14)",
              quick=("--tokens", "8192", "--scenarios", "zipf", "balanced", "--rounds", "4", "--warmup", "7",
                     "--profile-steps", "0", "--comm-reps", "3"),
              quick_timeout_s=600.0,
              note="quick: the headline layer (T=8192, the full run's sizes), 2 of its 4 routing scenarios, "
                   "4 rounds (its own --quick is a T=128 smoke run, where FSEP's restore outweighs the GEMMs)"),
    Benchmark("hp", "hp.py", "head parallel vs expert parallel over a tc-limited link (issue 15)",
              quick=("--rounds", "3", "--steps", "3", "--warmup", "1"), netns=True, fallback=("--no-netns",),
              note="quick: the full run's model and link, 3 rounds of 3 steps (its --quick is a smoke run)"),
    Benchmark("hp_quality", "hp_quality.py", "HP-converted model vs the original: held-out loss (issue 15)",
              quick=("--quick", "--steps", "150"),
              note="quick: its own --quick (tiny dims, the default plan only) for 150 steps"),
    Benchmark("locality", "locality.py", "LocMoE locality routing vs the switch router (issue 16)",
              quick=("--steps", "200", "--data", "domain"), netns=True, fallback=("--no-netns",),
              note="quick: the full run's model and link, 200 of its 400 steps, data 'domain' only (the goal's)"),
    Benchmark("cost_fidelity", "cost_fidelity.py", "cost model: predicted vs measured step time (EP, FSEP, HP, locality, Lina)",
              always=("--calibrate", "--profile", "{out}/cost_profile.json"),
              quick=("--rounds", "2", "--steps", "2", "--calibrations", "1"),
              note="this machine calibrated before and after the measurement, into the output folder (a prediction "
                   "is only as good as the calibration's conditions match the measurement's); quick: 2 rounds of 2 "
                   "steps, one calibration before"),
    Benchmark("kernel_bytes", "kernel_bytes.py", "bytes per generated kernel vs the unfused torch reference"),
    Benchmark("kernels", "kernels.py", "grouped-GEMM kernels: FLOPs/bytes, measured vs roofline on a GPU"),
    Benchmark("fsep_planner", "fsep_planner.py", "FSEP placement planner: solve time and balance at scale",
              quick=("--runs", "3")),
    Benchmark("expert_profile", "expert_profile.py", "where one MoE layer's step time goes (profiler)",
              quick=("--steps", "5")),
)}


def argv_for(bench: Benchmark, out_dir: Path, quick: bool, extra: Sequence[str] = ()) -> tuple[list[str], str]:
    """(the argv the runner executes, the command a reader runs to reproduce the figure)."""
    script = ROOT / "benchmarks" / bench.script
    args = [*(a.format(out=_display(out_dir)) for a in bench.always), *(bench.quick if quick else bench.full), *extra]
    json_path = out_dir / bench.json_file
    shown = ["python", f"benchmarks/{bench.script}", *args]
    if bench.out is not None:
        args += [bench.out, str(json_path)]
        shown += [bench.out, _display(json_path)]
        return [sys.executable, str(script), *args], shlex.join(shown)
    # No --out flag: import the script as a module, point its output path into out_dir, call its main.
    module = f"benchmarks.{Path(bench.script).stem}"
    code = (f"import sys, pathlib, {module} as m; m.{bench.out_attr} = pathlib.Path(sys.argv[1]); "
            f"sys.exit(m.main(sys.argv[2:]))")
    return ([sys.executable, "-c", code, str(json_path), *args],
            shlex.join(shown) + f"  # writes benchmarks/results/{bench.json_file}")


def _display(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def uptime() -> dict:
    """`uptime`'s line and the load averages (1, 5, 15 min)."""
    line = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {"uptime": line, "load": list(os.getloadavg())}


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False)
    return {
        "cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": gpu,
        "gpu_note": None if gpu else ("none on this machine and none lent to this run (torch.cuda.is_available() "
                                      "is False): the GPU timings are skipped, and their sections say so"),
        "git_commit": commit.stdout.strip() or None,
        "git_dirty_files": len(dirty.stdout.splitlines()) if dirty.returncode == 0 else None,
    }


def netns_blocker() -> str | None:
    """None if a network namespace with a tc tbf qdisc can be made here, else why not (the failing command)."""
    name = f"mpbench{os.getpid() % 100000}"
    steps = [["ip", "netns", "add", name], ["ip", "-n", name, "link", "set", "lo", "up"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "1gbit",
              "burst", "64kb", "latency", "100ms"]]
    try:
        for cmd in steps:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
            except OSError as err:
                return f"`{shlex.join(cmd)}`: {err}"
            if proc.returncode != 0:
                return f"`{shlex.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[:500]}"
        return None
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def _wait(proc: subprocess.Popen, deadline: float, tick: Callable[[], None] | None) -> int | None:
    """proc's exit status, or None if it is still running at `deadline` (time.perf_counter())."""
    while time.perf_counter() < deadline:
        try:
            return proc.wait(timeout=min(1.0, max(0.0, deadline - time.perf_counter())))
        except subprocess.TimeoutExpired:
            if tick:
                tick()
    return proc.poll()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-TAIL:]


def _snapshot(out_dir: Path) -> dict[str, float]:
    """The benchmarks' PNGs in out_dir (not the report's own) and their modification times."""
    from benchmarks.report import is_report_plot

    return {p.name: p.stat().st_mtime for p in out_dir.glob("*.png") if not is_report_plot(p.name)}


def run_one(bench: Benchmark, out_dir: Path, quick: bool, netns_reason: str | None,
            tick: Callable[[], None] | None = None) -> dict:
    """Run one benchmark to completion (or its timeout); the record bench_run.json keeps for it.
    tick() is called about once a second while it runs (to redraw a progress bar's elapsed time)."""
    extra = bench.fallback if (bench.netns and netns_reason) else ()
    argv, command = argv_for(bench, out_dir, quick, extra)
    json_path = out_dir / bench.json_file
    json_path.unlink(missing_ok=True)  # never report a stale result as this run's
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    before_png = _snapshot(out_dir)
    record: dict = {"name": bench.name, "what": bench.what, "command": command, "argv": argv,
                    "mode": "quick" if quick else "full", "note": bench.note,
                    "fallback": ({"args": list(extra), "why": netns_reason} if extra else None),
                    "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "before": uptime()}
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, **bench.env}
    start = time.perf_counter()
    with open(logs / f"{bench.name}.out", "w") as out, open(logs / f"{bench.name}.err", "w") as err:
        # its own session: a timeout or Ctrl-C ends the benchmark and every rank it started, by its group id
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        timeout_s = bench.quick_timeout_s if quick else bench.full_timeout_s
        try:
            returncode = _wait(proc, start + timeout_s, tick)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    record["wall_s"] = time.perf_counter() - start
    record["after"] = uptime()
    record["returncode"] = returncode
    record["json"] = bench.json_file if json_path.exists() else None
    after_png = _snapshot(out_dir)
    record["pngs"] = sorted(n for n, t in after_png.items() if before_png.get(n) != t)
    failed = returncode != 0 or record["json"] is None
    record["status"] = "ok" if not failed else ("timeout" if returncode is None else "failed")
    if failed:
        why = (f"timed out after {timeout_s:.0f} s" if returncode is None else
               f"exit status {returncode}" if returncode != 0 else f"exit status 0 but no {bench.json_file}")
        record["error"] = {"why": why, "stderr_tail": _tail(logs / f"{bench.name}.err"),
                           "stdout_tail": _tail(logs / f"{bench.name}.out")}
    return record


def run(names: Sequence[str], out_dir: Path, quick: bool, command: str,
        progress: Callable[[str, int, int, dict | None], None] | None = None,
        tick: Callable[[], None] | None = None) -> dict:
    """Run `names` in order into out_dir; returns the manifest (also written to out_dir/bench_run.json).

    command: how the run was started (for the report). progress(name, done, total, last) is called before
    each benchmark and once at the end (name ""), with the record of the benchmark that just finished;
    tick() about once a second while one runs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    checked = any(BENCHMARKS[n].netns for n in names)
    blocker = netns_blocker() if checked else None
    records: list[dict] = []
    manifest: dict = {"command": command, "mode": "quick" if quick else "full", "out": _display(out_dir),
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                      "netns_checked": checked, "netns_blocker": blocker, "benchmarks": records}
    start = time.perf_counter()
    for i, name in enumerate(names):
        if progress:
            progress(name, i, len(names), records[-1] if records else None)
        records.append(run_one(BENCHMARKS[name], out_dir, quick, blocker, tick))
        manifest["wall_s"] = time.perf_counter() - start
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if progress:
        progress("", len(names), len(names), records[-1] if records else None)
    return manifest
