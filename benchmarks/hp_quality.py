"""HP quality check (issue 15): a model converted by `Plan(form="hp")` trained side by side with its original.

    python benchmarks/hp_quality.py              # the full run (a few minutes per model on one thread)
    python benchmarks/hp_quality.py --steps 600  # longer
    python benchmarks/hp_quality.py --quick      # smoke run (< 1 min): tiny dims, few steps, JSON and plot
                                                 # to the temp dir unless --out

Writes benchmarks/results/hp_quality.json and benchmarks/results/hp_quality.png (train loss smoothed, held-out
points, one figure) and prints a table. The goal: the converted model's final held-out loss within 3 % of the
original's (ratio converted / original <= 1.03).

What is compared.
  original   `samples.models.tiny_mixtral(vocab_size=256, **MODEL)`: a byte-level LM whose MoE blocks are
             Mixtral-style (`LoopMoE`: softmax router, top-K, SwiGLU experts of width F, no auxiliary loss).
  converted  `moepass.compile(original, Plan(form="hp", **setting))`: every MoE block replaced by a freshly
             initialised Multi-Head LatentMoE of equal active parameters (`moepass.rewrite.latent`: H heads
             of width h, E experts per head, top-K per head, expert width m from the equal-active rule,
             aux-loss-free balancing) and compiled into its head-parallel graph. Everything else (embedding,
             attention, norms, LM head) is a copy of the original's initial weights.
  HP runs for real: the process joins a 1-rank gloo process group (init_process_group, world size 1, a free
  local port), so `Plan(form="hp")` converts and rewrites exactly as on W ranks and both head exchanges run
  (each rank's exchange is with itself); the routers, experts and selection biases are DTensors on the 1-rank
  mesh. Same math as W ranks, without the wall time of more processes on these 2 cores.

Same for both models: the corpus, the batches and their order (one seeded generator drawing the window offsets
once), the optimizer (AdamW, betas (0.9, 0.95), weight decay 0.1 on every parameter of 2 or more dimensions,
none on the norms; the selection bias is a buffer, not trained), the LR schedule (linear warm-up, then cosine to
10 %), gradient clipping (global norm 1.0, `moepass.clip_grad_norm_`, which takes plain tensors and DTensors),
the steps, the loss (`TinyMoELM.loss`, next-byte cross-entropy), the seed (`--seed`, default 0: the original's
initial weights and the data order; seed + 1 draws the fresh Multi-Head LatentMoE weights), 1 torch thread.
The only differences are the MoE blocks and their initialisation. On CPU with one thread a run is
bit-reproducible: two runs of the same command give identical loss curves.

Corpus: the bytes of a fixed list of text files shipped with this Python's standard library (`CORPUS_FILES`,
read from `sysconfig.get_paths()["stdlib"]`), vocabulary = the 256 byte values. Each file's last 10 % goes to
the held-out set, the rest to the training set; the JSON records the files, their sizes, the Python version and
the sha256 of the concatenated bytes (a different Python ships different files: compare the sha256).
Training batches: `batch` windows of seq+1 bytes at uniformly drawn offsets of the training bytes. Held-out
loss: the mean next-byte cross-entropy over `eval_windows` fixed, evenly spaced windows of the held-out bytes,
in eval mode (no selection-bias update), every `eval_every` steps and after the last step.

Recorded per model: the raw train loss of every step and its exponential moving average (0.95, bias-corrected),
the held-out losses, the parameter counts (total, and active per token = everything except the (E-K)/E of the
expert weights a token does not reach; embedding and LM head counted whole), and the wall time
per step (median; informational only: other jobs share these cores). For every converted setting: the
Multi-Head LatentMoE shape the rule chose, the block's active parameters before/after, and the ratio
final held-out loss converted / original.

Settings tried (`SETTINGS`): the default plan (H = 4 at W = 1, h = D / H) first, then the conversion rule's
documented knobs, `Plan.heads` and `Plan.head_dim`, each reported as measured; none is picked after the fact.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import moepass  # noqa: E402
from benchmarks.common import stdlib_corpus  # noqa: E402
from moepass.rewrite.latent import latent_shape  # noqa: E402
from samples.models import tiny_mixtral  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 1.03  # final held-out loss, converted / original

CORPUS_FILES = (  # relative to the standard library directory; bytes in this order
    "argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "inspect.py", "typing.py", "enum.py",
    "pathlib.py", "collections/__init__.py", "subprocess.py", "difflib.py", "statistics.py", "shutil.py",
    "logging/__init__.py", "unittest/case.py", "email/message.py", "LICENSE.txt",
)
HELDOUT_FRACTION = 0.1

# model (tiny_mixtral overrides) and training, full run / --quick
MODEL = {
    "full": dict(vocab_size=256, dim=128, ffn_dim=256, num_experts=8, top_k=2, layers=2, heads=4),
    "quick": dict(vocab_size=256, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=1, heads=2),
}
TRAIN = {
    "full": dict(steps=300, batch=16, seq=128, lr=3e-3, warmup=30, eval_every=25, eval_windows=256),
    "quick": dict(steps=30, batch=4, seq=64, lr=3e-3, warmup=3, eval_every=10, eval_windows=16),
}
# the conversion settings: name -> Plan overrides (form="hp" always); the first is the default plan
SETTINGS = {
    "full": {"default": {}, "heads=8": {"heads": 8}, "heads=2": {"heads": 2},
             "heads=4,head_dim=64": {"heads": 4, "head_dim": 64}},
    "quick": {"default": {}},
}
EMA = 0.95


# ----------------------------------------------------------------------------------------------
# Corpus and batches
# ----------------------------------------------------------------------------------------------


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes [N], held-out bytes [M], a description for the JSON): each file's last 10 % held out."""
    corpus = stdlib_corpus(CORPUS_FILES, HELDOUT_FRACTION)
    meta = {"source": f"Python {platform.python_version()} standard library ({corpus.stdlib})",
            "files": [{"file": name, "bytes": size} for name, size in corpus.file_bytes.items()],
            "sha256": corpus.sha256, "vocab": "bytes (256)", "train_bytes": corpus.train_N.numel(),
            "heldout_bytes": corpus.heldout_M.numel(), "heldout": f"the last {HELDOUT_FRACTION:.0%} of every file"}
    return corpus.train_N, corpus.heldout_M, meta


