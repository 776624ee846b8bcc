"""Step time: partitioned + prioritised (Lina) vs plain EP + DDP, with all-to-all and the DDP bucket
all-reduce sharing the links; a timeline of one step; the chunk count the cost model picks for three
compute/transfer ratios.

    .venv/bin/python benchmarks/schedule.py            # W=2 on loopback + W=4 in network namespaces (root)
    .venv/bin/python benchmarks/schedule.py --no-netns # W=2 only

plain   : Plan(form="ep", a2a_chunks=1) wrapped in DDP (default 25 MB buckets, gloo, world group).
lina    : Plan(form="ep", a2a_chunks=n) wrapped in moepass.DataParallel (micro-ops of MICRO_OP_BYTES,
          priority rule, its own group); n from the cost model for the link (see `pick_chunks`).
W=4     : ranks 0,1 = "node A", ranks 2,3 = "node B", each rank in its own network namespace with a veth
          into its node's bridge (unlimited: intra-node); the two bridges are joined by one veth pair
          limited with `tc tbf` in both directions (inter-node). 4 ranks share 2 cores: the W=4 times
          include CPU contention (ENVIRONMENT.md), the link limit is what makes communication matter.
Writes benchmarks/results/schedule.json and schedule_timeline.png (+ .svg).

Lina's scenario (issue 18), W=2: two ranks in two network namespaces joined by one tc-limited veth
(benchmarks/netns.py, layout one_node), a model whose dense gradients (embedding + LM head, untied) are
large enough that DDP's bucket all-reduce runs while the backward all-to-all does:

    sudo .venv/bin/python benchmarks/schedule.py --lina-w2                 # writes results/schedule_lina_w2.json
    .venv/bin/python benchmarks/schedule.py --lina-w2 --loopback --tiny    # a smoke run: no root, no link

Each rank builds both set-ups and alternates them step by step (interleaved rounds: the same machine
state for both): plain = Plan(a2a_chunks=1) in DDP (25 MB buckets), lina = Plan(a2a_chunks=n,
micro_op_bytes=m) in moepass.DataParallel (priority micro-ops, pipelined forward and backward). Per
set-up: step time median and range (a step ends on its slower rank), the all-to-all share of the plain
step (union of all-to-all intervals / step), all-to-all durations with and without an all-reduce
running at the same time (event log), the most all-reduce micro-ops any all-to-all overlapped and the
largest micro-op. Timelines of one step each (forward and backward) next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
MODEL = dict(style="fused", vocab_size=2048, dim=256, ffn_dim=256, num_experts=8, top_k=2, layers=2, heads=4)
BATCH, SEQ = 4, 64  # per rank
MICRO_OP_BYTES = 256 * 1024
WARMUP, STEPS = 2, 5
NETNS = dict(prefix="mpb", subnet="10.77.0", port=29611)  # W=4 namespaces (benchmarks/netns.py)
LINK = dict(rate="100mbit", burst="64kb", latency="100ms")  # the inter-node link
FLOPS, ALPHA = 5e10, 2e-3  # cost-model figures for the chunk count (see main)


# ----------------------------------------------------------------------------------------------
# The chunk count from the cost model.
# ----------------------------------------------------------------------------------------------


def pick_chunks(spec, tokens, ep, per_node, bandwidth, flops, alpha):
    from cost_model.presets import this_machine
    from moepass.schedule import layer_times

    hw = this_machine().with_figures("benchmark", flops=flops, intra_bw=bandwidth, inter_bw=bandwidth, alpha=alpha)
    times = layer_times(spec, tokens, ep, per_node, hardware=hw)
    return times.compute / times.transfer, times.chunks()


# ----------------------------------------------------------------------------------------------
# One rank.
# ----------------------------------------------------------------------------------------------


def worker(rank, world, addr, port, mode, chunks, out_dir, nodes):
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moepass
    from moepass.runtime import events
    from samples.models import tiny_mixtral

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = tiny_mixtral(**MODEL)
    plan = moepass.Plan(form="ep", a2a_chunks=chunks, topology=moepass.Topology(nodes, world // nodes),
                        micro_op_bytes=MICRO_OP_BYTES)
    cm = moepass.compile(model, plan)
    wrapped = DDP(cm) if mode == "plain" else moepass.DataParallel(cm)
    if mode == "plain":
        wrapped.register_comm_hook(None, events.ddp_logging_hook)  # DDP's all-reduce, seen by the event log
    opt = torch.optim.SGD(cm.parameters(), lr=0.01)
    log = events.EventLog(rank).start()
    times = []
    for step in range(WARMUP + STEPS):
        tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        dist.barrier()
        log.clear()
        start = time.perf_counter()
        with log.region("forward"):
            out = wrapped(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))
        with log.region("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    log.stop()
    waits = events.priority_waits(log.events)
    result = {"rank": rank, "mode": mode, "chunks": chunks, "step_s": times[WARMUP:],
              "max_allreduce_per_a2a": max(waits) if waits else 0,
              "events": [e.to_json() for e in log.events]}
    Path(out_dir, f"{mode}_{rank}.json").write_text(json.dumps(result))
    if mode == "lina":
        wrapped.close()
    dist.barrier()
    dist.destroy_process_group()


def _spawn_target(rank, world, port, mode, chunks, out_dir, nodes):
    worker(rank, world, "127.0.0.1", port, mode, chunks, out_dir, nodes)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loopback(world, mode, chunks, out_dir):
    import torch.multiprocessing as mp

    mp.spawn(_spawn_target, args=(world, _free_port(), mode, chunks, out_dir, 1), nprocs=world, join=True)


# ----------------------------------------------------------------------------------------------
# Network namespaces (W=4, two simulated nodes, a tc-limited inter-node link): benchmarks/netns.py.
# ----------------------------------------------------------------------------------------------


def netns_runner(ns):
    """A runner (like `run_loopback`) that starts the ranks in the namespaces of `ns`."""

    def run_netns(world, mode, chunks, out_dir):
        ns.run(lambda r: [sys.executable, __file__, "--worker", str(r), str(world), ns.master_addr, str(ns.port),
                          mode, str(chunks), out_dir, "2"], timeout=900)

    return run_netns


# ----------------------------------------------------------------------------------------------
# Lina's scenario at W=2: plain EP + DDP vs Lina, interleaved, over one tc-limited veth.
# ----------------------------------------------------------------------------------------------

# sized so the all-to-all is >= 25 % of the plain step and the dense gradients' all-reduce (vocab 4096: ~10 MB)
# can hide behind the backward on the link: 1gbit with vocab 16384 / F 512 / K 2 gave an all-to-all share of
# 11 % (a step of 1.49 s was compute), and Lina could not show its gain there
LINA_W2: dict[str, Any] = dict(model=dict(style="fused", vocab_size=4096, dim=256, ffn_dim=256, num_experts=8, top_k=4, layers=2,
                          heads=4),
               batch=(8, 128), chunks=4, micro_op_bytes=1 << 20, rounds=12, warmup=2,
               link=dict(rate="200mbit", burst="256kb", latency="100ms"))
LINA_W2_TINY: dict[str, Any] = dict(LINA_W2, model=dict(LINA_W2["model"], vocab_size=512, dim=32, ffn_dim=32, heads=2),
                    batch=(2, 16), chunks=2, micro_op_bytes=4096, rounds=2, warmup=1)


def _union(spans):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_figures(events, step_s, micro_op_bytes):
    """One rank's step: all-to-all share, durations with / without a concurrent all-reduce, priority."""
    from moepass.runtime import events as ev

    a2a = [e for e in events if e.category == "all_to_all" and e.kind != "counts"]
    reduces = [e for e in events if e.category == "all_reduce"]
    shared, alone = [], []
    for e in a2a:
        (shared if any(r.start < e.end and r.end > e.start for r in reduces) else alone).append(e.end - e.start)
    return {"step_s": step_s, "a2a_share": _union([(e.start, e.end) for e in a2a]) / step_s,
            "a2a_s_with_allreduce": shared, "a2a_s_alone": alone,
            "max_allreduce_per_a2a": max(ev.priority_waits(events), default=0),
            "largest_allreduce_bytes": max((e.nbytes for e in reduces), default=0),
            "micro_op_bytes": micro_op_bytes}


