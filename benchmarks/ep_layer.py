"""One MoE layer's forward and forward+backward against its compute floor: moepass vs transformers' EP vs the
original module, at W=1 and W=2 (issue 12).

    python benchmarks/ep_layer.py            # full run: 3 rounds of interleaved launches (6-9 min here)
    python benchmarks/ep_layer.py --quick    # smoke run: 1 round, 3 timed iterations, same shapes (1-2 min),
                                             # JSON + plot to the temp dir unless --out
    python benchmarks/ep_layer.py --wait-load 1.5   # first wait for the shared cores to quieten down

Writes benchmarks/results/ep_layer.json and ep_layer.png (unless --out; the plot goes next to the JSON)
and prints a table.

    python benchmarks/ep_layer.py --systems peers@W2 --workloads issue   # issue 32's headline only

Headline (issue 32): the `peers@W2` launch builds, in ONE 2-rank process group, moepass EP and every peer in
its fastest configuration for the same work (`ep_peers.py`: transformers' `apply_expert_parallelism`
all-to-all + grouped_mm experts without FSDP, torchtitan 0.3.0's EP `MoE` in fp32, and, where `accelerate`
is installed, transformers' `DistributedConfig` EP+FSDP of issue 12), and times their forward+backward step
by step in rotating order (iteration i starts with system i mod n; barrier before each, max over the ranks).
Per launch: each system's median step and moepass / the fastest peer of that launch; over launches the
median and range of that ratio (JSON "peers"). Goal: <= 0.9. No system synchronises the replicated router
gradient (the same E x D all-reduce would be added to each); the parity step records the global loss and
sum(dx^2) of each (equal to fp32 rounding).

Profile, moepass EP vs torchtitan EP, issue layer at W=2 (per rank and fwd+bwd step; counts on rank 0 from
torch.profiler and cProfile; main-thread CPU from time.thread_time over 30-40 interleaved steps in one process
group; 2026-11-27, load 3-8 on the 2 shared cores):
                              moepass     torchtitan   transformers a2a
    aten ops                     802          859           755
    host reads (item)             16           36            24
    Python calls                2017         2422          1550
    all-to-alls / waits          5/5          5/7           5/6
    autograd nodes run            33           43            43
    main-thread CPU ms      18.2-22.5    18.0-21.0
  moepass's 16 host reads are CPU `torch._grouped_mm`'s, one per expert group, of host memory (no sync; none on
  CUDA); its one host sync per layer and step is `host_splits`. Rank 0 computes 538 of the 1024 expert rows:
  its six expert GEMMs take 12.0 ms, MKL's single-core peak for these shapes (107 GFLOP/s for every layout and
  split tried: fused or split gate/up, NN/NT/TN, 64-512 rows), with the same FLOPs and per-expert `mm` calls
  in every system; the rest of the expert FFN 1.1 ms (activation 0.55, autograd.Function and Python 0.4);
  everything outside the FFN 4.7 ms (routing, two permutes, five exchanges, two unpermutes, the combine and
  their backwards). moepass's main-thread CPU per step is 1-5 % above torchtitan's, 0.3-0.5 ms of it in the
  FFN: its activation backward recomputes act(gate) and act(gate) * up from the kept pre-activations (two more
  elementwise passes than autograd, which keeps them: memory for time), and its Function runs in Python. The
  exchanges cost no CPU to speak of (issue ~30 us, wait ~5 us of thread time each). The unpermutes gather rows
  through the inverse permutation (3x faster than the scatter they replaced, no clone of a fresh buffer).
  Wall time is not CPU time on this machine: a step takes 1.1-2.8x its main-thread CPU, changing with the
  other sessions' load from one minute to the next, and occasional steps page-fault 200-540 times in fresh
  glibc pages (~2 us each, any system). moepass / torchtitan per step (median of 30-45) ranged 0.71-1.26 within
  one hour with the code unchanged, 0.90-1.10 between back-to-back identical runs: a 10 % difference is below
  what this benchmark resolves here. The headline (`--systems peers@W2 --workloads issue --rounds 3`), that
  day: 1.105 [1.018, 1.196] and 1.101 [1.097, 1.318] (load 0.9-5.2) before the unpermute/activation changes;
  alternated before/after at load 5-6: before 0.915 [0.889, 1.002], 1.039 [1.020, 1.478], after
  0.982 [0.978, 1.242], 0.923 [0.668, 1.191]. The goal (<= 0.9) is not shown: the step is bound by GEMMs that
  are the same in every system and at the core's peak, and moepass's CPU per step is within a few percent of
  torchtitan's; what is left to remove is small (per step: ~0.3 ms of activation passes if the FFN keeps
  act(gate), ~0.15 ms of the two grad_scale passes if the FFN scales its weight GEMMs, ~0.1 ms of DTensor
  to_local autograd, ~0.06 ms of moe_sched.mark nodes without listeners, ~0.5 ms of the local permute and
  unpermute if the FFN ran the received (source, expert)-major rows as they arrive). Re-measured 2026-11-27 22:42
  UTC (load 0.5-1.0): 1.004 [0.986, 1.032], torchtitan the fastest peer every round; `ep_step.py --launches 3
  --steps 4 --systems moepass_bare transformers_a2a torchtitan_ep` (load 1.0-2.1): its layer 1.024 [0.961, 1.042],
  the 4-layer model 1.015 [0.980, 1.021] over the fastest peer (torchtitan).
  2026-11-28, the headline twice: 1.062 [1.042, 1.086] (load 1.3) and 1.047 [1.019, 1.208] (load 0.7-1.0),
  torchtitan the fastest peer every round. Per rank and step (torch.profiler, 10 steps, both ranks, moepass /
  torchtitan): aten::mm 15.8 / 16.3 ms on rank 0 and 17.0 / 16.8 on rank 1 (the same GEMMs), blocked in
  wait_tensor 3.6 / 4.6 and 4.0 / 3.5 ms (both ranks alike: the exchanges' latency, not one rank's skew), all
  other CPU 7.4 / 6.1 ms. Lina's chunking does not buy the overlap here: `a2a_chunks=2` 35.0 ms and 4 46.3 ms
  against 27.8 unchunked (main-thread CPU 28.1 / 37.3 / 22.1): each chunk repeats the permutes, the exchange
  issue and the FFN call, its expert GEMMs are split, and its weight gradients are summed (aten::add ~0.6 ms a
  call), while what overlap can hide is small: alone a 512-row all-to-all takes 0.39 ms here, issued before
  5.9 ms of GEMMs it adds 0.32 ms instead of 0.62 (~0.3 ms hidden per exchange, 4 exchanges a step) because the
  transfer itself runs on the same two busy cores. So the goal needs moepass to do ~3 ms (10 %) less work a step
  than a peer that runs the same GEMMs at the core's peak with the same exchanges: its whole non-GEMM CPU would
  have to halve (7.4 -> 3.7 ms). What would meet it: a device whose transfers do not take the compute's
  cycles (NCCL over NVLink/IB copy engines), where chunked overlap hides the exchanges outright.

Workloads (one Hugging Face `MixtralSparseMoeBlock`, fp32, SwiGLU, dropless, top-k softmax router):
  issue          the layer of issue 12: 512 tokens in all (2 sequences x 256), D=256, F=512, E=8, K=2.
  mixtral_proxy  Mixtral-8x7B's shape (D=4096, F=14336, E=8, K=2) scaled down 8x in D and F so that a
                 step takes well under a second on one core here: D=512, F=1792 (F/D = 3.5 as in
                 Mixtral), E=8, K=2, 1024 tokens in all (2 sequences x 512).
Each is the block of a 1-layer `MixtralForCausalLM`, random-init (seed 0) and saved once with
`save_pretrained` to a temporary directory; every system loads it from there with `from_pretrained`
(no hub access). The global input x (seed 1) and a fixed random probe of y's shape (seed 2) are the
same for every system; at W=2 rank r takes sequence r (half the tokens). loss = (y * probe).sum()
(not y.sum(): `torch._grouped_mm`'s backward rejects the expanded gradient of a sum), x requires grad.

Systems (one thread per process, gloo between the ranks; launched by the `Runner` of ep_step.py):
  moepass          W=1: 1 process, `moepass.compile(block, Plan(form="single"))`.
                   W=2: torchrun, 2 ranks: `moepass.compile(block, Plan(form="ep", topology=Topology(1, 2)))`
                   wrapped in DDP (which averages the replicated router gradient during backward).
  transformers_ep  W=2: torchrun, 2 ranks: `from_pretrained(path, distributed_config=DistributedConfig(
                   ep_size=2, fsdp_size=2, fsdp_plan={"model.layers.*.mlp": "free_full_weight"}))`: experts
                   sharded with all-to-all token dispatch, the router FSDP2-sharded (as in ep_step.py).
                   At W=1 transformers' path is the plain HF module, i.e. `original` below (its default
                   experts implementation is `grouped_mm`): the W=1 comparison moepass/transformers is
                   moepass/original, from the same launches.
  original         W=1: 1 process, the untouched HF block on all the tokens (the serial work).
                   At W=2, moepass/original is the W=2 step time over this W=1 time (ideal: 0.5).

Compute floor, measured in every launch, interleaved with the steps: one plain `torch.mm(a, b, out=c)`
with the FLOPs of the step's expert GEMMs per rank. rows = tokens x K / W (the expert rows of one rank
under an even load); forward = 3 GEMMs of 2 x rows x D x F FLOPs (gate, up, down) -> a [rows, D] x
[D, 3F] mm; forward+backward = 3x that (dX and dW for each) -> a [3 rows, D] x [D, 3F] mm. It leaves
out the router, the softmax/top-k, the permutation, the activation and the communication: every system
is above it, and the ratio system/floor says how close to pure GEMM time a step gets.

Method. A launch = one system at one W (a fresh process or torchrun group), both workloads. Per
workload: 1 untimed parity step, `--warmup` untimed iterations, then `--steps` timed iterations; one
iteration times, in this order, the forward (training mode: autograd records, the graph is dropped),
forward+backward (grads set to None first, gradient sync included: DDP all-reduce / FSDP
reduce-scatter), the floor's forward mm and the floor's forward+backward mm. At W=2 each timed call
starts after a barrier and its time is the max over the ranks. A launch's figure is the median of its
timed iterations. Launches alternate system by system (moepass W=1, original W=1, moepass W=2,
transformers_ep W=2, and again, `--rounds` times) so a load change on the shared cores hits every
system alike. Per workload / W / phase / system the JSON holds the median and (min, max) of the launch
medians, every launch median, the 1-minute load average before and after each launch, the floor of its
own launches (median and range) and the ratios system/floor (of the medians, and the median of the
per-launch ratios, which cancels load drift between launches), moepass/transformers_ep and
moepass/original. The parity step records the global loss, sum(y^2), sum(dL/dx^2) and each parameter
gradient's sum of squares (summed over ranks; at W=2 rescaled to the original's loss convention, see
`comparable`) per system, and their largest relative difference from the original's (the table flags
any above 1e-4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common, ep_peers  # noqa: E402
from benchmarks.ep_layer_worker import LAUNCHES, PEERS_KEY, PHASES, WORKLOADS, tokens, worker  # noqa: E402
from benchmarks.ep_step import mixtral_config, package_version, summary  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = HERE / "results" / "ep_layer.json"
# what the benchmark measures, in its results file
WHAT = ("forward and forward+backward time of one HF MixtralSparseMoeBlock (fp32, dropless) at W=1 and "
        "W=2 (gloo, 1 thread per rank): moepass vs transformers' EP vs the original block, against the "
        "expert GEMMs' compute floor (a plain torch.mm of the same FLOPs) timed in the same launches")


def aggregate_peers(launches: list[dict], workloads: list[str]) -> dict:
    """Per workload: each system's fwd+bwd (median and range of the launch medians) and moepass / the fastest
    peer per launch (the fastest peer of that launch: the smallest median of the others), median and range."""
    runs = [r for r in launches if r["key"] == PEERS_KEY]
    results: dict = {}
    for workload in workloads:
        per = [r["workloads"][workload] for r in runs if workload in r["workloads"]]
        if not per:
            continue
        systems = {n: _ms([p["median_s"][n] for p in per]) for n in per[0]["median_s"]}
        ratios, fastest = [], []
        for p in per:
            peers = {n: v for n, v in p["median_s"].items() if n != "moepass"}
            best = min(peers, key=peers.get)
            fastest.append(best)
            ratios.append(p["median_s"]["moepass"] / peers[best])
        results[workload] = {
            "systems": systems, "moepass_over_fastest_peer": {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_launch": ratios,
                "fastest_peer_per_launch": fastest},
            "parity": [p["parity"] for p in per],
            "load1": [{"round": r["round"], "before": r["load1_before"], "after": r["load1_after"]} for r in runs]}
    return results


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def save_layers(directory: Path, workloads: list[str]) -> dict[str, str]:
    """A random-init (seed 0) 1-layer Mixtral per workload, saved with save_pretrained; its block is the layer."""
    import torch
    from transformers import MixtralForCausalLM

    paths = {}
    for workload in workloads:
        s = WORKLOADS[workload]
        cfg = mixtral_config(s["hidden"], s["intermediate"], s["experts"], s["top_k"], layers=1, heads=8,
                             kv_heads=4, vocab=64, seq=s["seq"])
        torch.manual_seed(0)
        path = directory / workload
        MixtralForCausalLM(cfg).save_pretrained(path)
        paths[workload] = str(path)
    return paths


def launch(key: str, paths: dict, args, tmp: Path, index: int) -> tuple[dict | None, str]:
    """One launch of one system; (result or None, log tail: empty when it exited cleanly)."""
    world = LAUNCHES[key][1]
    result = tmp / f"{key}_{index}.json"
    worker_args = ["--worker", key, "--paths", json.dumps(paths), "--workloads", *args.workloads,
              "--warmup", str(args.warmup), "--result", str(result)]
    if args.steps:
        worker_args += ["--steps", str(args.steps)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    script = str(Path(__file__).resolve())
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               script, *worker_args]
    else:
        cmd = [sys.executable, script, *worker_args]
    return common.run_launch(cmd, env, ROOT, result, world, args.timeout, "[ep_layer rank")


def _ms(values: list[float]) -> dict:
    s = summary([1e3 * v for v in values])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"], "launch_medians_ms": [1e3 * v for v in values]}


def comparable(par: dict, ref: dict, world: int) -> dict[str, float]:
    """A launch's parity sums (over ranks) made comparable with the W=1 original's: at W=2 the gradients are
    those of the mean of the ranks' losses (the DDP / FSDP convention, which moepass EP follows for the expert
    weights), so a parameter's sum(grad^2) is scaled by W^2, and divided by its number of replicas (1 for a
    sharded parameter, W for a replicated one: summed local numels / the original's numel)."""
    out = {k: par[k] for k in ("loss", "y_sumsq", "dx_sumsq")}
    for key, value in par.items():
        if not key.startswith("grad_sumsq:") or key not in ref:
            continue
        name = key.split(":", 1)[1]
        replicas = par[f"numel:{name}"] / ref[f"numel:{name}"]
        out[key] = value / replicas * world ** 2
    return out


