"""The training recipe over many steps (issue 30): loss curves of single vs EP vs FSEP against the untouched
model, and tokens/s of each form next to the model without moepass (DDP), at W=2 gloo.

    .venv/bin/python benchmarks/train_curves.py                 # 200 steps per curve, 3 throughput rounds
    .venv/bin/python benchmarks/train_curves.py --quick         # 20 steps, 1 round (a smoke run)

Curves: `python -m moepass train --form F --nproc 2 --steps N --reference` for F in none, single, ep, fsep
(one run each; the reference is trained by rank 0 in the same run on the same global batches): per form the
max |dloss| over the N steps and over the first 20, the first step where |dloss| exceeds 1e-5 relative, and
one PNG with the curves, the reference, and |loss - reference| per step. `none` is the control: the untouched
model under DDP on the same split differs from the one-process reference by summation order alone, and
top-k routing turns such a rounding difference into a different expert for a near-tied token, after which
trajectories drift apart (chaos, not a moepass error): a form is as exact as the math allows when its curve
stays as close as `none`'s.
Throughput: rounds of `train --form F --steps S` for F in none (the untouched model + DDP), single, ep, fsep,
interleaved (round r runs every form once, in a rotated order); per run the median tokens/s over steps 3..S;
per form its ratio to `none` in the same round; the median ratio and its range over the rounds. On this
2-core machine shared by other sessions the figures measure CPU contention as much as the forms: read the
load recorded with each run.

Writes <out>/train_curves.json, <out>/train_curves.png (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def train(out: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "moepass", "train", "--nproc", "2", "--out", out, *args]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "train_log.json")) as f:
        log = json.load(f)
    log["wall_s"] = time.time() - start
    log["cmd"] = " ".join(["python -m moepass train --nproc 2", *args])
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="curve steps (default 200, quick 20)")
    p.add_argument("--rounds", type=int, default=None, help="throughput rounds (default 3, quick 1)")
    p.add_argument("--tput-steps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args(argv)
    steps = args.steps or (20 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    work = tempfile.mkdtemp(prefix="train_curves_")
    result: dict = {"uptime_before": os.getloadavg(), "steps": steps, "rounds": rounds, "curves": {}, "throughput": []}

    for form in ("none", "single", "ep", "fsep"):
        log = train(os.path.join(work, f"curve_{form}"), "--form", form, "--steps", str(steps), "--reference",
                    "--log-every", str(max(1, steps // 10)))
        diffs = [abs(r["loss"] - r["ref_loss"]) for r in log["steps"]]
        result["curves"][form] = {"cmd": log["cmd"], "load": log["machine"]["load"], "wall_s": log["wall_s"],
                                  "max_abs_dloss": max(diffs), "final_loss": log["steps"][-1]["loss"],
                                  "max_abs_dloss_first_20": max(diffs[:20]),
                                  "first_step_rel_dloss_over_1e-5": next(
                                      (r["step"] for r in log["steps"]
                                       if abs(r["loss"] - r["ref_loss"]) > 1e-5 * abs(r["ref_loss"])), None),
                                  "abs_dloss": diffs,
                                  "loss": [r["loss"] for r in log["steps"]],
                                  "ref_loss": [r["ref_loss"] for r in log["steps"]]}
        c = result["curves"][form]
        print(f"curve {form}: {steps} steps, final loss {c['final_loss']:.4f}, max |dloss| {max(diffs):.2e} "
              f"(first 20 steps {c['max_abs_dloss_first_20']:.2e}; relative 1e-5 first exceeded at step "
              f"{c['first_step_rel_dloss_over_1e-5']})", flush=True)

    forms = ["none", "single", "ep", "fsep"]
    for r in range(rounds):
        order = forms[r % len(forms):] + forms[:r % len(forms)]
        row = {}
        for form in order:
            log = train(os.path.join(work, f"tput_{form}_{r}"), "--form", form, "--steps", str(args.tput_steps),
                        "--log-every", str(args.tput_steps))
            row[form] = {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in log["steps"][2:]),
                         "load": log["machine"]["load"]}
        for form in forms:
            row[form]["ratio_to_ddp"] = row[form]["tokens_per_s"] / row["none"]["tokens_per_s"]
        result["throughput"].append(row)
        print(f"round {r}: " + ", ".join(f"{f} {row[f]['tokens_per_s']:,.0f} tok/s ({row[f]['ratio_to_ddp']:.2f}x)"
                                         for f in forms), flush=True)
    result["ratio_to_ddp"] = {f: {"median": statistics.median(row[f]["ratio_to_ddp"] for row in result["throughput"]),
                                  "min": min(row[f]["ratio_to_ddp"] for row in result["throughput"]),
                                  "max": max(row[f]["ratio_to_ddp"] for row in result["throughput"])}
                              for f in forms}
    result["uptime_after"] = os.getloadavg()

    from moepass.train import report

    ref = result["curves"]["single"]["ref_loss"]
    curves = {f: list(enumerate(c["loss"], start=1)) for f, c in result["curves"].items()}
    curves["reference"] = list(enumerate(ref, start=1))
    os.makedirs(args.out, exist_ok=True)
    png = report.plot(os.path.join(args.out, "train_curves.png"), curves,
                      f"sample MoE LM on pydoc topics, W=2 gloo, {steps} steps")
    path = os.path.join(args.out, "train_curves.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} and {png}")
    for f, v in result["ratio_to_ddp"].items():
        print(f"  {f}: tokens/s {v['median']:.2f}x DDP (range {v['min']:.2f}-{v['max']:.2f}, {rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