def lina_w2_worker(config):
    """One rank (env from Namespaces.run / Loopback.run): both set-ups, alternating; JSON to $NETNS_RESULT."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moepass
    from moepass.runtime import events
    from samples.models import tiny_mixtral

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    setups = {}
    for mode, chunks in (("plain", 1), ("lina", config["chunks"])):
        torch.manual_seed(0)
        cm = moepass.compile(tiny_mixtral(**config["model"]), moepass.Plan(
            form="ep", a2a_chunks=chunks, topology=moepass.Topology(1, world),
            micro_op_bytes=config["micro_op_bytes"]))
        if mode == "plain":
            wrapped = DDP(cm)
            wrapped.register_comm_hook(None, events.ddp_logging_hook)  # DDP's all-reduce, seen by the event log
        else:
            wrapped = moepass.DataParallel(cm)
        setups[mode] = (cm, wrapped, torch.optim.SGD(cm.parameters(), lr=1e-3))
    dense = sum(p.numel() * p.element_size() for p in setups["plain"][0].parameters()
                if not hasattr(p, "device_mesh"))
    log = events.EventLog(rank).start()
    batch, seq = config["batch"]
    out = {mode: [] for mode in setups}
    timelines = {}
    for step in range(config["warmup"] + config["rounds"]):
        tokens = torch.randint(0, config["model"]["vocab_size"], (batch, seq + 1),
                               generator=torch.Generator().manual_seed(1000 * step + rank))
        for mode in (("plain", "lina") if step % 2 == 0 else ("lina", "plain")):  # alternate who goes first
            cm, wrapped, opt = setups[mode]
            dist.barrier()
            log.clear()
            start = time.perf_counter()
            logits = wrapped(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_s = time.perf_counter() - start
            if step >= config["warmup"]:
                out[mode].append(step_figures(log.events, step_s, config["micro_op_bytes"]))
                timelines[mode] = [e.to_json() for e in log.events]
    log.stop()
    setups["lina"][1].close()
    dist.barrier()
    dist.destroy_process_group()
    result = {"rank": rank, "dense_grad_bytes": dense, "steps": out, "timeline": timelines}
    Path(os.environ["NETNS_RESULT"]).write_text(json.dumps(result))


def summarise_lina_w2(runs, config):
    """Both ranks' JSON -> the figures of the closing note (see the module doc)."""
    import statistics

    def stats(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None

    summary = {}
    for mode in ("plain", "lina"):
        steps = [max(r["steps"][mode][i]["step_s"] for r in runs) for i in range(config["rounds"])]
        every = [s for r in runs for s in r["steps"][mode]]
        summary[mode] = {
            "step_s": stats(steps),
            "a2a_share": stats([s["a2a_share"] for s in every]),
            "a2a_s_with_allreduce": stats([d for s in every for d in s["a2a_s_with_allreduce"]]),
            "a2a_s_alone": stats([d for s in every for d in s["a2a_s_alone"]]),
            "max_allreduce_per_a2a": max(s["max_allreduce_per_a2a"] for s in every),
            "largest_allreduce_bytes": max(s["largest_allreduce_bytes"] for s in every),
        }
    summary["speedup_plain_over_lina"] = summary["plain"]["step_s"]["median"] / summary["lina"]["step_s"]["median"]
    summary["dense_grad_bytes"] = runs[0]["dense_grad_bytes"]
    return summary


def run_lina_w2(loopback: bool, tiny: bool, out_path: Path) -> dict:
    from benchmarks.netns import Link, Loopback, Namespaces

    config = LINA_W2_TINY if tiny else LINA_W2
    argv = [sys.executable, __file__, "--lina-w2-worker", json.dumps(config)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    ctx: Loopback | Namespaces = Loopback(2) if loopback else Namespaces(2, "one_node", Link(**config["link"]), prefix="mplina",
                                                  subnet="10.78.0", port=29631)
    with ctx as ns:
        runs: list[Any] = [run.result for run in ns.run(argv, env=env, timeout=1800)]  # each rank's JSON
        settings = ns.settings()
    result = {"config": config, "link_settings": settings, **summarise_lina_w2(runs, config)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    plot({mode: [{"events": runs[0]["timeline"][mode]}] for mode in ("plain", "lina")},  # rank 0
         out_path.with_suffix(""), "W=2, one step each: plain EP + DDP vs Lina (chunked, pipelined, prioritised)")
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "link_settings")}, indent=1))
    return result