def aggregate(launches: list[dict], workloads: list[str], keys: list[str]) -> dict:
    results: dict = {}
    for workload in workloads:
        ref = [r for r in launches if r["key"] == "original@W1"]
        ref_par = ref[0]["workloads"][workload]["parity"] if ref else None
        for world in (1, 2):
            mine = [k for k in keys if LAUNCHES[k][1] == world and k != PEERS_KEY]
            runs = [r for r in launches if r["key"] in mine]
            if not runs:
                continue
            entry: dict = {"floor": {}, "systems": {}, "ratios": {}}
            first = runs[0]["workloads"][workload]
            for phase in PHASES:
                fl = [r["workloads"][workload]["median_s"][f"floor_{phase}"] for r in runs]
                flops = first["floor_flops"][phase]
                entry["floor"][phase] = {**_ms(fl), "mm_shape": first["floor_shapes"][phase], "flops": flops,
                                         "gflops_per_s": flops / statistics.median(fl) / 1e9,
                                         "from_launches": len(fl)}
            gl = [r["workloads"][workload]["median_s"]["grouped_floor_fwd_bwd"] for r in runs
                  if "grouped_floor_fwd_bwd" in r["workloads"][workload]["median_s"]]
            if gl:
                entry["floor"]["grouped_fwd_bwd"] = {
                    **_ms(gl), "what": "the step's 6 expert GEMMs alone (torch._grouped_mm, even load, hot)",
                    "ratio_to_floor": statistics.median(gl) / entry["floor"]["fwd_bwd"]["median_ms"] * 1e3,
                    "from_launches": len(gl)}
            for key in mine:
                sys_runs = [r for r in launches if r["key"] == key]
                if not sys_runs:
                    continue
                w0 = sys_runs[0]["workloads"][workload]
                e: dict = {"launch_key": key, "launches": len(sys_runs),
                           "load1": [{"round": r["round"], "before": r["load1_before"], "after": r["load1_after"]}
                                     for r in sys_runs],
                           "parity_step0": [r["workloads"][workload]["parity"] for r in sys_runs],
                           "build_s": [r["workloads"][workload]["build_s"] for r in sys_runs],
                           **{k: w0[k] for k in ("local_parameters", "tokens_this_process", "experts_implementation",
                                                 "moepass_rewritten") if k in w0}}
                if ref_par:
                    comp = [comparable(r["workloads"][workload]["parity"], ref_par, world) for r in sys_runs]
                    e["parity_max_rel_diff_vs_original"] = {
                        q: max(abs(c[q] - ref_par[q]) / abs(ref_par[q]) if q in c else float("nan") for c in comp)
                        for q in ref_par if not q.startswith("numel:")}
                for phase in PHASES:
                    med = [r["workloads"][workload]["median_s"][phase] for r in sys_runs]
                    own_floor = [r["workloads"][workload]["median_s"][f"floor_{phase}"] for r in sys_runs]
                    e[phase] = {
                        **_ms(med),
                        "best_step_ms": 1e3 * min(min(r["workloads"][workload]["step_s"][phase]) for r in sys_runs),
                        "floor_own_launches": _ms(own_floor),
                        "ratio_to_floor": statistics.median(med) / entry["floor"][phase]["median_ms"] * 1e3,
                        "ratio_to_floor_same_launch": statistics.median(m / f for m, f in zip(med, own_floor)),
                    }
                entry["systems"][LAUNCHES[key][0]] = e
            results.setdefault(workload, {})[f"W{world}"] = entry
        # cross-system ratios of the medians, per W and phase
        if workload not in results:
            continue
        w1, w2 = results[workload].get("W1", {}).get("systems", {}), results[workload].get("W2", {}).get("systems", {})
        for world, mine in (("W1", w1), ("W2", w2)):
            if world not in results[workload]:
                continue
            ratios = results[workload][world]["ratios"]
            tr = w1.get("original") if world == "W1" else w2.get("transformers_ep")
            for phase in PHASES:
                r: dict = {f"{s}/floor": p[phase]["ratio_to_floor"] for s, p in mine.items()}
                grouped_floor = results[workload][world]["floor"].get("grouped_fwd_bwd")
                if phase == "fwd_bwd" and grouped_floor:
                    r["grouped_gemms/floor"] = grouped_floor["ratio_to_floor"]
                    r.update({f"{s}/grouped_gemms": p[phase]["median_ms"] / grouped_floor["median_ms"]
                              for s, p in mine.items()})
                mp = mine.get("moepass")
                if mp and tr:
                    r["moepass/transformers_ep"] = mp[phase]["median_ms"] / tr[phase]["median_ms"]
                if mp and w1.get("original"):
                    r["moepass/original"] = mp[phase]["median_ms"] / w1["original"][phase]["median_ms"]
                if world == "W2" and tr and w1.get("original"):
                    r["transformers_ep/original"] = tr[phase]["median_ms"] / w1["original"][phase]["median_ms"]
                ratios[phase] = r
            if world == "W1":
                ratios["note"] = ("transformers' path at W=1 is the plain HF block (experts_implementation grouped_mm) "
                                  "= 'original': moepass/transformers_ep at W=1 is moepass/original")
            else:
                ratios["note"] = "moepass/original and transformers_ep/original: W=2 step time over the W=1 original's"
    return results


