"""Memory per rank of every system of the four published set-ups, by part (issue 31: "every scenario
configuration feasible in memory for the system the paper ran, with the breakdown").

    python benchmarks/scenario_memory.py [--out benchmarks/results/scenario_memory.json] [scenario.json ...]

For each scenario, case and system (the set-up's own systems; not the search's row): the bytes per rank
of weights+gradients+optimizer state, activations kept for the backward and buffers in flight
(`cost_model.step_timeline.memory_breakdown`), the memory mode the system needs to fit (replicated state,
ZeRO-1 optimizer sharding, + activation recomputation: `cost_model.systems.price`), the device memory and
whether it fits. Prints a table and writes JSON. No timing: pure model figures, deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_model.simulate import SCENARIO_DIR, SEARCH_ROW, simulate  # noqa: E402

OUT = Path(__file__).parent / "results" / "scenario_memory.json"


def rows(paths: list[Path]) -> list[dict]:
    out = []
    for path in paths:
        result = simulate(path)
        for p in result.predictions:
            if not p.modelled or p.system == SEARCH_ROW:
                continue
            out.append({"scenario": path.stem, "case": p.case, "system": p.system,
                        "mode": p.plan.get("memory"), "feasible": p.feasible,
                        **{f"{k}_gb": round(v / 1e9, 3) for k, v in p.memory.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    paths = args.scenarios or sorted(SCENARIO_DIR.resolve().glob("*.json"))
    table = rows(paths)
    head = ("scenario", "case", "system", "mode", "weights+grads+optimizer_gb", "activations_gb", "buffers_gb",
            "total_gb", "feasible")
    lines = [[str(r.get(h, "")) for h in head] for r in table]
    widths = [max(len(h), *(len(x[j]) for x in lines)) for j, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for x in lines:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
    over = [r for r in table if not r["feasible"]]
    print(f"{len(table)} system rows, {len(over)} over device memory")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python benchmarks/scenario_memory.py", "rows": table,
                                    "over_memory": len(over)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
