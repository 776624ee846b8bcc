"""EP training-step time at W=2: moepass EP vs the original model vs transformers' own expert parallel.

    python benchmarks/ep_step.py            # full run: 3 launches per system, interleaved (~5-6 min here)
    python benchmarks/ep_step.py --quick    # smoke run: 1 launch per system, smaller shapes (< 1 min),
                                            # JSON to the temp dir unless --out
    python benchmarks/ep_step.py --wait-load 2.5   # first wait for the shared cores to quieten down

Writes benchmarks/results/ep_step.json (unless --out) and prints a table.

Workloads (both run in every launch, same weights for every system):
  layer  one Hugging Face `MixtralSparseMoeBlock` (D=512, F=1024, E=8, K=2, SwiGLU, dropless), input
         x [4, 512, 512] per rank = T=2048 tokens per rank (requires grad, as inside a model, so the
         backward runs every token exchange); loss = mean(y^2).
  model  a 4-layer HF `MixtralForCausalLM` (hidden 256, intermediate 512, E=8, K=2, 8 heads / 4 kv
         heads, vocab 1024, sdpa attention), batch 4 x seq 512 per rank, loss = the model's LM loss.
Both are random-init and saved once with `save_pretrained` to a temporary directory; every system
loads them from there with `from_pretrained` (no hub access), so all systems run identical weights
on the identical global batch (W x the per-rank batch; rank r takes slice r).

Systems (W = 2 ranks, gloo, one thread each; W=4 would oversubscribe the 2 cores):
  moepass_ep       torchrun, 2 ranks x 1 thread: `moepass.compile(model, Plan(form="ep",
                   topology=Topology(1, 2)))` on the loaded model (or block), wrapped in DDP, which
                   averages the replicated (non-expert) gradients during backward.
  transformers_ep  torchrun, 2 ranks x 1 thread: `from_pretrained(path, distributed_config=
                   DistributedConfig(ep_size=2, fsdp_size=2))`: experts sharded over EP with
                   all-to-all token dispatch (`AllToAllEP`), everything else FSDP2-sharded over the
                   same 2 ranks (transformers requires ep_size | fsdp_size * tp_size, and tp would
                   make the ranks share one batch). For the layer workload the same 1-layer model is
                   loaded with `fsdp_plan={"model.layers.*.mlp": "free_full_weight"}` so that the MoE
                   block is its own FSDP unit and can be called on its own (its router weight is
                   all-gathered in its forward, the gradient reduce-scattered in its backward).
  original_2t      1 process, 2 threads, the untouched model on the whole global batch: the same 2
                   cores as the 2 ranks, no communication. The fair same-hardware baseline.
  original_1t      1 process, 1 thread, the whole global batch: the serial work; EP at W=2 on 2
                   cores has at most a 2x speedup over it (and over original_2t whatever the
                   intra-op threading recovers).

One timed step = zero_grad + forward + backward, including whatever each system does to make the
gradients ready for an optimizer step (DDP all-reduce / FSDP reduce-scatter / nothing), no optimizer
step. In the distributed systems every step starts after a barrier and its time is the max over the
ranks. A launch = one fresh process group (torchrun) or process, `--warmup` untimed steps then
`--steps` timed steps per workload; its figure is the median of its timed steps. Launches alternate
system by system (A, B, C, D, A, B, C, D, ...) so a load change on the shared cores hits every system
alike; per system the JSON holds the median and the range (min, max) of the launch medians, the
fastest single step (a load-insensitive floor, not the headline), every launch's step times, and the
1-minute load average sampled before and after every launch.
Step 0's global mean loss is recorded per system: they agree to fp32 rounding (same model, same batch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = Path(__file__).resolve().parent / "results" / "ep_step.json"
W = 2
SYSTEMS = ("moepass_ep", "transformers_ep", "original_2t", "original_1t", "moepass_bare", "transformers_a2a",
           "torchtitan_ep")
# issue 32: moepass without DDP against the peers in their fastest configuration (ep_peers.py), no gradient sync
PEER_RUN = {"moepass_bare": "moepass", "transformers_a2a": "transformers_a2a", "torchtitan_ep": "torchtitan_ep"}
DISTRIBUTED = {"moepass_ep", "transformers_ep", *PEER_RUN}
WORKLOADS = ("layer", "model")

# shapes: full run / --quick
SHAPES = {
    "full": {
        "layer": dict(hidden=512, intermediate=1024, experts=8, top_k=2, batch=4, seq=512),
        "model": dict(hidden=256, intermediate=512, experts=8, top_k=2, layers=4, heads=8, kv_heads=4,
                      vocab=1024, batch=4, seq=512),
    },
    "quick": {
        "layer": dict(hidden=256, intermediate=512, experts=8, top_k=2, batch=2, seq=128),
        "model": dict(hidden=128, intermediate=256, experts=8, top_k=2, layers=4, heads=4, kv_heads=2,
                      vocab=512, batch=2, seq=128),
    },
}
# what the benchmark measures, in its results file
WHAT = ("forward + backward (+ gradient sync) time of one training step at W=2 gloo ranks x 1 thread, "
        "moepass EP vs transformers' EP (+FSDP2) vs the original model in one process on the global "
        "batch; medians over launches (each launch's figure = median of its timed steps) and ranges")


# ----------------------------------------------------------------------------------------------
# Checkpoints (orchestrator)
# ----------------------------------------------------------------------------------------------


def mixtral_config(hidden, intermediate, experts, top_k, layers, heads, kv_heads, vocab, seq):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=seq,
                         tie_word_embeddings=False, router_jitter_noise=0.0)


def save_checkpoints(directory: Path, shapes: dict) -> dict[str, str]:
    """Random-init models saved with save_pretrained: a 1-layer Mixtral (its block is the layer
    workload) and the 4-layer Mixtral."""
    import torch
    from transformers import MixtralForCausalLM

    s = shapes["layer"]
    layer_cfg = mixtral_config(s["hidden"], s["intermediate"], s["experts"], s["top_k"], layers=1, heads=8,
                               kv_heads=4, vocab=64, seq=s["seq"])
    m = shapes["model"]
    model_cfg = mixtral_config(m["hidden"], m["intermediate"], m["experts"], m["top_k"], m["layers"], m["heads"],
                               m["kv_heads"], m["vocab"], m["seq"])
    paths = {}
    for name, cfg in (("layer", layer_cfg), ("model", model_cfg)):
        torch.manual_seed(0)
        path = directory / name
        MixtralForCausalLM(cfg).save_pretrained(path)
        paths[name] = str(path)
    return paths


# ----------------------------------------------------------------------------------------------
# Worker: one launch of one system
# ----------------------------------------------------------------------------------------------


class Runner:
    """Builds one workload for one system; `step()` runs one training step and returns the loss."""

    def __init__(self, system: str, workload: str, path: str, shape: dict, rank: int, world: int):
        import torch

        self.system, self.workload = system, workload
        self.rank, self.world = rank, world
        per_rank = shape["batch"]
        global_batch = W * per_rank
        gen = torch.Generator().manual_seed(1)
        if workload == "layer":
            x = torch.randn(global_batch, shape["seq"], shape["hidden"], generator=gen)
        else:
            x = torch.randint(0, shape["vocab"], (global_batch, shape["seq"]), generator=gen)
        if system in DISTRIBUTED:
            x = x[rank * per_rank:(rank + 1) * per_rank]
        self.x = x.contiguous()
        self.module = self._build(path)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.info = self._describe()

    def _build(self, path: str):
        from transformers import MixtralForCausalLM

        if self.system == "transformers_ep":
            from transformers.distributed import DistributedConfig

            kw = {}
            if self.workload == "layer":
                kw["fsdp_plan"] = {"model.layers.*.mlp": "free_full_weight"}
            model = MixtralForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(ep_size=W, fsdp_size=W, **kw))
            model.train()
            return model.model.layers[0].mlp if self.workload == "layer" else model

        model = MixtralForCausalLM.from_pretrained(path)
        model.train()
        if self.system in PEER_RUN:
            import ep_peers

            peer = PEER_RUN[self.system]
            if self.workload == "layer":
                return ep_peers.build(peer, model.model.layers[0].mlp, W, copy_block=False)
            if peer == "moepass":
                return ep_peers.moepass_ep(model, W)
            return ep_peers.replace_blocks(model, peer, W)
        module = model.model.layers[0].mlp if self.workload == "layer" else model
        if self.system != "moepass_ep":
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        import moepass

        cm = moepass.compile(module, moepass.Plan(form="ep", topology=moepass.Topology(1, W)))
        self.compiled = cm
        return DDP(cm)

    def _describe(self) -> dict:
        from torch.distributed.tensor import DTensor

        inner = getattr(self.module, "module", self.module)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in inner.parameters())
        info = {"local_parameters": local, "tokens_this_process": int(self.x.shape[0] * self.x.shape[1])}
        cfg = getattr(inner, "config", None) or getattr(getattr(inner, "experts", None), "config", None)
        if cfg is not None:
            info["experts_implementation"] = getattr(cfg, "_experts_implementation", None)
            info["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
        if self.system == "moepass_ep":
            info["moepass_rewritten"] = sorted(self.compiled.moepass_info.rewritten) if hasattr(
                self.compiled, "moepass_info") else None
        return info

    def step(self):
        for p in self.params:
            p.grad = None
        if self.workload == "layer":
            x = self.x.detach().requires_grad_(True)
            y = self.module(x)
            loss = y.float().pow(2).mean()
        else:
            loss = self.module(input_ids=self.x, labels=self.x).loss
        loss.backward()
        return loss.detach()


def worker(args) -> int:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a C++ abort (SIGABRT) then dumps every thread's Python stack to stderr

    torch.set_num_threads(args.threads)
    system = args.worker
    distributed = system in DISTRIBUTED
    if distributed:  # (from_pretrained would otherwise initialise the same gloo group itself)
        dist.init_process_group("gloo")
    shapes = json.loads(args.shapes)
    paths = json.loads(args.paths)
    out: dict = {"system": system, "threads": torch.get_num_threads(), "workloads": {}}
    for workload in WORKLOADS:
        t_build = time.perf_counter()
        runner = Runner(system, workload, paths[workload], shapes[workload],
                        dist.get_rank() if dist.is_initialized() else 0,
                        dist.get_world_size() if dist.is_initialized() else 1)
        build_s = time.perf_counter() - t_build
        rank = runner.rank
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            if distributed:
                dist.barrier()
            t = time.perf_counter()
            loss = runner.step()
            elapsed = time.perf_counter() - t
            if distributed:
                pair = torch.tensor([elapsed, loss.item()], dtype=torch.float64)
                mx = pair.clone()
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                dist.all_reduce(pair)
                elapsed, loss_v = mx[0].item(), pair[1].item() / runner.world
            else:
                loss_v = loss.item()
            losses.append(loss_v)
            if i >= args.warmup:
                times.append(elapsed)
            print(f"[ep_step rank {rank}] {system} {workload} step {i} done", file=sys.stderr, flush=True)
        out["workloads"][workload] = {"step_s": times, "median_s": statistics.median(times),
                                      "loss_step0": losses[0], "build_s": build_s, **runner.info}
        del runner
    if not distributed or dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(out))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    print(f"[ep_step] {system} worker finished", file=sys.stderr, flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def _launch(system: str, paths: dict, shapes: dict, args, tmp: Path, index: int) -> tuple[dict | None, str]:
    result = tmp / f"{system}_{index}.json"
    worker_args = ["--worker", system, "--paths", json.dumps(paths), "--shapes", json.dumps(shapes),
              "--warmup", str(args.warmup), "--steps", str(args.steps), "--result", str(result)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    script = str(Path(__file__).resolve())
    if system in DISTRIBUTED:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={W}",
               script, *worker_args, "--threads", "1"]
    else:
        threads = 2 if system == "original_2t" else 1
        env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, script, *worker_args, "--threads", str(threads)]
    return common.run_launch(cmd, env, ROOT, result, W if system in DISTRIBUTED else 1, args.timeout, "[ep_step rank")


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def orchestrate(args) -> int:
    import torch
    import transformers

    shapes = SHAPES["quick" if args.quick else "full"]
    systems = [s for s in SYSTEMS if s in args.systems]
    launches: list[dict] = []
    failures: list[dict] = []  # every failed launch: system, round, attempt, log tail
    disabled: set[str] = set()
    exit_aborts: list[dict] = []  # launches whose figures are complete but a process died at exit
    t0 = time.perf_counter()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if args.wait_load:
        waited = common.wait_for_load(args.wait_load, args.wait_max)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ep_step_") as tmpdir:
        tmp = Path(tmpdir)
        paths = save_checkpoints(tmp, shapes)
        for rnd in range(args.launches):
            for system in systems:
                if system in disabled:
                    continue
                for attempt in range(2):  # one retry: a failed launch is recorded, not hidden
                    load_before = os.getloadavg()[0]
                    t = time.perf_counter()
                    res, log = _launch(system, paths, shapes, args, tmp, rnd)
                    wall = time.perf_counter() - t
                    load_after = os.getloadavg()[0]
                    if res is not None:
                        if log:
                            exit_aborts.append({"system": system, "round": rnd, "log": log})
                            print(f"[{rnd}] {system}: measured, then a process aborted at exit (log in the JSON "
                                  "'exit_aborts')", flush=True)
                        break
                    failures.append({"system": system, "round": rnd, "attempt": attempt, "log": log})
                    print(f"[{rnd}] {system}: launch FAILED (attempt {attempt}; log in the JSON 'failures')",
                          flush=True)
                if res is None:
                    disabled.add(system)
                    continue
                res.update(round=rnd, wall_s=wall, load1_before=load_before, load1_after=load_after)
                launches.append(res)
                print(f"[{rnd}] {system:16s} " + "  ".join(
                    f"{w} {1e3 * res['workloads'][w]['median_s']:7.1f} ms" for w in WORKLOADS)
                      + f"   (launch {wall:4.1f} s, load {load_before:.2f}->{load_after:.2f})", flush=True)
    load_end = os.getloadavg()

    from ep_peers import DESCRIPTIONS as PEER_DESCRIPTIONS

    results: dict = {}
    peer_ratios: dict = {}  # workload -> moepass_bare / fastest peer, per round
    for workload in WORKLOADS:
        per = {}
        for system in systems:
            mine = [r for r in launches if r["system"] == system]
            if not mine:
                continue
            medians = [r["workloads"][workload]["median_s"] for r in mine]
            first = mine[0]["workloads"][workload]
            per[system] = {
                "launch_medians_s": medians,
                **{f"{k}_s": v for k, v in summary(medians).items() if k != "n"},
                "launches": len(medians),
                # the fastest single step over all launches: a load-insensitive floor, not the headline
                "best_step_s": min(min(r["workloads"][workload]["step_s"]) for r in mine),
                "loss_step0": [r["workloads"][workload]["loss_step0"] for r in mine],
                **{k: first[k] for k in ("local_parameters", "tokens_this_process", "experts_implementation",
                                         "attn_implementation", "moepass_rewritten") if k in first},
            }
        ref_loss = per.get("original_1t", per.get("original_2t", {})).get("loss_step0", [None])[0]
        for p in per.values():
            if ref_loss:
                p["loss_step0_max_rel_diff_vs_original"] = max(abs(v - ref_loss) / abs(ref_loss) for v in p["loss_step0"])
        base = per.get("original_2t", {}).get("median_s")
        base1 = per.get("original_1t", {}).get("median_s")
        for p in per.values():
            if base:
                p["speedup_vs_original_2t"] = base / p["median_s"]
            if base1:
                p["speedup_vs_original_1t"] = base1 / p["median_s"]
        peer_launches = [[r for r in launches if r["system"] == sys_] for sys_ in ("transformers_a2a", "torchtitan_ep")]
        mine = [r for r in launches if r["system"] == "moepass_bare"]
        ratios = []
        for rnd, r in enumerate(mine):  # per round: moepass / the fastest peer of that round
            peers = [pl[rnd]["workloads"][workload]["median_s"] for pl in peer_launches if len(pl) > rnd]
            if peers:
                ratios.append(r["workloads"][workload]["median_s"] / min(peers))
        if ratios:
            peer_ratios[workload] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                     "per_round": ratios}
        results[workload] = per

    loads = [r["load1_before"] for r in launches] + [r["load1_after"] for r in launches]
    doc = {
        **common.results_header("ep_step", WHAT, args.argv, started),
        "quick": args.quick,
        "world": W,
        "shapes": shapes,
        "systems": {
            "moepass_ep": "torchrun 2 ranks x 1 thread; moepass.compile(Plan(form='ep', topology=Topology(1, 2))) "
                          "+ DDP for the replicated parameters",
            "transformers_ep": "torchrun 2 ranks x 1 thread; from_pretrained(distributed_config=DistributedConfig("
                               "ep_size=2, fsdp_size=2)): AllToAllEP experts + FSDP2 on the rest (layer workload: "
                               "fsdp_plan={'model.layers.*.mlp': 'free_full_weight'} so the block is its own FSDP unit)",
            "original_2t": "1 process x 2 threads, untouched model, whole global batch (W x per-rank batch)",
            "original_1t": "1 process x 1 thread, untouched model, whole global batch",
            "moepass_bare": "torchrun 2 ranks x 1 thread; " + PEER_DESCRIPTIONS["moepass"],
            "transformers_a2a": "torchrun 2 ranks x 1 thread; " + PEER_DESCRIPTIONS["transformers_a2a"]
                                + " (model workload: on every decoder layer's block)",
            "torchtitan_ep": "torchrun 2 ranks x 1 thread; " + PEER_DESCRIPTIONS["torchtitan_ep"]
                             + " (model workload: in place of every decoder layer's block)",
            "peer_note": "moepass_bare, transformers_a2a and torchtitan_ep synchronise no gradient (the same "
                         "all-reduce of the replicated gradients would be added to each)",
        },
        "step_definition": ("zero_grad + forward + backward including gradient synchronisation (DDP all-reduce / "
                            "FSDP reduce-scatter / none); no optimizer step; distributed: barrier before each step, "
                            "time = max over ranks"),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "launches_per_system": args.launches,
        "interleaved": "launch order " + ", ".join(systems) + " repeated",
        "results": results,
        "moepass_bare_over_fastest_peer": peer_ratios,
        "failures": failures,
        "exit_aborts": exit_aborts,
        "load_average": {
            "wait_load": args.wait_load, "waited_s": waited if args.wait_load else 0.0,
            "at_start": list(load_start), "at_end": list(load_end),
            "load1_during": summary(loads) if loads else None,
            "note": "includes this benchmark's own 2 busy threads; 2 cores shared with other agents",
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "accelerate": package_version("accelerate")},
        "wall_s": time.perf_counter() - t0,
        "launches": launches,
    }
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "ep_step_quick.json" if args.quick else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    _table(doc)
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0 if not disabled else 1


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _table(doc: dict) -> None:
    la = doc["load_average"]["load1_during"]
    print(f"\nEP step time, W={doc['world']} x 1 thread (gloo) vs original in 1 process; "
          f"{doc['launches_per_system']} interleaved launches x {doc['timed_steps']} timed steps; "
          f"load1 during run {la['median']:.2f} [{la['min']:.2f}, {la['max']:.2f}]" if la else "")
    print(f"{'workload':8s} {'system':16s} {'median ms':>10s} {'range ms':>17s} {'vs orig 2t':>10s} "
          f"{'vs orig 1t':>10s} {'best step':>9s} {'loss step0':>11s}")
    for workload, per in doc["results"].items():
        for system, p in per.items():
            rng = f"[{1e3 * p['min_s']:.1f}, {1e3 * p['max_s']:.1f}]"
            print(f"{workload:8s} {system:16s} {1e3 * p['median_s']:10.1f} {rng:>17s} "
                  f"{p.get('speedup_vs_original_2t', float('nan')):9.2f}x {p.get('speedup_vs_original_1t', float('nan')):9.2f}x "
                  f"{1e3 * p['best_step_s']:9.1f} {p['loss_step0'][0]:11.6f}")
    for workload, r in doc.get("moepass_bare_over_fastest_peer", {}).items():
        print(f"{workload:8s} moepass_bare / fastest peer (transformers_a2a, torchtitan_ep) per round: "
              f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")
    for f in doc["exit_aborts"]:
        last = [ln for ln in f["log"].splitlines() if "terminate" in ln or "Error" in ln or "Fatal" in ln][:2]
        print(f"{f['system']} launch {f['round']}: figures complete, then a process aborted at exit: {last}")
    for f in doc["failures"]:
        print(f"{f['system']} launch {f['round']} attempt {f['attempt']} FAILED:\n{f['log'][-1500:]}")


COUNTS = {"--launches": (3, 1, "launches per system"), "--warmup": (2, 1, "untimed steps per workload"),
          "--steps": (5, 2, "timed steps per workload")}


def main(argv: list[str] | None = None) -> int:
    p = common.benchmark_parser(__doc__, "1 launch per system, smaller shapes (< 1 min)", COUNTS)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--out", default=None, help=f"JSON path (default {OUT.relative_to(ROOT)})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    common.add_wait_options(p)
    # internal: one launch of one system
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = common.parse_args(p, argv, COUNTS)
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