def host_info() -> dict:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": package_version("accelerate"), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty_files": len((git("status", "--porcelain", "--untracked-files=no") or "").splitlines())}


def orchestrate(args) -> int:
    keys = [k for k in LAUNCHES if k in args.systems]
    launches: list[dict] = []
    failures: list[dict] = []
    exit_aborts: list[dict] = []
    disabled: set[str] = set()
    t0 = time.perf_counter()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    waited = common.wait_for_load(args.wait_load, args.wait_max) if args.wait_load else 0.0
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ep_layer_") as tmpdir:
        tmp = Path(tmpdir)
        paths = save_layers(tmp, args.workloads)
        for rnd in range(args.rounds):
            for key in keys:
                if key in disabled:
                    continue
                res = None
                for attempt in range(2):  # one retry: a failed launch is recorded, not hidden
                    load_before = os.getloadavg()[0]
                    t = time.perf_counter()
                    res, log = launch(key, paths, args, tmp, rnd)
                    wall = time.perf_counter() - t
                    load_after = os.getloadavg()[0]
                    if res is not None:
                        if log:
                            exit_aborts.append({"launch": key, "round": rnd, "log": log})
                            print(f"[{rnd}] {key}: measured, then a process aborted at exit (log in 'exit_aborts')",
                                  flush=True)
                        break
                    failures.append({"launch": key, "round": rnd, "attempt": attempt, "log": log})
                    print(f"[{rnd}] {key}: launch FAILED (attempt {attempt}; log in the JSON 'failures')", flush=True)
                if res is None:
                    disabled.add(key)
                    continue
                res.update(round=rnd, wall_s=wall, load1_before=load_before, load1_after=load_after)
                launches.append(res)
                if key == PEERS_KEY:
                    print(f"[{rnd}] {key:19s} " + "  ".join(f"{w} " + " ".join(
                        f"{n} {1e3 * v:6.1f}" for n, v in res["workloads"][w]["median_s"].items())
                        for w in args.workloads) + f" ms fwd+bwd  (load {load_before:.2f}->{load_after:.2f})",
                        flush=True)
                    continue
                print(f"[{rnd}] {key:19s} " + "  ".join(
                    f"{w} fwd {1e3 * res['workloads'][w]['median_s']['fwd']:6.1f} fwd+bwd "
                    f"{1e3 * res['workloads'][w]['median_s']['fwd_bwd']:6.1f} (floor "
                    f"{1e3 * res['workloads'][w]['median_s']['floor_fwd_bwd']:6.1f}) ms" for w in args.workloads)
                    + f"  (launch {wall:4.1f} s, load {load_before:.2f}->{load_after:.2f})", flush=True)
    load_end = os.getloadavg()
    loads = [r["load1_before"] for r in launches] + [r["load1_after"] for r in launches]
    doc = {
        **common.results_header("ep_layer", WHAT, args.argv, started),
        "quick": args.quick,
        "workloads": {w: {**WORKLOADS[w], "tokens": tokens(WORKLOADS[w]), "dtype": "float32",
                          "steps": args.steps or WORKLOADS[w]["steps"]} for w in args.workloads},
        "systems": {
            "moepass": "W=1: 1 process, moepass.compile(block, Plan(form='single')); W=2: torchrun 2 ranks, "
                       "moepass.compile(block, Plan(form='ep', topology=Topology(1, 2))) + DDP",
            "transformers_ep": "W=2: torchrun 2 ranks, from_pretrained(distributed_config=DistributedConfig(ep_size=2, "
                               "fsdp_size=2, fsdp_plan={'model.layers.*.mlp': 'free_full_weight'})); W=1: = original",
            "original": "W=1: 1 process, the untouched HF block (experts_implementation grouped_mm) on all tokens",
        },
        "loss": "(y * probe).sum(), fixed random probe; x requires grad",
        "phases": {"fwd": "training-mode forward (autograd records; no backward)",
                   "fwd_bwd": "grads to None + forward + backward incl. gradient sync (DDP / FSDP)"},
        "floor": ("per rank, one torch.mm(out=) of the expert GEMM FLOPs: rows = tokens*K/W; fwd [rows, D] x [D, 3F] "
                  "(2*rows*D*F*3 FLOPs), fwd_bwd [3*rows, D] x [D, 3F] (3x); timed in every launch, interleaved "
                  "with the steps; the floor of a W pools all launches at that W; grouped_fwd_bwd: the step's 6 expert "
                  "GEMMs alone (torch._grouped_mm at the per-expert shapes, even load, hot), what any implementation "
                  "on this machine's GEMMs needs at least"),
        "threads_per_process": 1,
        "warmup_iterations": args.warmup,
        "rounds": args.rounds,
        "interleaved": "launch order " + ", ".join(keys) + " repeated per round; within a launch each iteration "
                       "times fwd, fwd_bwd, floor fwd, floor fwd_bwd, the grouped expert GEMMs in turn",
        "results": aggregate(launches, args.workloads, keys),
        "peers": aggregate_peers(launches, args.workloads),
        "peer_systems": {"moepass": ep_peers.DESCRIPTIONS["moepass"],
                         "transformers_a2a": ep_peers.DESCRIPTIONS["transformers_a2a"],
                         "torchtitan_ep": ep_peers.DESCRIPTIONS["torchtitan_ep"],
                         "transformers_ep": "from_pretrained(distributed_config=DistributedConfig(ep_size=2, "
                                            "fsdp_size=2, fsdp_plan={'model.layers.*.mlp': 'free_full_weight'}))"},
        "failures": failures,
        "exit_aborts": exit_aborts,
        "load_average": {"wait_load": args.wait_load, "waited_s": waited, "at_start": list(load_start),
                         "at_end": list(load_end), "load1_during": summary(loads) if loads else None,
                         "note": "includes this benchmark's own busy threads (1 at W=1, 2 at W=2)"},
        "machine": host_info(),
        "wall_s": time.perf_counter() - t0,
        "launches": launches,
    }
    for f in failures:
        print(f"{f['launch']} round {f['round']} attempt {f['attempt']} FAILED:\n{f['log'][-3000:]}")
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "ep_layer_quick.json" if args.quick else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table(doc)
    png = out.with_suffix(".png")
    if doc["results"]:
        plot(doc, png)
    print(f"wrote {out} and {png} ({doc['wall_s']:.0f} s)")
    return 0 if not disabled else 1