def train_batches(train_N: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """[steps, batch, seq+1]: the windows of every step, drawn once (both models read the same tensor)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, train_N.numel() - seq - 1, (steps, batch), generator=g)
    return train_N[offsets[..., None] + torch.arange(seq + 1)]


def heldout_windows(heldout_M: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """[count, seq+1]: fixed, evenly spaced windows of the held-out bytes."""
    starts = torch.linspace(0, heldout_M.numel() - seq - 1, count).long()
    return heldout_M[starts[:, None] + torch.arange(seq + 1)]


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_rank_group():
    """A 1-rank gloo process group on a free local port, so form="hp" runs its real graph at W=1."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parameter_counts(model: torch.nn.Module, specs) -> dict:
    """Total parameters, and active per token: all but the (E-K)/E of each block's expert weights."""
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for spec in specs:
        x, r = spec.experts, spec.router
        expert_params = x.num_experts * (3 if x.gated else 2) * x.hidden_dim * x.ffn_dim
        idle += expert_params * (r.num_experts - r.top_k) // r.num_experts
    return {"total": total, "active_per_token": total - idle}


def build_original(model_cfg: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_mixtral(**model_cfg)


def convert(original: torch.nn.Module, overrides: dict, seed: int) -> tuple[torch.nn.Module, dict]:
    """moepass.compile(copy of original, Plan(form="hp", **overrides)) and what the conversion chose."""
    plan = moepass.Plan(form="hp", **overrides)
    report = moepass.detect(original)
    shapes = [latent_shape(spec, plan, world=1) for spec in report.blocks]
    torch.manual_seed(seed + 1)  # the fresh Multi-Head LatentMoE weights
    converted = moepass.compile(copy.deepcopy(original), plan, report=report)
    s = shapes[0]
    info = {"plan": {"form": "hp", **overrides}, "blocks": len(shapes),
            "latent": {"heads": s.heads, "head_dim": s.head_dim, "experts_per_head": s.experts, "top_k": s.top_k,
                       "ffn_dim": s.ffn_dim, "activation": s.activation},
            "block_active_params": {"before": s.active_before, "after": s.active_after}, "summary": s.summary()}
    return converted, info


def specs_of(model: torch.nn.Module) -> list:
    info = getattr(model, "moepass_info", None)
    if info is not None:
        return [gm.spec for gm in info.rewritten.values()]
    return list(moepass.detect(model).blocks)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), foreach=False)


