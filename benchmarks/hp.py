"""Head parallel (HP) vs expert parallel (EP): train-step time and bytes per rank at equal active
parameters, K = 2, 4, 8, W=2 ranks in two network namespaces joined by a tc-limited veth.

    python benchmarks/hp.py                      # full run (root: network namespaces), ~4 min here
    python benchmarks/hp.py --wait-load 1.5      # first wait for the shared cores to quieten down
    python benchmarks/hp.py --quick              # smoke run (< 1 min); JSON and plot to the temp dir unless --out
    python benchmarks/hp.py --rate 300mbit --rounds 5 --steps 4
    python benchmarks/hp.py --calibrate 100mbit 200mbit 400mbit   # EP/HP at K=2 only: the all-to-all share per rate
    python benchmarks/hp.py --no-netns           # loopback, for debugging only (the JSON says so)

Writes benchmarks/results/hp.json and benchmarks/results/hp.png (bytes and step time against K) and
prints a table. Goals: HP >= 1.3x faster than EP at K=8; HP's bytes per rank flat in K.

Models (one pair per K, built identically on both ranks):
  ep  `samples.models.tiny_mixtral(style="loop", **MODEL, num_experts=E, top_k=K, ffn_dim=F)`: a byte-level
      LM whose MoE blocks are Mixtral-style (softmax router, top-K, SwiGLU experts of width F), compiled
      with `Plan(form="ep", topology=Topology(1, 2))`: E/2 experts per rank, dropless all-to-all.
  hp  the same model compiled with `Plan(form="hp", topology=Topology(1, 2))`: each MoE block becomes a
      freshly initialised Multi-Head LatentMoE of equal active parameters (`moepass.rewrite.latent`: H = 4
      heads of h = D/H, E experts per head, top-K per head, expert width m from its rule), heads sharded
      over the ranks (2 per rank). Everything else (embedding, attention, norms, LM head) is identical.
Equal active parameters across K (fine-grained experts): K*F = KF is constant (F = KF/K) and E = 4K, so a
token activates the same K*3*D*F expert weights at every K and the total expert parameters E*3*D*F are
constant too (each expert is split into finer ones as K grows, the paper's comparison at equal active
parameters); within a K, HP's m is chosen so that its active parameters equal EP's (rounded down; both
counts are in the JSON).

One timed step = zero_grad + forward + loss + backward (DDP averages the replicated gradients, over the same
link) + Adam step, on a fixed per-rank batch (BATCH x SEQ tokens, 4 batches cycled). Every step starts after
a barrier; its time is the max over the ranks. Gloo, 1 thread per rank (2 ranks on the 2 cores).

Link: `benchmarks/netns.py`, layout "one_node": rank 0 and rank 1 each in their own namespace, joined by one
veth pair with `tc tbf` (rate `--rate`, burst, latency, MTU in the JSON) on both ends; `ns.probe()` measures
what a TCP stream gets through it, and at the start of each half every rank times all_to_all_single alone
(0.25, 1, 4 MiB to the peer: `a2a_probe`, with the fraction of the tbf rate it reaches: gloo's all-to-all gets
about half of it here, where two plain TCP streams, one each way, get ~95 %).

Rate: chosen so that EP's all-to-all is >= 25 % of its step at K=2 by both measures below, as the highest
rate of a sweep that still does (`--calibrate 500mbit 1gbit 2gbit 4gbit --rounds 2 --steps 3`, load ~1,
EP at K=2, in flight / limit cost: 500mbit 41 % / 48 %, 1gbit 30 % / 29 %, 2gbit 25 % / 19 %, 4gbit 20 % /
10 %): 1gbit. A lower rate makes every step more communication-bound and favours HP further.

Rounds: after `--warmup` untimed steps per model, each round runs every model for `--steps` timed steps,
interleaved EP, HP, EP, HP (K = 2, 4, 8; which of EP/HP goes first alternates by round), once with the link
limited and once with the limit lifted (`netns.request_rate`: the launcher changes tc between the two halves;
nothing else changes, same processes and models). Per system and K: the median and range (min, max) of the
round medians; the ratio EP/HP of the medians and the range of the per-round ratios.

EP's all-to-all share, two ways: (1) limit cost: 1 - (step without the limit) / (step with it), which also
contains the DDP all-reduce's slowdown; (2) in flight: the time during which at least one all-to-all of the
step (counts, dispatch, combine and their backward; `moepass.runtime.events`, issue to completion) was under
way, over the step time: EP waits for each all-to-all right after issuing it, so this is the time its step
spends on all-to-all.

Bytes per rank per step (limited half): `moepass.comm_stats()` (reset before each step), bytes sent to the
peer (intra + inter, not self) by every moepass collective: EP counts + dispatch + combine (+ backward), HP
hp_dispatch + hp_combine (+ backward); plus DDP's gradient all-reduce (its bucket bytes, seen through
`events.ddp_logging_hook`; a ring at W=2 sends each rank's buffer once).

DDP and HP's sharded buffers: `moepass.compile(..., Plan(form="hp"))` puts the DTensor buffer `selection_bias`
on DDP's ignore list itself (`moepass.rewrite.experts.finalize_model`; before that fix `DDP(cm)` failed in its
initial broadcast, "aten.cat.default got mixed torch.Tensor and DTensor"). `ddp_ignore_dtensor_buffers`, the
workaround this benchmark was first run with, is kept: it now re-adds names already there (the JSON lists them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "hp.json"
W = 2
FORMS = ("ep", "hp")
PREFIX = "mph"  # namespaces mph-r0, mph-r1
RATE = "1gbit"  # see "Rate" in the module doc
LINK = dict(burst="64kb", latency="100ms", mtu=1500)
SIZES = {  # full run / --quick
    "full": dict(model=dict(style="loop", vocab_size=256, dim=256, layers=2, heads=4), batch=4, seq=256, kf=1024,
                 experts_per_k=4, ks=[2, 4, 8]),
    "quick": dict(model=dict(style="loop", vocab_size=128, dim=128, layers=1, heads=4), batch=2, seq=64, kf=512,
                  experts_per_k=4, ks=[2, 4, 8]),
}
# what the benchmark measures, in its results file
WHAT = ("train-step time (zero_grad + forward + backward with DDP + Adam step) and bytes per rank per step, "
        "HP (Multi-Head LatentMoE, heads over ranks) vs EP (standard MoE, experts over ranks) at equal active "
        "parameters, W=2 gloo ranks x 1 thread, one rank per network namespace on a tc-limited veth")


def model_kwargs(sizes: dict, K: int) -> dict:
    """The standard model at top-K: F = KF/K, E = experts_per_k * K (see the module doc)."""
    if sizes["kf"] % K:
        raise ValueError(f"K={K} does not divide KF={sizes['kf']}: pick KF a multiple of every K")
    return {**sizes["model"], "top_k": K, "ffn_dim": sizes["kf"] // K, "num_experts": sizes["experts_per_k"] * K}


def shapes(sizes: dict) -> dict:
    """Per K: the standard block's E, F and the converted block's H, h, m, active parameters before/after."""
    import torch

    import moepass
    from moepass.rewrite.latent import latent_shape
    from samples.models import tiny_mixtral

    out = {}
    for K in sizes["ks"]:
        kw = model_kwargs(sizes, K)
        torch.manual_seed(0)
        spec = moepass.detect(tiny_mixtral(**kw)).blocks[0]
        s = latent_shape(spec, moepass.Plan(form="hp", topology=moepass.Topology(1, W)), world=W)
        out[K] = {"ep": {"experts": kw["num_experts"], "top_k": K, "ffn_dim": kw["ffn_dim"], "dim": kw["dim"]},
                  "hp": {"heads": s.heads, "head_dim": s.head_dim, "experts_per_head": s.experts, "top_k": s.top_k,
                         "ffn_dim": s.ffn_dim, "activation": s.activation},
                  "active_params_per_token_per_block": {"ep": s.active_before, "hp": s.active_after}}
    return out


# ----------------------------------------------------------------------------------------------
# Worker: one rank (started in its namespace by benchmarks/netns.py)
# ----------------------------------------------------------------------------------------------


def ddp_ignore_dtensor_buffers(cm) -> list[str]:
    """DDP ignores HP's DTensor selection-bias buffers (moepass does this itself now; see the module doc)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = [n for n, b in cm.named_buffers() if isinstance(b, DTensor)]
    if names:
        DDP._set_params_and_buffers_to_ignore_for_model(
            cm, [*getattr(cm, "_ddp_params_and_buffers_to_ignore", []), *names])
    return names