def table(doc: dict) -> None:
    la = doc["load_average"]["load1_during"]
    print(f"\nEP layer, fp32, 1 thread per process; {doc['rounds']} interleaved round(s); "
          + (f"load1 during run {la['median']:.2f} [{la['min']:.2f}, {la['max']:.2f}]" if la else ""))
    print(f"{'workload':14s} {'W':>2s} {'system':16s} {'fwd ms':>7s} {'range':>15s} {'fwd+bwd ms':>10s} {'range':>15s}"
          f" {'floor ms':>8s} {'x floor':>7s} {'x floor*':>8s} {'vs tr':>6s} {'vs orig':>7s}")
    for workload, per_w in doc["results"].items():
        for world, entry in per_w.items():
            fl = entry["floor"]["fwd_bwd"]
            ratios = entry["ratios"]["fwd_bwd"]
            for system, p in entry["systems"].items():
                f, s = p["fwd"], p["fwd_bwd"]
                vs_tr = ratios.get("moepass/transformers_ep") if system == "moepass" else None
                vs_or = ratios.get(f"{system}/original")
                rf, rs = f"[{f['min_ms']:.1f}, {f['max_ms']:.1f}]", f"[{s['min_ms']:.1f}, {s['max_ms']:.1f}]"
                print(f"{workload:14s} {world[1:]:>2s} {system:16s} {f['median_ms']:7.1f} "
                      f"{rf:>15s} {s['median_ms']:10.1f} "
                      f"{rs:>15s} {fl['median_ms']:8.1f} "
                      f"{s['ratio_to_floor']:7.2f} {s['ratio_to_floor_same_launch']:8.2f} "
                      + (f"{vs_tr:6.2f}" if vs_tr else f"{'':6s}") + " "
                      + (f"{vs_or:7.2f}" if vs_or else ""))
            grouped = entry["floor"].get("grouped_fwd_bwd")
            if grouped:
                print(f"{workload:14s} {world[1:]:>2s} {'expert GEMMs':16s} {'':7s} {'':>15s} {grouped['median_ms']:10.1f} "
                      f"{'':>15s} {fl['median_ms']:8.1f} {grouped['ratio_to_floor']:7.2f}")
    for workload, peers in doc.get("peers", {}).items():
        r = peers["moepass_over_fastest_peer"]
        print(f"{workload:14s}  W=2 one process group, interleaved per step: " + "  ".join(
            f"{n} {v['median_ms']:.1f} [{v['min_ms']:.1f}, {v['max_ms']:.1f}]" for n, v in peers["systems"].items())
            + f" ms; moepass / fastest peer {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}] "
            f"(fastest: {', '.join(r['fastest_peer_per_launch'])})")
    print("x floor: fwd+bwd median / floor median at that W; x floor*: median of per-launch ratios; "
          "vs tr: moepass / transformers' path (W=1: the original block); vs orig: over the W=1 original")
    worst, compared = 0.0, 0
    for w, per_w in doc["results"].items():
        for world, entry in per_w.items():
            for system, p in entry["systems"].items():
                d = p.get("parity_max_rel_diff_vs_original")
                if d and not all(v <= 1e-4 for v in d.values()):  # (a NaN: a gradient missing or not comparable)
                    print(f"PARITY {w} {world} {system}: max relative difference vs original {d}")
                if d and system != "original":
                    worst, compared = max(worst, *d.values()), compared + 1
    print(f"parity vs the original (loss, sum y^2, sum dx^2, sum grad^2 per parameter), {compared} system/W/workload"
          f" entries: largest relative difference {worst:.1e}" if compared else "parity: no original launch to compare")
    for f in doc["exit_aborts"]:
        last = [ln for ln in f["log"].splitlines() if "terminate" in ln or "Error" in ln or "Fatal" in ln][:2]
        print(f"{f['launch']} round {f['round']}: figures complete, then a process aborted at exit: {last}")
    for f in doc["failures"]:
        print(f"{f['launch']} round {f['round']} attempt {f['attempt']} FAILED:\n{f['log'][-1500:]}")


