"""Wall time of user-facing tools, measured here rather than asserted in tests (shared cores):

- `python -m moepass search --scenario <lina_priority.json> --limit 3`: the ranked table of 12 cases,
  start-up and imports included (tests/test_cli_search.py checks what it prints);
- `cost_model.calibrate.measure_a2a([65536], reps=3)`: the calibration's smallest gloo all-to-all run
  at W=2, spawn included (tests/test_cost_model.py::test_calibration_smoke_run checks its result);
- `python -m cost_model`: the simulator's table over the four scenario files of ../shared/scenarios (issue 31),
  with its import floor in the same run (`python -c "import torch"`, `"import sympy"`, and
  `"import moepass.runtime.placement"`: the package the FSEP planner the simulator prices with lives in, torch
  included), and with `--baseline DIR` the same command run from another checkout of the repository (beside a
  shared/ with the scenarios), interleaved with this one, its stdout compared byte for byte.

    python benchmarks/tool_time.py [--repeats 3] [--only cost_model_cli --baseline DIR]

Writes benchmarks/results/tool_time.json (seconds: every repeat, min and median, plus the machine and
its 1-minute load average before each tool, since other work on the cores changes the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "tool_time.json"
SCENARIO = ROOT / "tests" / "data" / "scenarios" / "lina_priority.json"


def search_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "moepass", "search", "--scenario", str(SCENARIO), "--limit", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or out.stdout.count("best: ") != 12:
        raise RuntimeError(f"search --scenario failed (exit {out.returncode}):\n{out.stderr[-2000:]}")


def calibration_smoke() -> None:
    from cost_model import calibrate

    out = calibrate.measure_a2a([65536], reps=3, timeout_s=60)
    if len(out) != 1 or not out[0][1] > 0:
        raise RuntimeError(f"measure_a2a returned {out}")


def cost_model_cli(root: Path = ROOT) -> str:
    """`python -m cost_model` run in `root` (its own cost_model and moepass first on the path); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-m", "cost_model"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0 or out.stdout.count("== ") != 4:
        raise RuntimeError(f"python -m cost_model in {root} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout


def python_c(code: str) -> Callable[[], None]:
    def run() -> None:
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                       timeout=600)
    return run


TOOLS: dict[str, tuple[str, Callable[[], object]]] = {
    "search_scenario_cli": ("python -m moepass search --scenario lina_priority.json --limit 3", search_cli),
    "calibration_a2a_smoke": ("cost_model.calibrate.measure_a2a([65536], reps=3)", calibration_smoke),
    "cost_model_cli": ("python -m cost_model (the four scenario files of ../shared/scenarios)", cost_model_cli),
}
FLOORS: dict[str, str] = {  # what `python -m cost_model` cannot start faster than
    "import_torch": "import torch",
    "import_sympy": "import sympy",
    "import_moepass_runtime_placement": "import moepass.runtime.placement",
}


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
    """Each of `runs` once per repeat, in turn (so the load of the moment falls on all of them alike)."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}  # the child's user + system seconds
    loads: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            loads[name].append(os.getloadavg()[0])
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime)
    return {name: {"seconds": seconds[name], "min_seconds": min(seconds[name]), "max_seconds": max(seconds[name]),
                   "median_seconds": statistics.median(seconds[name]), "cpu_seconds": cpu[name],
                   "median_cpu_seconds": statistics.median(cpu[name]), "load_avg_1min_before": loads[name]}
            for name in runs}


def cost_model_timing(repeats: int, baseline: Path | None) -> dict:
    """`python -m cost_model` (and the baseline checkout's, when given) interleaved with its import floor."""
    runs: dict[str, Callable[[], object]] = {"cost_model_cli": cost_model_cli}
    if baseline is not None:
        runs["cost_model_cli_baseline"] = lambda: cost_model_cli(baseline)
    runs.update({name: python_c(code) for name, code in FLOORS.items()})
    result: dict = {"what": TOOLS["cost_model_cli"][0], **interleaved(runs, repeats)}
    result["floors"] = {name: f'python -c "{code}"' for name, code in FLOORS.items()}
    if baseline is not None:
        result["baseline"] = str(baseline)
        result["stdout_identical"] = cost_model_cli() == cost_model_cli(baseline)
    return result


def measure(fn: Callable[[], object], repeats: int) -> dict:
    seconds, loads = [], []
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "min_seconds": min(seconds), "median_seconds": statistics.median(seconds),
            "load_avg_1min_before": loads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=sorted(TOOLS), help="measure one tool")
    p.add_argument("--out", type=Path, default=OUT, help=f"JSON file to write (default {OUT})")
    p.add_argument("--baseline", type=Path, help="cost_model_cli: a checkout to compare with (beside a shared/ "
                   "holding scenarios/), run interleaved")
    args = p.parse_args(argv)
    names = [args.only] if args.only else list(TOOLS)
    results: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine()},
        "tools": {name: {"what": TOOLS[name][0], **measure(TOOLS[name][1], args.repeats)} for name in names
                  if name != "cost_model_cli"},
    }
    if "cost_model_cli" in names:
        results["cost_model_cli"] = cost_model_timing(args.repeats, args.baseline)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    shown = {**results["tools"], **{k: v for k, v in results.get("cost_model_cli", {}).items() if isinstance(v, dict)
                                    and "seconds" in v}}
    for name, r in shown.items():
        cpu = f", median cpu {r['median_cpu_seconds']:.2f} s" if "median_cpu_seconds" in r else ""
        print(f"{name}: min {r['min_seconds']:.2f} s, median {r['median_seconds']:.2f} s{cpu} over {args.repeats} "
              f"(load {', '.join(f'{x:.1f}' for x in r['load_avg_1min_before'])})")
    if "stdout_identical" in results.get("cost_model_cli", {}):
        print(f"stdout identical to {args.baseline}'s: {results['cost_model_cli']['stdout_identical']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
