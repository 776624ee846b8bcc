"""Wall time of two user-facing tools, measured here rather than asserted in tests (shared cores):

- `python -m moepass search --scenario <lina_priority.json> --limit 3`: the ranked table of 12 cases,
  start-up and imports included (tests/test_cli_search.py checks what it prints);
- `cost_model.calibrate.measure_a2a([65536], reps=3)`: the calibration's smallest gloo all-to-all run
  at W=2, spawn included (tests/test_cost_model.py::test_calibration_smoke_run checks its result).

    python benchmarks/tool_time.py [--repeats 3]

Writes benchmarks/results/tool_time.json (seconds: every repeat, min and median, plus the machine and
its 1-minute load average before each tool, since other work on the cores changes the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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


TOOLS: dict[str, tuple[str, Callable[[], None]]] = {
    "search_scenario_cli": ("python -m moepass search --scenario lina_priority.json --limit 3", search_cli),
    "calibration_a2a_smoke": ("cost_model.calibrate.measure_a2a([65536], reps=3)", calibration_smoke),
}


def measure(fn: Callable[[], None], repeats: int) -> dict:
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
    args = p.parse_args(argv)
    names = [args.only] if args.only else list(TOOLS)
    results = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine()},
        "tools": {name: {"what": TOOLS[name][0], **measure(TOOLS[name][1], args.repeats)} for name in names},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for name, r in results["tools"].items():
        print(f"{name}: min {r['min_seconds']:.2f} s, median {r['median_seconds']:.2f} s over {args.repeats} "
              f"(load {', '.join(f'{x:.1f}' for x in r['load_avg_1min_before'])})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