class System:
    """One model (form, K): compiled, in DDP, with its Adam; `step(tokens)` runs one training step."""

    def __init__(self, form: str, K: int, sizes: dict):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import moepass
        from moepass.runtime import events
        from samples.models import tiny_mixtral

        self.form, self.K = form, K
        torch.manual_seed(0)
        model = tiny_mixtral(**model_kwargs(sizes, K))
        torch.manual_seed(1)  # the converted blocks' fresh initialisation: the same on every rank
        self.cm = moepass.compile(model, moepass.Plan(form=form, topology=moepass.Topology(1, W)))
        self.ignored_buffers = ddp_ignore_dtensor_buffers(self.cm)
        self.ddp = DDP(self.cm)
        self.ddp.register_comm_hook(None, events.ddp_logging_hook)  # DDP's all-reduce, seen by the event log
        self.opt = torch.optim.Adam(self.cm.parameters(), lr=1e-3)

    def step(self, tokens_BS1):
        import torch.nn.functional as F

        self.opt.zero_grad(set_to_none=True)
        logits = self.ddp(tokens_BS1[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens_BS1[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        return loss.detach()


def in_flight(events, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] during which at least one all-to-all was under way (union of the intervals)."""
    spans = sorted((max(e.start, t0), min(e.end, t1)) for e in events if e.category == "all_to_all")
    total, end = 0.0, t0
    for a, b in spans:
        a = max(a, end)
        if b > a:
            total, end = total + b - a, b
    return total


def a2a_probe(mib: float, reps: int = 4) -> dict:
    """all_to_all_single with `mib` MiB to the peer (and to itself), alone: the median time (max over the
    ranks) and what it makes of the link, bytes to the peer per second."""
    import torch
    import torch.distributed as dist

    n = int(mib * 2**20) // 4
    x, y, times = torch.randn(W * n), torch.empty(W * n), []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    median = statistics.median(times)
    return {"mib_to_peer": mib, "times_s": times, "median_s": median, "bytes_per_s": n * 4 / median}


def worker(cfg: dict) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import moepass
    from benchmarks.netns import request_rate
    from moepass.runtime import events

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    sizes = cfg["sizes"]
    systems = {(K, form): System(form, K, sizes) for K in sizes["ks"] for form in FORMS}
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, sizes["model"]["vocab_size"], (sizes["batch"], sizes["seq"] + 1), generator=gen)
               for _ in range(4)]
    log = events.EventLog(rank).start()
    records, kinds, counter, loads = [], {}, 0, []

    def set_rate(rate):
        answer = request_rate(rate) if rank == 0 else None
        dist.barrier()
        return answer

    def timed(system: System, phase: str, rnd: int) -> None:
        nonlocal counter
        tokens = batches[counter % len(batches)]
        counter += 1
        moepass.reset_comm_stats()
        log.clear()
        dist.barrier()
        t0 = time.perf_counter()
        loss = system.step(tokens)
        t1 = time.perf_counter()
        stats = moepass.comm_stats()
        sent = {k: v["intra"] + v["inter"] for k, v in stats.items() if k != "total"}
        ddp_bytes = sum(e.nbytes for e in log.events if e.category == "all_reduce")
        mine = torch.tensor([t1 - t0, in_flight(log.events, t0, t1), sum(sent.values()), ddp_bytes, loss.item()],
                            dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(every, mine)
        every = torch.stack(every).tolist()  # [rank][step_s, a2a_s, token_bytes, ddp_bytes, loss]
        records.append({"K": system.K, "form": system.form, "phase": phase, "round": rnd,
                        "step_s": max(r[0] for r in every), "a2a_s": [r[1] for r in every],
                        "token_bytes": [int(r[2]) for r in every], "ddp_bytes": [int(r[3]) for r in every],
                        "loss": statistics.mean(r[4] for r in every)})
        kinds.setdefault(f"{system.form} K={system.K}", sent)

    answers = [set_rate(cfg["phases"][0][1])]
    probes = {}
    for system in systems.values():
        for _ in range(cfg["warmup"]):
            timed(system, "warmup", -1)
    for rnd in range(cfg["rounds"]):
        for phase, rate in cfg["phases"]:
            answers.append(set_rate(rate))
            if rnd == 0:  # the link as an all-to-all sees it, once per phase
                probes[phase] = [a2a_probe(mib) for mib in cfg["a2a_probe_mib"]]
            for K in sizes["ks"]:
                for form in FORMS if rnd % 2 == 0 else FORMS[::-1]:
                    for _ in range(cfg["steps"]):
                        timed(systems[K, form], phase, rnd)
            loads.append({"round": rnd, "phase": phase, "load1": os.getloadavg()[0]})  # our 2 ranks included
            print(f"[hp rank {rank}] round {rnd} {phase} done", file=sys.stderr, flush=True)
    log.stop()
    if rank == 0:
        Path(os.environ["NETNS_RESULT"]).write_text(json.dumps({
            "records": [r for r in records if r["phase"] != "warmup"], "bytes_by_kind_rank0": kinds,
            "rate_answers": answers, "a2a_probe": probes, "load1_during": loads, "ddp_ignored_buffers": {f"{f} K={K}": s.ignored_buffers
                                                             for (K, f), s in systems.items()}}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(records: list[dict], ks: list[int], phases: list[str]) -> dict:
    """Per K: per system and phase the round medians and their median/range; ratios; shares; bytes."""
    out: dict = {}
    for K in ks:
        per: dict = {}
        for form in FORMS:
            per[form] = {}
            for phase in phases:
                mine = [r for r in records if r["K"] == K and r["form"] == form and r["phase"] == phase]
                rounds = sorted({r["round"] for r in mine})
                medians = [statistics.median(r["step_s"] for r in mine if r["round"] == i) for i in rounds]
                step = summary(medians)
                a2a = statistics.median(max(r["a2a_s"]) for r in mine)
                per[form][phase] = {"step_s": {k: v for k, v in step.items() if k != "n"}, "rounds": step["n"],
                                    "round_medians_s": medians, "steps_s": [r["step_s"] for r in mine],
                                    "a2a_in_flight_s": a2a, "a2a_in_flight_share": a2a / step["median"],
                                    "loss": [mine[0]["loss"], mine[-1]["loss"]]}
            limited = [r for r in records if r["K"] == K and r["form"] == form and r["phase"] == phases[0]]
            token = [b for r in limited for b in r["token_bytes"]]
            ddp = [b for r in limited for b in r["ddp_bytes"]]
            per[form]["bytes_per_rank_per_step"] = {
                "token_exchange": summary(token), "ddp_gradient_allreduce": summary(ddp),
                "total_median": statistics.median(t + d for r in limited for t, d in zip(r["token_bytes"],
                                                                                          r["ddp_bytes"]))}
        lim = phases[0]
        ep_r, hp_r = per["ep"][lim]["round_medians_s"], per["hp"][lim]["round_medians_s"]
        ratios = [e / h for e, h in zip(ep_r, hp_r)]
        per["ratio_ep_over_hp"] = {"median_of_medians": per["ep"][lim]["step_s"]["median"]
                                   / per["hp"][lim]["step_s"]["median"],
                                   "per_round": ratios, "min": min(ratios), "max": max(ratios)}
        if "unlimited" in phases:
            for form in FORMS:
                free = per[form]["unlimited"]["step_s"]["median"]
                for phase in phases:
                    if phase != "unlimited":
                        per[form][phase]["limit_cost_share"] = 1 - free / per[form][phase]["step_s"]["median"]
                per[form]["limit_cost_share"] = per[form][lim]["limit_cost_share"]
            per["ratio_ep_over_hp_unlimited"] = (per["ep"]["unlimited"]["step_s"]["median"]
                                                 / per["hp"]["unlimited"]["step_s"]["median"])
        out[K] = per
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = doc["ks"]
    res = doc["per_k"]
    lim = doc["phases"][0][0]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"ep": "tab:red", "hp": "tab:blue"}
    for form in FORMS:
        token = [res[str(K)][form]["bytes_per_rank_per_step"]["token_exchange"]["median"] / 2**20 for K in ks]
        total = [res[str(K)][form]["bytes_per_rank_per_step"]["total_median"] / 2**20 for K in ks]
        ax_b.plot(ks, token, "o-", color=colors[form], label=f"{form.upper()} token exchange (moepass.comm_stats)")
        ax_b.plot(ks, total, "s:", color=colors[form], alpha=0.6, label=f"{form.upper()} + DDP gradient all-reduce")
        med = [res[str(K)][form][lim]["step_s"]["median"] * 1e3 for K in ks]
        lo = [m - res[str(K)][form][lim]["step_s"]["min"] * 1e3 for m, K in zip(med, ks)]
        hi = [res[str(K)][form][lim]["step_s"]["max"] * 1e3 - m for m, K in zip(med, ks)]
        ax_t.errorbar(ks, med, yerr=[lo, hi], fmt="o-", color=colors[form], capsize=4,
                      label=f"{form.upper()} ({doc['link'].get('rate') or 'loopback'})")
        if "unlimited" in [p for p, _ in doc["phases"]]:
            unl = [res[str(K)][form]["unlimited"]["step_s"]["median"] * 1e3 for K in ks]
            ax_t.plot(ks, unl, "x--", color=colors[form], alpha=0.5, label=f"{form.upper()} without the limit")
    for K in ks:
        r = res[str(K)]["ratio_ep_over_hp"]["median_of_medians"]
        top = res[str(K)]["ep"][lim]["step_s"]["max"] * 1e3
        ax_t.annotate(f"EP/HP {r:.2f}x", (K, top), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_b.set(xlabel="top-K (K*F constant)", ylabel="MiB per rank per step", xticks=ks,
             title="bytes each rank sends per step")
    ax_t.set(xlabel="top-K (K*F constant)", ylabel="train step (ms): median, range of rounds", xticks=ks,
             title="train-step time, W=2")
    ax_b.set_ylim(bottom=0)
    ax_t.set_ylim(0, max(res[str(K)][f][lim]["step_s"]["max"] for K in ks for f in FORMS) * 1e3 * 1.15)
    ax_b.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    where = "network namespaces" if doc["netns"] else "LOOPBACK (debugging only)"
    fig.suptitle(f"HP vs EP at equal active parameters — {where}, link {doc['link'].get('rate') or 'unlimited'}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def orchestrate(args, argv: list[str]) -> int:
    from benchmarks.netns import Link, Loopback, Namespaces

    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.calibrate:
        sizes["ks"] = [2]
        phases = [[f"rate {r}", r] for r in args.calibrate] + [["unlimited", None]]
    else:
        phases = [["limited", args.rate], ["unlimited", None]]
    cfg = {"sizes": sizes, "phases": phases, "a2a_probe_mib": [0.25, 1, 4] if not args.quick else [1], "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "hp.json" if args.quick or args.calibrate
                                           else OUT)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    waited = common.wait_for_load(args.wait_load, args.wait_max, poll_s=20) if args.wait_load else 0.0
    load = {"start": os.getloadavg()}
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if args.no_netns:
        links = Loopback(W)
    else:
        links = Namespaces(W, "one_node", Link(rate=phases[0][1], **LINK), prefix=PREFIX)
    with links as ns:
        link = ns.settings()
        probe = {}
        if not args.no_netns:
            probe["limited_bytes_per_s"] = ns.probe()
            ns.set_rate(None)
            probe["unlimited_bytes_per_s"] = ns.probe()
            ns.set_rate(phases[0][1])
        runs = ns.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)], env=env,
                      timeout=args.timeout)
    load["end"] = os.getloadavg()
    result = runs[0].result
    records = result["records"]
    doc = {
        **common.results_header("hp", WHAT, argv, started),
        "wall_s": time.perf_counter() - t0, "quick": args.quick, "netns": not args.no_netns,
        "valid_measurement": not args.no_netns and not args.quick,
        "link": link, "probe": probe, "a2a_probe": result["a2a_probe"], "phases": phases, "rate_answers": result["rate_answers"],
        "load1": {"start": load["start"][0], "end": load["end"][0], "waited_s": waited,
                  "during_after_each_half_incl_own_2_ranks": result["load1_during"],
                  "loadavg_start": load["start"], "loadavg_end": load["end"]},
        "rule": ("equal active parameters: K*F = KF constant (F = KF/K), E = experts_per_k*K (E*F constant too); HP's "
                 "expert width m = floor((K*3*D*F + D*E - 2*D*H*h - H*E*h) / (H*K*3*h)), H = 4, h = D/H "
                 "(moepass.rewrite.latent)"),
        "sizes": sizes, "ks": sizes["ks"], "world": W, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "batch_per_rank": [sizes["batch"], sizes["seq"]],
        "shapes": {str(K): v for K, v in shapes(sizes).items()},
        "bytes_by_kind_rank0": result["bytes_by_kind_rank0"],
        "ddp_ignored_buffers_workaround": result["ddp_ignored_buffers"],
        "per_k": {str(K): v for K, v in summarise(records, sizes["ks"], [p for p, _ in phases]).items()},
    }
    from benchmarks.netns import rate_bytes_per_s

    for phase, rate in phases:  # what gloo's all_to_all_single makes of the tbf rate
        for p in doc["a2a_probe"].get(phase, []):
            p["fraction_of_tbf_rate"] = p["bytes_per_s"] / rate_bytes_per_s(rate) if rate and not args.no_netns else None
    lim = phases[0][0]
    per_k = doc["per_k"]
    first, last = str(sizes["ks"][0]), str(sizes["ks"][-1])
    hp_bytes = [per_k[str(K)]["hp"]["bytes_per_rank_per_step"]["token_exchange"]["median"] for K in sizes["ks"]]
    doc["goals"] = {
        "hp_speedup_at_k8": per_k[last]["ratio_ep_over_hp"]["median_of_medians"] if last == "8" else None,
        "hp_speedup_at_k8_ge_1.3": (per_k[last]["ratio_ep_over_hp"]["median_of_medians"] >= 1.3) if last == "8" else None,
        "hp_token_bytes_max_over_min_across_k": max(hp_bytes) / min(hp_bytes),
        "hp_bytes_flat_in_k": max(hp_bytes) == min(hp_bytes),
        "ep_a2a_in_flight_share_at_k2": per_k[first]["ep"][lim]["a2a_in_flight_share"],
        "ep_limit_cost_share_at_k2": per_k[first]["ep"].get("limit_cost_share"),
        # both measures (module doc) must reach 25 %: in flight contains waits for the peer, limit cost DDP's slowdown
        "ep_a2a_share_at_k2_ge_0.25": min(per_k[first]["ep"][lim]["a2a_in_flight_share"],
                                          per_k[first]["ep"].get("limit_cost_share") or 0.0) >= 0.25,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    if not args.calibrate:
        plot(doc, out.with_suffix(".png"))
    print_table(doc)
    print(f"wrote {out}" + ("" if args.calibrate else f" and {out.with_suffix('.png')}"), flush=True)
    return 0


def print_table(doc: dict) -> None:
    phases = [p for p, _ in doc["phases"]]
    print(f"link {doc['link'].get('rate')}  probe {doc['probe']}  load1 {doc['load1']['start']:.2f} -> "
          f"{doc['load1']['end']:.2f}")
    for K, per in doc["per_k"].items():
        for phase in phases:
            cells = []
            for form in FORMS:
                s = per[form][phase]["step_s"]
                cells.append(f"{form} {s['median'] * 1e3:7.1f} ms [{s['min'] * 1e3:6.1f}, {s['max'] * 1e3:6.1f}] "
                             f"a2a {per[form][phase]['a2a_in_flight_share']:5.1%}")
            ratio = per["ep"][phase]["step_s"]["median"] / per["hp"][phase]["step_s"]["median"]
            print(f"K={K} {phase:>14s}: " + " | ".join(cells) + f" | EP/HP {ratio:.2f}")
        print("      bytes/rank/step: " + " | ".join(
            f"{form} token {per[form]['bytes_per_rank_per_step']['token_exchange']['median'] / 2**20:6.2f} MiB "
            f"+ ddp {per[form]['bytes_per_rank_per_step']['ddp_gradient_allreduce']['median'] / 2**20:5.2f} MiB"
            for form in FORMS) + "".join(f" | {form} limit cost {per[form]['limit_cost_share']:.1%}"
                                         for form in FORMS if "limit_cost_share" in per[form]))
    print("goals:", doc["goals"])


COUNTS = {"--rounds": (5, 1, "interleaved rounds"), "--steps": (4, 2, "timed steps per model per round"),
          "--warmup": (2, 1, "untimed steps per model first")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 1 min): small model, 1 round, 2 steps")
    parser.add_argument("--rate", default=RATE, help=f"tc tbf rate of the link (default {RATE})")
    common.add_counts(parser, COUNTS)
    parser.add_argument("--no-netns", action="store_true", help="loopback, for debugging only (the JSON says so)")
    parser.add_argument("--calibrate", nargs="+", metavar="RATE", help="K=2 only, one phase per rate (+ no limit): "
                        "EP's all-to-all share at each rate; JSON to the temp dir unless --out")
    parser.add_argument("--wait-load", type=float, default=0.0, help="first wait until the 1-min load is below this")
    parser.add_argument("--wait-max", type=float, default=1800.0, help="wait at most this many seconds for the load")
    common.add_netns_run_options(parser, OUT.relative_to(ROOT))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    common.resolve_counts(args, COUNTS)
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())