# ----------------------------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------------------------


def collect(out_dir, mode, world):
    runs = [json.loads(Path(out_dir, f"{mode}_{r}.json").read_text()) for r in range(world)]
    per_step = [max(r["step_s"][i] for r in runs) for i in range(STEPS)]  # a step ends on its slowest rank
    per_step.sort()
    return {"median_step_s": per_step[len(per_step) // 2], "steps_s": per_step, "chunks": runs[0]["chunks"],
            "max_allreduce_per_a2a": max(r["max_allreduce_per_a2a"] for r in runs)}, runs


def measure(world, runner, chunk_counts, label):
    """plain (n=1, DDP) vs lina at each chunk count; ratios plain / lina."""
    out, events = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, chunks in [("plain", 1)] + [("lina", n) for n in chunk_counts]:
            runner(world, mode, chunks, tmp)
            key = mode if mode == "plain" else f"lina_n{chunks}"
            out[key], runs = collect(tmp, mode, world)
            events[key] = runs
            print(f"{label}: {key} {out[key]['median_step_s'] * 1e3:.1f} ms, max all-reduce ops per a2a "
                  f"{out[key]['max_allreduce_per_a2a']}", flush=True)
    for n in chunk_counts:
        out[f"ratio_plain_over_lina_n{n}"] = out["plain"]["median_step_s"] / out[f"lina_n{n}"]["median_step_s"]
    print(label, {k: round(v, 3) for k, v in out.items() if k.startswith("ratio")}, flush=True)
    return out, {k: events[k] for k in ("plain", f"lina_n{chunk_counts[-1]}")}


def breakdown(world, runner, chunks):
    """Each ingredient alone: chunking without priority, priority without chunking."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, n in (("plain", 1), ("plain", chunks), ("lina", 1), ("lina", chunks)):
            runner(world, mode, n, tmp)
            out[f"{mode}_n{n}"] = collect(tmp, mode, world)[0]["median_step_s"]
            print(f"  {mode} n={n}: {out[f'{mode}_n{n}'] * 1e3:.1f} ms", flush=True)
    return out


def plot(events_by_mode, path_stem, title):
    from moepass.runtime.events import Event, plot_timeline

    evs = []
    for mode, runs in events_by_mode.items():
        for r in runs:
            for e in r["events"]:
                e = dict(e)
                e["rank"] = f"{mode} r{e['rank']}"
                evs.append(Event(**e))
    # one lane set per mode, each mode's step starting at 0
    for mode in events_by_mode:
        mine = [e for e in evs if e.rank.startswith(mode)]
        t0 = min(e.start for e in mine)
        for e in mine:
            e.start, e.end = e.start - t0, e.end - t0
    for suffix in (".png", ".svg"):
        plot_timeline(evs, str(path_stem) + suffix, title)


def ratio_configs():
    """Three configurations (expert width x link) and the n the cost model picks for each."""
    import torch

    import moepass
    from samples.models import FusedMoE

    rows = []
    for name, ffn, bandwidth in (("transfer-bound", 256, 1e8), ("balanced", 2048, 1e8), ("compute-bound", 4096, 1e9)):
        torch.manual_seed(0)
        spec = moepass.detect(FusedMoE(256, ffn, 8, 2)).blocks[0]
        ratio, n = pick_chunks(spec, BATCH * SEQ, 4, 2, bandwidth, flops=FLOPS, alpha=ALPHA)
        rows.append({"config": name, "ffn_dim": ffn, "bandwidth_Bps": bandwidth, "compute_over_transfer": ratio,
                     "chosen_chunks": n})
        print(f"{name}: F={ffn} B={bandwidth:.3g} B/s compute/transfer={ratio:.3g} -> n={n}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-netns", action="store_true")
    parser.add_argument("--worker", nargs=8)
    parser.add_argument("--breakdown", type=int, default=0, help="W=2: plain/lina at n=1 and n=N, then exit")
    parser.add_argument("--lina-w2", action="store_true", help="Lina's scenario at W=2 over a tc-limited veth")
    parser.add_argument("--loopback", action="store_true", help="with --lina-w2: loopback, no namespaces (debug)")
    parser.add_argument("--tiny", action="store_true", help="with --lina-w2: tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "schedule_lina_w2.json")
    parser.add_argument("--lina-w2-worker", metavar="CONFIG_JSON")
    args = parser.parse_args(argv)
    if args.lina_w2_worker:
        lina_w2_worker(json.loads(args.lina_w2_worker))
        return 0
    if args.lina_w2:
        run_lina_w2(args.loopback, args.tiny, args.out)
        return 0
    if args.breakdown:
        print(breakdown(2, run_loopback, args.breakdown))
        return 0
    if args.worker:
        r, w, addr, port, mode, chunks, out_dir, nodes = args.worker
        worker(int(r), int(w), addr, int(port), mode, int(chunks), out_dir, int(nodes))
        return 0
    import torch

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    spec = moepass.detect(tiny_mixtral(**MODEL)).blocks[0]
    result = {"model": MODEL, "batch_per_rank": [BATCH, SEQ], "micro_op_bytes": MICRO_OP_BYTES, "steps": STEPS,
              "warmup": WARMUP, "ratio_configs": ratio_configs()}
    # W=2 loopback: figures of this machine (gloo loopback, 1 thread)
    # figures: FLOPS = half the 95 GFLOP/s a 512x256x256 fp32 matmul reaches on one thread here; alpha = the
    # per-chunk overhead measured with --breakdown (~2 ms per extra chunk); bandwidth: loopback / the tc rate.
    _, n2 = pick_chunks(spec, BATCH * SEQ, 2, 2, bandwidth=1e9, flops=FLOPS, alpha=ALPHA)
    result["w2_loopback"], ev2 = measure(2, run_loopback, sorted({n2, 2}), "W=2 loopback")
    result["w2_loopback"]["cost_model_chunks"] = n2
    plot(ev2, RESULTS / "schedule_timeline", "W=2 loopback, last step: plain (DDP buckets, n=1) vs lina "
         "(chunked n=2 + prioritised)")
    if not args.no_netns:
        from benchmarks.netns import Link, Namespaces, rate_bytes_per_s

        try:
            with Namespaces(4, "two_nodes", Link(**LINK), **NETNS) as ns:
                _, n4 = pick_chunks(spec, BATCH * SEQ, 4, 2, bandwidth=rate_bytes_per_s(LINK["rate"]), flops=FLOPS,
                                    alpha=ALPHA)
                result["w4_netns"], ev4 = measure(4, netns_runner(ns), sorted({n4, 2}), "W=4 netns")
                result["w4_netns"]["cost_model_chunks"] = n4
                result["w4_netns"]["settings"] = {**ns.settings(), "nodes": 2, "ranks_per_node": 2}
            plot(ev4, RESULTS / "schedule_timeline_w4", "W=4 netns (tc-limited inter-node link), last step")
        except Exception as err:  # report exactly what blocked it
            result["w4_netns"] = {"error": f"{type(err).__name__}: {err}"[:3000]}
            print("W=4 netns failed:", err, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "schedule.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
