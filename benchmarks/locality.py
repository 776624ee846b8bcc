"""Locality-aware routing (LocMoE) vs a switch router: inter-node bytes per step, step time and loss curves,
W=2 ranks as two simulated nodes in two network namespaces joined by a tc-limited veth (issue 16).

    python benchmarks/locality.py                 # full run (root: network namespaces), a few minutes here
    python benchmarks/locality.py --quick         # smoke run (< 1 min); JSON and plot to the temp dir unless --out
    python benchmarks/locality.py --steps 600 --mu 0.05
    python benchmarks/locality.py --no-netns      # loopback, for debugging only (the JSON says so)

Writes benchmarks/results/locality.json and benchmarks/results/locality.png (loss curves, inter-node bytes
per step) and prints a table. Goals: the locality router's inter-node bytes per step <= 0.6x the switch
router's, its final held-out loss within 2 % of the switch router's.

The model (identical initial weights for both systems): `samples.models.tiny_mixtral(style="loop", **MODEL)`,
a byte-level LM whose MoE blocks have a softmax router and E=8 SwiGLU experts; each block is compiled into
`Plan(form="locality", gate="learned", ...)`: top-1 routing (the block's own gate: ReLU -> softmax -> argmax,
combine weight = the chosen probability), the experts placed EP-style over the two ranks (4 per rank = per
node: `Topology(2, 1)`), the capacity max(ceil(floor), ceil(T*c_f/E)) from the measured delta (LocMoE's
Theorem 1), and the auxiliary losses in the graph, handed back by `moepass.aux_loss(model)`:
  switch    mu = 0: the switch router (top-1, load-balancing loss alpha*E*sum f_i*P_i, the same capacity rule)
  locality  mu > 0 (`--mu`): + mu*KL(D_current || D_local), which pulls each rank's tokens toward the experts
            of its own node
So the two systems differ in exactly one term of the loss (the same form, the same router, the same
capacity rule): what the locality loss buys and costs, nothing else.

Data: text files shipped with this Python's standard library (bytes as the vocabulary; the last 10 % of each
file held out), two domains: prose (`DOMAINS["prose"]`: the documentation topics, IDLE's news and readme, the
licence) and code (`DOMAINS["code"]`: the Python modules `benchmarks/hp_quality.py` trains on). Two data
modes, each a launch of its own (`--data`):
  domain  node r trains on domain r (node 0 prose, node 1 code): the data of a node differs from the other's,
          as when data shards are placed by source. This is where locality can pay: the router is replicated
          and sees only the token, so it can send a node's tokens to its own experts only if the tokens say
          which node they are on.
  iid     every rank draws from both domains alike. With a replicated router whose gradients are averaged,
          each rank's pull toward its own node's experts is cancelled by the other's: the locality loss
          cannot move traffic off the link (measured and reported, not a goal).

Training, the same for both systems (one process per rank runs both, step by step interleaved: switch step
s, locality step s, on the same per-rank batch): `batch` windows of seq+1 bytes per rank per step drawn once
from a seeded generator, loss = next-byte cross-entropy +
`moepass.aux_loss(model)`, the replicated (non-expert) gradients averaged over the ranks
(`moepass.runtime.grads.all_reduce_replicated_grads`, over the same link), AdamW (lr `--lr`, betas (0.9,
0.95)), 1 torch thread per rank. Every step starts after a barrier; its time is the max over the ranks.

Recorded per step and system: the cross-entropy (mean over ranks; the auxiliary losses are reported apart),
the bytes every moepass collective sent to the other node (`moepass.comm_stats()`, reset before the step:
dispatch, combine, the count exchange and their backward; inter = to the other node), the step time. At the
end: the held-out cross-entropy (eval mode, fixed evenly spaced windows, mean over ranks), the fraction of
assignments routed to the rank's own node, the capacity / floor / delta the blocks recorded.
Ratios: inter-node bytes per step, locality / switch, over the second half of the run (medians); final
held-out loss, locality / switch.

Capacity: none (dropless, `--capacity-factor none`, the default here): with c_f = 1.25 both systems drop
assignments at capacity, in different shares (400 steps, mu 0.3, data domain: the switch router keeps 43 % of
its assignments, the locality router 70 %; data iid: 53 % and 28 %), and bytes not sent because they were
dropped would count as locality. The capacity rule and its floor are tested in tests/test_locality.py.

mu: 0.1 (`--mu`). A shorter sweep on the loopback (150 steps, data "domain", `--no-netns --steps 150 --mu M`):
mu 0.1 -> inter-node bytes 0.54x the switch router's, held-out loss 1.008x; mu 1.0 -> 0.48x, 1.034x: the
locality loss trades loss for locality, and 0.1 is the largest of the two that keeps the loss within 2 %.

Link: `benchmarks/netns.py`, layout "one_node": rank 0 and rank 1 each in its own namespace (two nodes of
one rank: nothing measures CPU contention between ranks of one node), joined by one veth pair with `tc tbf`
(`--rate`) on both ends; settings in the JSON.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "locality.json"
W = 2
PREFIX = "mpl"  # namespaces mpl-r0, mpl-r1
RATE = "1gbit"
LINK = dict(burst="64kb", latency="100ms", mtu=1500)
GOALS = {"inter_bytes_ratio_max": 0.6, "loss_ratio_max": 1.02}
DOMAINS = {
    "prose": ("pydoc_data/topics.py", "idlelib/NEWS.txt", "idlelib/NEWS2x.txt", "idlelib/README.txt", "LICENSE.txt"),
    "code": ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "inspect.py", "typing.py", "enum.py",
             "pathlib.py", "collections/__init__.py", "subprocess.py", "difflib.py", "statistics.py", "shutil.py",
             "logging/__init__.py", "unittest/case.py", "email/message.py"),
}
NODE_DOMAIN = ("prose", "code")  # data mode "domain": node r trains on NODE_DOMAIN[r]
HELDOUT_FRACTION = 0.1
SIZES = {  # full run / --quick
    "full": dict(model=dict(style="loop", vocab_size=256, dim=128, ffn_dim=256, num_experts=8, top_k=1, layers=2,
                            heads=4), batch=8, seq=128, steps=400, eval_windows=64),
    "quick": dict(model=dict(style="loop", vocab_size=256, dim=64, ffn_dim=128, num_experts=8, top_k=1, layers=1,
                             heads=4), batch=4, seq=64, steps=12, eval_windows=8),
}
TOKEN_KINDS = ("counts", "dispatch", "combine")  # moepass.comm_stats kinds of the token exchange (and "_bwd")
# what the benchmark measures, in its results file
WHAT = ("LocMoE (locality loss mu > 0) vs the switch router (mu = 0), the same Plan(form='locality') "
        "otherwise: inter-node bytes per step, step time, loss curves; W=2 gloo ranks x 1 thread, one rank "
        "per network namespace (two nodes) on a tc-limited veth; data per node by domain and iid")


def load_domain(files: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, held-out bytes, description) of a list of standard-library files: each file's last
    HELDOUT_FRACTION held out."""
    corpus = common.stdlib_corpus(files, HELDOUT_FRACTION)
    return corpus.train_N, corpus.heldout_M, {"files": list(files), "sha256": corpus.sha256,
                                              "train_bytes": corpus.train_N.numel(),
                                              "heldout_bytes": corpus.heldout_M.numel()}


