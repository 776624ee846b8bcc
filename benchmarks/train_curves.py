"""The training recipe over many steps (issue 30): loss curves of single vs EP vs FSEP against the untouched
model, and tokens/s of each form next to the model without moepass (DDP), at W=2 gloo.

    .venv/bin/python benchmarks/train_curves.py                 # 200 steps per curve, 40 interleaved steps
    .venv/bin/python benchmarks/train_curves.py --quick         # 20 steps, 8 steps (a smoke run)
    .venv/bin/python benchmarks/train_curves.py --part throughput   # only the throughput (curves kept)
    .venv/bin/python benchmarks/train_curves.py --world 4 --nodes 2 --part curves   # W=4, 2 simulated nodes

Curves: `python -m moepass train --form F --nproc 2 --steps N --reference` for F in none, single, ep, fsep
(one run each; the reference is trained by rank 0 in the same run on the same global batches): per form the
max |dloss| over the N steps and over the first 20, the first step where |dloss| exceeds 1e-5 relative, and
one PNG with the curves, the reference, and |loss - reference| per step. `none` is the control: the untouched
model under DDP on the same split differs from the one-process reference by summation order alone, and
top-k routing turns such a rounding difference into a different expert for a near-tied token, after which
trajectories drift apart (chaos, not a moepass error): a form is as exact as the math allows when its curve
stays as close as `none`'s. EP's and FSEP's curves are also compared with the single form's (`vs_single`):
the distributed forms against the same canonical graph run on one device per rank.
Throughput (`throughput`): the forms none (the untouched model + DDP), single, ep, fsep, none+fsdp (the
untouched model under FSDP2 alone), ep+fsdp (EP with FSDP2 on the dense parameters) built side by side in one world of 2 gloo ranks and stepped in turn (one step each, the order rotated every step), so each step's
ratio to `none` is taken under the same load; per form the median tokens/s and the median and quartiles of
those ratios (and for F+fsdp its ratio to none+fsdp). On this 2-core machine shared by other sessions the
figures measure CPU contention as much as the forms: the load is recorded. The untouched sample under FSDP2
only (none+fsdp) needs every expert to get a gradient on every rank (FSDP2 reduce-scatters the gradients a
rank has; a loop that skips an expert no local token chose left the ranks sending different sizes, "Received
data size doesn't match expected size"): the recipe's `touch_every_parameter` adds an exact zero that reads
each parameter of a layer, as moepass's forms give every expert a gradient on every rank.

Writes <out>/train_curves.json, <out>/train_curves.png (default out: benchmarks/results); at another world
size <out>/train_curves_w<W>.{json,png} (`--world 4 --nodes 2`: 2 simulated nodes of 2 ranks, Plan.topology).
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


def train(out: str, *args: str, world: int = 2) -> dict:
    cmd = [sys.executable, "-m", "moepass", "train", "--nproc", str(world), "--out", out, *args]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "train_log.json")) as f:
        log = json.load(f)
    log["wall_s"] = time.time() - start
    log["cmd"] = " ".join([f"python -m moepass train --nproc {world}", *args])
    return log


def add_vs_single(result: dict) -> None:
    """EP's and FSEP's curves against the single form's (the same canonical graph on one device per rank)."""
    single = result["curves"]["single"]["loss"]
    for form in ("ep", "fsep"):
        diffs = [abs(a - b) for a, b in zip(result["curves"][form]["loss"], single)]
        result["curves"][form]["vs_single"] = {"max_abs_dloss": max(diffs),
                                               "bitwise_equal_steps": sum(d == 0 for d in diffs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="curve steps (default 200, quick 20)")
    p.add_argument("--tput-steps", type=int, default=None, help="interleaved throughput steps (default 40, quick 8)")
    p.add_argument("--tput-forms", default="none,single,ep,fsep,none+fsdp,ep+fsdp",
                   help="forms to time; F+fsdp: with FSDP2 on the dense parameters (none+fsdp: FSDP2 only)")
    p.add_argument("--part", default="all", choices=["all", "curves", "throughput"],
                   help="run one part; the other is kept from an existing JSON")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--world", type=int, default=2, help="ranks of the curve runs (the throughput part: 2)")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes of the curve runs")
    args = p.parse_args(argv)
    suffix = "" if args.world == 2 else f"_w{args.world}"
    steps = args.steps or (20 if args.quick else 200)
    args.tput_steps = args.tput_steps or (8 if args.quick else 40)
    work = tempfile.mkdtemp(prefix="train_curves_")
    path = os.path.join(args.out, f"train_curves{suffix}.json")
    result: dict = {"curves": {}, "throughput": {}}
    if args.part != "all" and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    result["uptime_before"] = os.getloadavg()

    for form in ("none", "single", "ep", "fsep") if args.part in ("all", "curves") else ():
        log = train(os.path.join(work, f"curve_{form}"), "--form", form, "--steps", str(steps), "--reference",
                    "--log-every", str(max(1, steps // 10)), *(("--nodes", str(args.nodes)) if args.nodes > 1 else ()),
                    world=args.world)
        diffs = [abs(r["loss"] - r["ref_loss"]) for r in log["steps"]]
        result["curves"][form] = {"cmd": log["cmd"], "load": log["machine"]["load"], "wall_s": log["wall_s"],
                                  "max_abs_dloss": max(diffs), "final_loss": log["steps"][-1]["loss"],
                                  "bitwise_equal_steps": sum(d == 0 for d in diffs),
                                  "zero_filled_steps": sum(bool(r.get("ref_zero_filled_grads")) for r in log["steps"]),
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

        result["steps"] = steps
        result["world"], result["nodes"] = args.world, args.nodes
    if args.part in ("all", "curves"):
        add_vs_single(result)
    if args.part in ("all", "throughput") and args.world == 2:
        result["throughput"] = throughput(args.tput_steps, args.tput_forms.split(","))
    result["uptime_after"] = os.getloadavg()

    from moepass.train import report

    os.makedirs(args.out, exist_ok=True)
    if result["curves"]:
        ref = result["curves"]["single"]["ref_loss"]
        curves = {f: list(enumerate(c["loss"], start=1)) for f, c in result["curves"].items()}
        curves["reference"] = list(enumerate(ref, start=1))
        nodes = f", {args.nodes} simulated nodes" if args.nodes > 1 else ""
        png = report.plot(os.path.join(args.out, f"train_curves{suffix}.png"), curves,
                          f"sample MoE LM on pydoc topics, W={args.world} gloo{nodes}, {result['steps']} steps")
        print(f"wrote {png}")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    for f, v in result.get("throughput", {}).get("forms", {}).items():
        print(f"  {f}: {v['tokens_per_s_median']:,.0f} tokens/s, {v['ratio_to_ddp_median']:.2f}x DDP "
              f"(per-step ratios {v['ratio_to_ddp_q1']:.2f}-{v['ratio_to_ddp_q3']:.2f} quartiles)")
    return 0


def throughput(steps: int, forms: list[str]) -> dict:
    """tokens/s of every form in ONE spawned world of 2 ranks: each model built (seed 0) and parallelised as
    `samples/train.py` does, then step by step every form runs one training step, in an order rotated each
    step, so the forms share the machine's load minute by minute; per form the median tokens/s over steps
    3.., and the median (and quartiles) of its per-step ratio to `none` (the untouched model + DDP) in the
    same step."""
    from moepass.train.launch import run

    out = tempfile.mktemp(prefix="train_tput_", suffix=".json")
    run(throughput_rank, (steps, forms, out), nproc=2, device="cpu")
    with open(out) as f:
        return json.load(f)


def throughput_rank(packed: tuple) -> None:
    import copy

    import torch
    import torch.distributed as dist

    import moepass
    from moepass.train.data import Batches
    from moepass.train.optim import build_optimizer, fill_missing_grads
    from samples.train import add_arguments, build_model, lm_loss, parallelize

    steps, forms, out = packed
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = add_arguments(argparse.ArgumentParser()).parse_args([])
    runs = {}
    for form in forms:
        a = copy.copy(base)
        a.form, _, wrap = form.partition("+")
        a.fsdp = wrap == "fsdp"
        cm, call = parallelize(build_model(a, world), a, world)
        runs[form] = (cm, call, build_optimizer(cm, a.lr, a.weight_decay))
    batches = Batches.from_corpus(base.seq, base.global_batch, base.seed)
    tokens_per_step = base.global_batch * base.seq
    seconds: dict[str, list[float]] = {f: [] for f in forms}
    for step in range(steps):
        tokens = batches.rank_batch(step, rank, world)
        for form in forms[step % len(forms):] + forms[:step % len(forms)]:
            cm, call, opt = runs[form]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(call, tokens)
            loss.backward()
            fill_missing_grads(cm.parameters())
            moepass.clip_grad_norm_(list(cm.parameters()), base.clip)
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean.item()
            seconds[form].append(time.perf_counter() - t0)
    if rank == 0:
        timed = {f: s[2:] for f, s in seconds.items()}
        result: dict = {"steps": steps, "timed_steps": len(timed[forms[0]]), "load": os.getloadavg(),
                        "tokens_per_step": tokens_per_step, "forms": {}}
        for f in forms:
            ratios = sorted(n / s for n, s in zip(timed["none"], timed[f])) if "none" in timed else [float("nan")]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            result["forms"][f] = {"tokens_per_s_median": tokens_per_step / statistics.median(timed[f]),
                                  "ratio_to_ddp_median": statistics.median(ratios),
                                  "ratio_to_ddp_q1": q[0], "ratio_to_ddp_q3": q[2]}
            if f.endswith("+fsdp") and "none+fsdp" in timed:  # against the model under FSDP2 only
                result["forms"][f]["ratio_to_fsdp_median"] = statistics.median(
                    n / s for n, s in zip(timed["none+fsdp"], timed[f]))
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    sys.exit(main())