def plot(doc: dict, path: Path) -> None:
    """fwd+bwd ms per system, one panel per workload, W=1 and W=2 groups; the floor of each W as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"moepass": "tab:blue", "transformers_ep": "tab:orange", "original": "tab:gray"}
    labels = {"moepass": "moepass", "transformers_ep": "transformers EP",
              "original": "original HF block (= transformers' path at W=1)"}
    workloads = list(doc["results"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(max(6.5 * len(workloads), 10), 5), squeeze=False)
    seen: set[str] = set()
    for ax, workload in zip(axes[0], workloads):
        shape = doc["workloads"][workload]
        x = 0.0
        ticks, ticklabels = [], []
        for world, entry in doc["results"][workload].items():
            systems = list(entry["systems"])
            start = x
            for system in systems:
                p = entry["systems"][system]["fwd_bwd"]
                err = [[p["median_ms"] - p["min_ms"]], [p["max_ms"] - p["median_ms"]]]
                ax.bar(x, p["median_ms"], 0.8, yerr=err, capsize=3, color=colors[system],
                       label=None if system in seen else labels[system])
                ax.text(x, p["max_ms"], f"{p['ratio_to_floor']:.2f}x", ha="center", va="bottom", fontsize=8)
                seen.add(system)
                x += 1
            fl = entry["floor"]["fwd_bwd"]
            ax.hlines(fl["median_ms"], start - 0.45, x - 0.55, colors="black", linestyles="--",
                      label=None if "floor" in seen else "compute floor (GEMM of the same FLOPs)")
            seen.add("floor")
            ticks.append((start + x - 1) / 2)
            ticklabels.append(f"W={world[1:]}" + (" (2 ranks x 1 thread)" if world != "W1" else " (1 thread)"))
            x += 0.8
        ax.set_xticks(ticks, ticklabels)
        ax.set_ylabel("fwd+bwd ms (median of launches; bars: range)")
        ax.set_title(f"{workload}: {shape['tokens']} tokens, D={shape['hidden']}, F={shape['intermediate']}, "
                     f"E={shape['experts']}, K={shape['top_k']}", fontsize=10)
    fig.legend(loc="lower center", ncol=2 if len(workloads) == 1 else 4, fontsize=8, frameon=False)
    fig.suptitle(f"One MoE layer fwd+bwd, fp32, {doc['rounds']} interleaved round(s), {doc['started'][:10]}; "
                 "numbers: x the compute floor (dashed, per rank)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1 if len(workloads) == 1 else 0.07, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


COUNTS = {"--rounds": (3, 1, "interleaved launches per system"), "--warmup": (3, 1, "untimed iterations per workload")}


def main(argv: list[str] | None = None) -> int:
    p = common.benchmark_parser(__doc__, "1 round, 3 timed iterations, JSON to the temp dir", COUNTS)
    p.add_argument("--steps", type=int, default=None,
                   help="timed iterations per workload (default: issue 20, mixtral_proxy 10; --quick 3)")
    p.add_argument("--systems", nargs="+", default=list(LAUNCHES), choices=list(LAUNCHES))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--out", default=None, help=f"JSON path (default {OUT.relative_to(ROOT)}); the plot goes next to it")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    common.add_wait_options(p)
    # internal: one launch of one system
    p.add_argument("--worker", choices=list(LAUNCHES), help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = common.parse_args(p, argv, COUNTS)
    args.steps = args.steps or (3 if args.quick else None)
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