def windows_of(data_N: torch.Tensor, count: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    offsets = torch.randint(0, data_N.numel() - seq - 1, (count,), generator=generator)
    return data_N[offsets[:, None] + torch.arange(seq + 1)]


def rank_data(mode: str, rank: int, sizes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, batch, seq+1] training windows and [eval_windows, seq+1] held-out windows of this rank: from its
    node's domain ("domain"), or from both domains alike ("iid"); seeded by (mode, rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    steps, batch, seq, n_eval = sizes["steps"], sizes["batch"], sizes["seq"], sizes["eval_windows"]
    if mode == "domain":
        train_N, heldout_M, _ = load_domain(DOMAINS[NODE_DOMAIN[rank]])
        return (windows_of(train_N, steps * batch, seq, g).view(steps, batch, seq + 1),
                windows_of(heldout_M, n_eval, seq, g))
    parts = [load_domain(DOMAINS[d]) for d in NODE_DOMAIN]  # half of every batch from each domain
    train = torch.stack([windows_of(t, steps * batch // 2, seq, g) for t, _, _ in parts], 1)
    heldout = torch.cat([windows_of(h, n_eval // 2, seq, g) for _, h, _ in parts])
    return train.reshape(steps, batch, seq + 1), heldout


def systems(mu: float, alpha: float, capacity_factor: float | None) -> dict[str, dict]:
    shared = dict(form="locality", gate="learned", alpha=alpha, capacity_factor=capacity_factor)
    return {"switch": {**shared, "mu": 0.0}, "locality": {**shared, "mu": mu}}


# ----------------------------------------------------------------------------------------------
# Worker: one rank (started in its namespace by benchmarks/netns.py)
# ----------------------------------------------------------------------------------------------


class System:
    """One compiled model and its optimizer; `step(tokens)` is one training step."""

    def __init__(self, name: str, plan_kw: dict, sizes: dict, lr: float):
        import torch

        import moepass
        from samples.models import tiny_mixtral

        self.name = name
        torch.manual_seed(0)  # the same initial weights for both systems, on every rank
        model = tiny_mixtral(**sizes["model"])
        self.model = moepass.compile(model, moepass.Plan(topology=moepass.Topology(W, 1), **plan_kw))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def step(self, tokens_BS1):
        import torch.nn.functional as F

        import moepass
        from moepass.runtime.grads import all_reduce_replicated_grads

        self.opt.zero_grad(set_to_none=True)
        logits = self.model(tokens_BS1[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens_BS1[:, 1:].reshape(-1))
        aux = moepass.aux_loss(self.model)
        (ce + aux).backward()
        all_reduce_replicated_grads(self.model)
        self.opt.step()
        return ce.detach(), aux.detach()

    def heldout(self, windows) -> float:
        import torch
        import torch.nn.functional as F

        self.model.eval()
        with torch.no_grad():
            logits = self.model(windows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        self.model.train()
        return float(ce)


def worker(cfg: dict) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import moepass

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    sizes = {**cfg["sizes"], "layers_tokens": cfg["sizes"]["model"]["layers"]}  # dispatch counts every layer
    mine, windows = rank_data(cfg["data"], rank, sizes)
    runs = {name: System(name, kw, sizes, cfg["lr"]) for name, kw in cfg["systems"].items()}
    records: dict[str, list[dict]] = {name: [] for name in runs}
    for step in range(sizes["steps"]):
        for name, system in runs.items():
            moepass.reset_comm_stats()
            dist.barrier()
            t0 = time.perf_counter()
            ce, aux = system.step(mine[step])
            seconds = time.perf_counter() - t0
            stats = moepass.comm_stats()
            token = [v for k, v in stats.items() if k.split("_bwd")[0] in TOKEN_KINDS]
            sent = stats.get("dispatch", {})  # rows kept by the capacity rule leave the permute, dropped ones do not
            rows = (sent.get("intra", 0) + sent.get("inter", 0) + sent.get("self", 0)) / (4 * sizes["model"]["dim"])
            row = torch.tensor([seconds, float(ce), float(aux), sum(v["inter"] for v in token),
                                sum(v["intra"] + v["self"] for v in token),
                                rows / (sizes["layers_tokens"] * mine[step].shape[0] * (mine[step].shape[1] - 1))],
                               dtype=torch.float64)
            every = [torch.empty_like(row) for _ in range(W)]
            dist.all_gather(every, row)
            table = torch.stack(every)
            records[name].append({"step": step, "step_s": float(table[:, 0].max()), "ce": float(table[:, 1].mean()),
                                  "aux": float(table[:, 2].mean()), "inter_bytes": table[:, 3].tolist(),
                                  "local_bytes": table[:, 4].tolist(), "kept_fraction": table[:, 5].tolist()})
        if rank == 0 and (step % max(1, sizes["steps"] // 10) == 0 or step == sizes["steps"] - 1):
            print("  step " + str(step) + "  " + "  ".join(
                f"{n}: ce {r[-1]['ce']:.3f} inter {sum(r[-1]['inter_bytes']) / 2**10:.0f} KiB {r[-1]['step_s'] * 1e3:.0f} ms"
                for n, r in records.items()), file=sys.stderr, flush=True)
    final = {}
    for name, system in runs.items():
        loss = torch.tensor([system.heldout(windows)], dtype=torch.float64)
        dist.all_reduce(loss)
        final[name] = {"heldout_ce": float(loss) / W, "blocks": block_report(system.model)}
    if rank == 0:
        Path(os.environ["NETNS_RESULT"]).write_text(json.dumps({"records": records, "final": final}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def block_report(model) -> dict:
    """What each locality block recorded about its last step (delta, floor, capacity, own-node share)."""
    out = {}
    for path, module in model.named_modules():
        state = getattr(module, "locality_state", None)
        if callable(state):
            out[path] = state()
    return out


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(records: dict, final: dict) -> dict:
    out = {}
    for name, rows in records.items():
        half = rows[len(rows) // 2:]
        inter = [sum(r["inter_bytes"]) / W for r in half]  # per rank per step
        local = [sum(r["local_bytes"]) / W for r in half]
        kept = [sum(r["kept_fraction"]) / W for r in half]
        out[name] = {"inter_bytes_per_rank_per_step": median_range(inter),
                     "kept_fraction_of_assignments": median_range(kept),
                     "local_bytes_per_rank_per_step": median_range(local),
                     "step_ms": median_range([1e3 * r["step_s"] for r in half]),
                     "final_train_ce_last_10pct": statistics.mean(r["ce"] for r in rows[-max(1, len(rows) // 10):]),
                     "heldout_ce": final[name]["heldout_ce"], "blocks_rank0": final[name]["blocks"]}
    return out


def plot(doc: dict, path: Path) -> None:
    """One row per data mode: train cross-entropy of both systems, and their inter-node bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(doc["by_data"])
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.6 * len(modes)), squeeze=False)
    for (ax_loss, ax_bytes), mode in zip(axes, modes):
        entry = doc["by_data"][mode]
        for name, rows in entry["records"].items():
            steps = [r["step"] for r in rows]
            ax_loss.plot(steps, [r["ce"] for r in rows], linewidth=0.8,
                         label=f"{name} (held-out {entry['per_system'][name]['heldout_ce']:.3f})")
            ax_bytes.plot(steps, [sum(r["inter_bytes"]) / W / 2**10 for r in rows], label=name, linewidth=0.8)
        ax_loss.set_title(f"data {mode}: train cross-entropy; held-out ratio {entry['heldout_loss_ratio']:.3f}",
                          fontsize=9)
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("nats / byte")
        ax_loss.legend(fontsize=8)
        ax_bytes.set_title(f"data {mode}: inter-node KiB per rank per step; locality / switch = "
                           f"{entry['inter_bytes_ratio']:.2f} (goal <= 0.6)", fontsize=9)
        ax_bytes.set_xlabel("step")
        ax_bytes.legend(fontsize=8)
    fig.suptitle(f"LocMoE vs switch router, W=2 as 2 nodes, {doc['link'].get('rate') or 'loopback'} link", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def orchestrate(args, argv: list[str]) -> int:
    from benchmarks.netns import Link, Loopback, Namespaces

    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.steps:
        sizes["steps"] = args.steps
    plans = systems(args.mu, args.alpha, args.capacity_factor)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "locality.json" if args.quick else OUT)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    links = Loopback(W) if args.no_netns else Namespaces(W, "one_node", Link(rate=args.rate, **LINK), prefix=PREFIX)
    by_mode, loads = {}, {}
    with links as ns:
        link = ns.settings()
        probe = None if args.no_netns else ns.probe()
        for mode in args.data:
            cfg = {"sizes": sizes, "lr": args.lr, "systems": plans, "data": mode}
            print(f"== data {mode} ==", flush=True)
            loads[mode] = {"start": os.getloadavg()[0]}
            runs = ns.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)], env=env,
                          timeout=args.timeout)
            loads[mode]["end"] = os.getloadavg()[0]
            result = runs[0].result
            per_system = summarise(result["records"], result["final"])
            sw, loc = per_system["switch"], per_system["locality"]
            inter = [s["inter_bytes_per_rank_per_step"]["median"] for s in (loc, sw)]
            by_mode[mode] = {"per_system": per_system, "records": result["records"],
                             "inter_bytes_ratio": inter[0] / inter[1] if inter[1] else float("nan"),
                             "heldout_loss_ratio": loc["heldout_ce"] / sw["heldout_ce"],
                             "step_time_ratio": loc["step_ms"]["median"] / sw["step_ms"]["median"]}
    headline = by_mode.get("domain") or next(iter(by_mode.values()))
    doc = {
        **common.results_header("locality", WHAT, argv, started),
        "wall_s": time.perf_counter() - t0, "quick": args.quick, "netns": not args.no_netns,
        "valid_measurement": not args.no_netns and not args.quick,
        "link": link, "probe_bytes_per_s": probe,
        "load1": {"start": load_start[0], "end": os.getloadavg()[0], "per_mode": loads},
        "sizes": sizes, "systems": plans, "lr": args.lr, "world": W, "topology": "Topology(2, 1)",
        "domains": {name: load_domain(files)[2] for name, files in DOMAINS.items()}, "node_domain": NODE_DOMAIN,
        "goals": {"measured_on": "domain" if "domain" in by_mode else next(iter(by_mode)),
                  "inter_bytes_ratio": headline["inter_bytes_ratio"],
                  "inter_bytes_ratio_le_0.6": headline["inter_bytes_ratio"] <= GOALS["inter_bytes_ratio_max"],
                  "heldout_loss_ratio": headline["heldout_loss_ratio"],
                  "heldout_loss_within_2pct": headline["heldout_loss_ratio"] <= GOALS["loss_ratio_max"]},
        "by_data": by_mode,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    for mode, entry in by_mode.items():
        print(f"\ndata {mode}: {'system':9s} {'inter KiB/rank/step':>20s} {'local KiB':>10s} {'step ms':>16s} "
              f"{'held-out ce':>11s}")
        for name, s in entry["per_system"].items():
            i, loc_b, st = s["inter_bytes_per_rank_per_step"], s["local_bytes_per_rank_per_step"], s["step_ms"]
            print(f"{'':6s}{name:9s} {i['median'] / 2**10:20.1f} {loc_b['median'] / 2**10:10.1f} "
                  f"{st['median']:7.1f} [{st['min']:.0f},{st['max']:.0f}] {s['heldout_ce']:11.4f}")
        print("      kept fraction of assignments (capacity): " + ", ".join(
            f"{n} {s['kept_fraction_of_assignments']['median']:.3f}" for n, s in entry["per_system"].items()))
        print(f"      locality/switch: inter bytes {entry['inter_bytes_ratio']:.3f}, held-out loss "
              f"{entry['heldout_loss_ratio']:.4f}, step time {entry['step_time_ratio']:.3f}")
    print(f"goals: {doc['goals']}")
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 1 min): a small model, a few steps")
    parser.add_argument("--steps", type=int, default=None, help="training steps per system (default 400)")
    parser.add_argument("--mu", type=float, default=0.1, help="the locality loss coefficient of the locality system")
    parser.add_argument("--alpha", type=float, default=0.01, help="the load-balancing loss coefficient (both)")
    parser.add_argument("--capacity-factor", type=lambda v: None if v.lower() == "none" else float(v), default=None,
                        help="c_f of the capacity rule (both systems); 'none' (the default): dropless, so the bytes "
                             "compare routing alone (with c_f the two systems drop different shares: see the doc)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rate", default=RATE, help=f"tc tbf rate of the link (default {RATE})")
    parser.add_argument("--data", nargs="+", default=["domain", "iid"], choices=["domain", "iid"],
                        help="data modes, one launch each (module doc); the goals are read on the first of domain")
    parser.add_argument("--no-netns", action="store_true", help="loopback, for debugging only (the JSON says so)")
    common.add_netns_run_options(parser, OUT.relative_to(ROOT))
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())