def lr_at(step: int, cfg: dict) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr/10 at the last step."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    progress = (step - cfg["warmup"]) / max(1, cfg["steps"] - 1 - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, chunk: int = 32) -> float:
    model.eval()
    total = sum(model.loss(windows[i:i + chunk]).item() * len(windows[i:i + chunk])
                for i in range(0, len(windows), chunk))
    model.train()
    return total / len(windows)


def train(model: torch.nn.Module, batches: torch.Tensor, windows: torch.Tensor, cfg: dict, label: str) -> dict:
    """`cfg["steps"]` AdamW steps on `batches`; train loss every step, held-out loss every eval_every steps."""
    model.train()
    opt = optimizer_for(model, cfg["lr"])
    raw, smooth, heldout, seconds = [], [], [], []
    ema = 0.0
    for step in range(cfg["steps"]):
        if step % cfg["eval_every"] == 0:
            heldout.append({"step": step, "loss": heldout_loss(model, windows)})
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batches[step])
        loss.backward()
        moepass.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        seconds.append(time.perf_counter() - start)
        raw.append(loss.item())
        ema = EMA * ema + (1 - EMA) * raw[-1]
        smooth.append(ema / (1 - EMA ** (step + 1)))
        if step % max(1, cfg["steps"] // 10) == 0 or step == cfg["steps"] - 1:
            print(f"  {label:>24} step {step:4d}  train {raw[-1]:.4f} (ema {smooth[-1]:.4f})  "
                  f"{seconds[-1] * 1e3:6.1f} ms", flush=True)
    heldout.append({"step": cfg["steps"], "loss": heldout_loss(model, windows)})
    print(f"  {label:>24} final held-out loss {heldout[-1]['loss']:.4f}", flush=True)
    return {"train_loss": raw, "train_loss_ema": smooth, "heldout_loss": heldout,
            "final_heldout_loss": heldout[-1]["loss"], "seconds_per_step_median": statistics.median(seconds)}


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """Two panels: the whole run, and its second half zoomed with the goal line (original's final x 1.03)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("original (Mixtral-style MoE)", result["original"])]
    for name, c in result["converted"].items():
        s = c["conversion"]["latent"]
        runs.append((f"hp {name} (H={s['heads']} h={s['head_dim']} m={s['ffn_dim']})", c))
    steps = result["train"]["steps"]
    target = result["original"]["final_heldout_loss"] * GOAL
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, first in zip(axes, (0, steps // 2)):
        for i, (label, run) in enumerate(runs):
            ema, held = run["train_loss_ema"], [h for h in run["heldout_loss"] if h["step"] >= first]
            ax.plot(range(first, steps), ema[first:], color=f"C{i}", lw=1.2,
                    label=f"{label}: held-out final {run['final_heldout_loss']:.3f}")
            ax.plot([h["step"] for h in held], [h["loss"] for h in held], "o--", color=f"C{i}", ms=4, lw=0.8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("next-byte cross-entropy (nats)")
    axes[0].set_title("whole run: lines train loss (EMA), circles held-out loss", fontsize=9)
    axes[1].axhline(target, color="k", lw=0.8, ls=":", label=f"goal: original's final held-out x {GOAL}")
    axes[1].set_title(f"second half, zoomed (goal: converted final held-out <= {target:.3f})", fontsize=9)
    lo = min(min(r["train_loss_ema"][steps // 2:] + [h["loss"] for h in r["heldout_loss"]]) for _, r in runs)
    hi = max(max(r["train_loss_ema"][steps // 2:]) for _, r in runs)
    axes[1].set_ylim(lo - 0.02, hi + 0.02)
    axes[0].set_ylim(lo - 0.1, max(r["train_loss_ema"][min(steps - 1, max(1, steps // 20))] for _, r in runs) + 0.2)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Plan(form='hp') conversion vs its original: {steps} steps, same data, order, optimizer and "
                 f"schedule (1-rank gloo, 1 thread)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 300, --quick 30)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny dims, few steps, default setting only")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (the PNG beside it); default results/hp_quality.json, --quick: temp dir")
    parser.add_argument("--seed", type=int, default=0, help="the one seed of initialisation and data order")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out's JSON")
    args = parser.parse_args(argv)
    if args.plot_only:
        path = args.out or RESULTS / "hp_quality.json"
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    mode = "quick" if args.quick else "full"
    cfg = dict(TRAIN[mode])
    if args.steps is not None:
        cfg["steps"] = args.steps
        cfg["warmup"] = min(cfg["warmup"], max(1, args.steps // 10))
    out = args.out or (Path(tempfile.gettempdir()) / "hp_quality.json" if args.quick else RESULTS / "hp_quality.json")
    torch.set_num_threads(1)

    train_N, heldout_M, corpus = load_corpus()
    batches = train_batches(train_N, cfg["steps"], cfg["batch"], cfg["seq"], args.seed)
    windows = heldout_windows(heldout_M, cfg["eval_windows"], cfg["seq"])
    print(f"corpus {corpus['train_bytes']:,} train / {corpus['heldout_bytes']:,} held-out bytes, "
          f"sha256 {corpus['sha256'][:16]}…; {cfg['steps']} steps of {cfg['batch']}x{cfg['seq']}", flush=True)

    original = build_original(MODEL[mode], args.seed)
    result: dict = {
        "what": "final held-out loss of Plan(form='hp')'s converted model vs the original, trained side by side",
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "mode": mode,
        "process_group": "gloo, 1 rank (HP at W=1: the real conversion and head-parallel graph)",
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "load_average_before": list(os.getloadavg()), "corpus": corpus,
        "model": MODEL[mode], "train": {**cfg, "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1 on >=2-D)",
                                        "schedule": "linear warm-up, cosine to lr/10", "grad_clip": 1.0,
                                        "seed": args.seed, "ema": EMA},
        "goal": f"final held-out loss ratio converted / original <= {GOAL}",
    }
    with one_rank_group():
        converted = {name: convert(original, overrides, args.seed) for name, overrides in SETTINGS[mode].items()}
        print("original:", parameter_counts(original, specs_of(original)), flush=True)
        run = train(original, batches, windows, cfg, "original")
        result["original"] = {"parameters": parameter_counts(original, specs_of(original)), **run}
        result["converted"] = {}
        for name, (model, info) in converted.items():
            print(f"converted {name}: {info['summary']}", flush=True)
            counts = parameter_counts(model, specs_of(model))
            run = train(model, batches, windows, cfg, f"hp {name}")
            ratio = run["final_heldout_loss"] / result["original"]["final_heldout_loss"]
            result["converted"][name] = {"conversion": info, "parameters": counts, **run, "ratio": ratio,
                                         "goal_met": ratio <= GOAL}
    result["load_average_after"] = list(os.getloadavg())
    default = result["converted"][next(iter(result["converted"]))]
    result["goal_met_by_default_plan"] = default["goal_met"]

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {out}; matplotlib is missing, so no plot")

    o = result["original"]
    print(f"\n{'model':<28}{'total':>10}{'active/tok':>12}{'held-out':>10}{'ratio':>8}{'ms/step':>9}")
    print(f"{'original':<28}{o['parameters']['total']:>10,}{o['parameters']['active_per_token']:>12,}"
          f"{o['final_heldout_loss']:>10.4f}{1:>8.3f}{o['seconds_per_step_median'] * 1e3:>9.1f}")
    for name, c in result["converted"].items():
        print(f"{'hp ' + name:<28}{c['parameters']['total']:>10,}{c['parameters']['active_per_token']:>12,}"
              f"{c['final_heldout_loss']:>10.4f}{c['ratio']:>8.3f}{c['seconds_per_step_median'] * 1e3:>9.1f}"
              f"  {'meets' if c['goal_met'] else 'misses'} the {GOAL} goal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
