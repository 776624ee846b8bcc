"""Never slower (issue 29, item 8): one MoE block's forward+backward under `moepass.compile(block,
Plan(form="single"))` against the untouched block, per block kind, at W=1.

    python benchmarks/never_slower.py                        # CPU, the three sample styles (+ HF families: --hf)
    python benchmarks/never_slower.py --tiny --profile       # host overhead: tiny shapes, counts per step
    PYTHONPATH=. python3 benchmarks/never_slower.py --device cuda --dtypes float32,bfloat16 --sizes layer,tiny --profile

Sizes (`--sizes`, `--tiny` = `--sizes tiny`): "layer" is issue 29's layer case, 512 tokens (2 sequences x 256),
D=256, F=512, E=8, K=2; "tiny" is D=16, F=32, E=8, K=2, 8 tokens: no arithmetic worth timing, so its ratio is
the host overhead (dispatch, Python, host reads) of moepass's path against the block's own. Each block is built
with seed 0; x (seed 1, requires grad) and a fixed random probe of y's shape (seed 2) are shared by both sides;
loss = (y * probe).sum(). `--hf` adds every Hugging Face family whose tiny block moepass rewrites
(samples/hf_hub.py), its block built at the size's D/F/E/K where its config has those fields (the rest of
the model tiny).

Method: R rounds; in each, both sides run `--iters` timed forward+backward steps after warm-up, in an order
that alternates per round (original first on even rounds). A side's round figure is its median step; the
round's ratio is compiled/original. Reported per case: both medians, the median ratio over rounds and its
range, the machine load (os.getloadavg) and, on CUDA, the device and the host (enqueue) time per step.
CPU: one thread (torch.set_num_threads(1)). `--profile` adds counts per step that do not depend on the load
(`step_counts`): dispatcher ops (aten, custom), backward nodes, `aten::_local_scalar_dense` (host reads of a
tensor; on CUDA each waits for the device), CUDA synchronize calls, Python calls, minor page faults.
`--grads set_to_none` starts every step with no `.grad` (a training loop's `zero_grad()`), the default accumulates
into it (gradient accumulation).

What a user gets is the default: `Plan(form="single")` keeps, per input signature, the faster of the rewritten
graph and the user's own block, timed at the first call (`moepass.runtime.faster`); each row says which runs
(`runs`) and the first call's own ratio (`choice`). `--always-rewrite` times the rewritten graph whatever it
measured (`keep_original_if_slower=False`): the rewrite's own figure, what the work on it is judged by.

Goal: median ratio <= 1.0 for every case. Writes JSON to --out (default benchmarks/results/never_slower_<device>.json).
    python benchmarks/never_slower.py --hf --rounds 3 --launches 2 --isolate   # the families, one process each

The history of this benchmark's figures and of what was changed for them (the loop sample's memory
traffic, page faults, the host overhead per op, the Triton launch path): benchmarks/results/never_slower.md.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moepass  # noqa: E402
from moepass.runtime import faster  # noqa: E402
from samples.models import SampleConfig, make_moe  # noqa: E402


@dataclass(frozen=True)
class Size:
    tokens: int
    seqs: int
    D: int
    F: int
    E: int
    K: int
    iters: int  # default timed steps per side and round


SIZES = {
    "layer": Size(tokens=512, seqs=2, D=256, F=512, E=8, K=2, iters=10),  # issue 29's layer case
    "tiny": Size(tokens=8, seqs=2, D=16, F=32, E=8, K=2, iters=50),  # host overhead only: no GEMM worth timing
}


def sample_cases(size: Size) -> Iterator[tuple[str, Callable[[], nn.Module]]]:
    cfg = SampleConfig(dim=size.D, ffn_dim=size.F, num_experts=size.E, top_k=size.K)
    for style in ("loop", "fused", "gshard"):
        yield f"sample {style}", lambda style=style: make_moe(style, cfg)


def hf_cases(size: Size) -> Iterator[tuple[str, Callable[[], Case]]]:
    """Every HF family moepass detects a block of: its first MoE block that is a module of its own, taken from
    the family's tiny model built with that block at `size`'s D/F/E/K (`hf_hub.Widths`; the rest stays tiny).
    A family whose config refuses those sizes is built with as few of them as it takes (`build_at`); a family
    whose every block is outlined from its host's forward (`moepass.detect.outline`: router and experts inline
    in the decoder layer) is timed as its whole tiny model on `size.tokens` token ids. A family whose experts
    sit in a sub-config of another family's (`covered_by`) is that family's row."""
    from samples import hf_hub

    widths = hf_hub.Widths(D=size.D, F=size.F, E=size.E, K=size.K)
    for family in hf_hub.moe_families():
        if family.covered_by is not None:
            continue

        def case(family=family) -> Case:
            model, batch, note = build_at(family, widths)
            report = moepass.detect(model, example_inputs=batch)
            if not report.blocks:
                raise LookupError("moepass detects no MoE block in this family's model")
            plain = [spec.path for spec in report.blocks if spec.path not in report.outlines]
            if plain:
                spec = next(spec for spec in report.blocks if spec.path == plain[0])
                return Case(model.get_submodule(plain[0]), note=note, width=spec.experts.hidden_dim)
            shape = (size.seqs, size.tokens // size.seqs)
            ids = torch.randint(3, hf_hub.VOCAB, shape, generator=torch.Generator().manual_seed(1))
            tokens = {key: ids for key in batch if key.endswith("input_ids")}  # no labels: the probe is the loss
            return Case(model, tokens, note=", ".join(filter(None, [note, "whole tiny model: its blocks are "
                                                                          "outlined from their decoder layers"])))
        yield f"hf {family.model_type}", case


def build_at(family, widths) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """`hf_hub.build(family, widths=widths)`; where the family's config refuses those sizes, the same with the
    fewest roles (one, then two, ...) left at their tiny values, and a note naming them and the refusal."""
    from samples import hf_hub

    try:
        return (*hf_hub.build(family, seed=0, widths=widths), "")
    except Exception as err:  # noqa: BLE001  (a config validator's refusal: try fewer of the sizes)
        refusal = f"{type(err).__name__}: {str(err).strip().splitlines()[-1].strip()}"[:160]
    roles = ("K", "E", "F", "D")
    for n in range(1, len(roles) + 1):
        for tiny in combinations(roles, n):
            try:
                model, batch = hf_hub.build(family, seed=0, widths=replace(widths, **dict.fromkeys(tiny)))
            except Exception:  # noqa: BLE001
                continue
            return model, batch, f"{'/'.join(tiny)} at the tiny config's value (its config refuses {refusal})"
    raise RuntimeError(f"no size builds: {refusal}")


@dataclass
class Case:
    """What one case times: `module` called on the shared x (a [seqs, tokens / seqs, D] leaf that requires
    grad) or, with `batch`, on `**batch` (a whole model on token ids); `note` says how it departs from the size."""
    module: nn.Module
    batch: dict[str, torch.Tensor] | None = None
    note: str = ""
    width: int | None = None  # x's last dim where the block is not `size.D` wide


def writes_input(block: nn.Module, x: torch.Tensor) -> bool:
    """Whether `block`'s forward writes into its input in place (autograd refuses that on a leaf)."""
    copy_ = x.detach().clone()
    before = copy_._version
    with torch.no_grad():
        block(copy_)
    return copy_._version != before


class FreshInput(nn.Module):
    """`block` on a fresh copy of its input: for a block that writes into its input in place (a router's
    jitter), which autograd refuses on the shared leaf x. Both sides of such a case are wrapped alike."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor):
        return self.block(x.clone())


def output(y) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):  # a whole model's output
        if isinstance(getattr(y, name, None), torch.Tensor):
            return getattr(y, name)
    return y[0] if isinstance(y, tuple) else y


def step(block: nn.Module, x: torch.Tensor, probe: torch.Tensor, set_to_none: bool = False) -> None:
    """One forward+backward; the parameters' gradients accumulate into `.grad` (gradient accumulation), or with
    `set_to_none` start from none (`zero_grad(set_to_none=True)` first: the default training step)."""
    if set_to_none:
        block.zero_grad(set_to_none=True)
    if not isinstance(x, dict):
        x.grad = None
    (output(call(block, x)) * probe).sum().backward()


def call(block: nn.Module, x: torch.Tensor | dict[str, torch.Tensor]):
    return block(**x) if isinstance(x, dict) else block(x)


def time_steps(block, x, probe, iters: int, device: torch.device, set_to_none: bool = False) -> float:
    """Median seconds of one forward+backward over `iters` steps."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step(block, x, probe, set_to_none)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            step(block, x, probe, set_to_none)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_seconds(block, x, probe, iters: int, device: torch.device, set_to_none: bool = False) -> float:
    """Median host seconds to issue one forward+backward (on CUDA: the device drained before each step, not
    waited for after it, so this is the enqueue time; on CPU it is the step)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(block, x, probe, set_to_none)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def step_counts(block, x, probe, steps: int, device: torch.device, set_to_none: bool = False) -> dict[str, float]:
    """Per forward+backward step, figures that do not depend on the machine's load:
    `ops` every dispatcher op (aten and custom), `aten_ops`, `custom_ops` (moe::, moe_lowered::, ...),
    `autograd_nodes` backward nodes run, `item` aten::_local_scalar_dense (a tensor read on the host:
    `.item()`, `int(t)`, a data-dependent branch; on CUDA each one waits for the device), `syncs` CUDA
    synchronize calls seen by the profiler (CUDA only), `python_calls` Python function calls (cProfile),
    `page_faults` minor page faults of the process (getrusage: fresh host memory touched)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step(block, x, probe, set_to_none)
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(block, x, probe, set_to_none)
    profiler.disable()
    stats = pstats.Stats(profiler)
    python_calls = stats.total_calls  # type: ignore[attr-defined]
    by_file: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    for (filename, _, function), (_, calls, *_) in stats.stats.items():  # type: ignore[attr-defined]
        by_file["/".join(Path(filename).parts[-2:])] += calls
        by_function[f"{Path(filename).name}:{function}"] += calls
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step(block, x, probe, set_to_none)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    aten = sum(n for name, n in names.items() if name.startswith("aten::"))
    custom = sum(n for name, n in names.items() if "::" in name and name.split("::")[0] in ("moe", "moe_lowered",
                                                                                              "moe_comm", "moe_sched"))
    counts = {
        "aten_ops": aten, "custom_ops": custom, "ops": aten + custom,
        "autograd_nodes": sum(n for name, n in names.items() if name.startswith("autograd::engine::evaluate_function")),
        "item": names["aten::_local_scalar_dense"], "syncs": sum(names[name] for name in SYNC_EVENTS),
        "python_calls": python_calls, "page_faults": faults,
    }
    per_step = {key: value / steps for key, value in counts.items()}
    # where the Python calls are (a file's last two path parts: which library's launch path, moepass's own)
    per_step["python_calls_by_file"] = {f: n / steps for f, n in by_file.most_common(8)}
    per_step["python_calls_by_function"] = {f: n / steps for f, n in by_function.most_common(12)}
    return per_step


def measure(name: str, make: Callable[[], nn.Module | Case], device: torch.device, dtype: torch.dtype, size: Size,
            rounds: int, iters: int, warmup: int, profile: bool, set_to_none: bool = False,
            always_rewrite: bool = False) -> dict:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = make()
        case = case if isinstance(case, Case) else Case(case)
        original = case.module.to(device=device, dtype=dtype)
        if case.batch is not None:
            x = {key: ids.to(device) for key, ids in case.batch.items()}
            example: Any = x
        else:
            width = case.width or size.D
            x = torch.randn(size.seqs, size.tokens // size.seqs, width, generator=torch.Generator().manual_seed(1))
            x = x.to(device, dtype).requires_grad_(True)
            example = (x,)
        plan = moepass.Plan(form="single", keep_original_if_slower=not always_rewrite)
        compiled = moepass.compile(copy.deepcopy(original), plan, example_inputs=example)
    info = getattr(compiled, "moepass_info", None)
    rewritten = list(info.rewritten) if info is not None else []
    if not rewritten:
        return {"case": name, "dtype": str(dtype).removeprefix("torch."), "skipped": "moepass rewrote no block"}
    dim = next(iter(info.rewritten.values())).spec.experts.hidden_dim
    if case.batch is None and writes_input(original, x):
        original, compiled = FreshInput(original), FreshInput(compiled)
        case.note = ", ".join(filter(None, [case.note, "the block writes into its input: both sides get a copy"]))
    with torch.no_grad():
        shape = output(call(original, x)).shape
        probe = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    for block in (original, compiled):
        for _ in range(warmup):
            step(block, x, probe, set_to_none)
    choices = [c for gm in info.rewritten.values() for c in faster.choices(gm).values()]
    per_round, host_rounds = [], []
    for r in range(rounds):
        order = [("original", original), ("moepass", compiled)]
        if r % 2:
            order.reverse()
        per_round.append({label: time_steps(block, x, probe, iters, device, set_to_none) for label, block in order})
        if device.type == "cuda":
            host_rounds.append({label: host_seconds(block, x, probe, iters, device, set_to_none) for label, block in order})
    ratios = [f["moepass"] / f["original"] for f in per_round]
    lowered = sorted({kernel for gm in info.rewritten.values() for h in gm.history
                      if h["pass"] == "lower" for kernel in (h.get("stats") or {}).get("lowered", [])})
    row = {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "size": asdict(size), "tokens": size.tokens,
        "dim": dim, **({"note": case.note} if case.note else {}),
        "original_ms": statistics.median(f["original"] for f in per_round) * 1e3,
        "moepass_ms": statistics.median(f["moepass"] for f in per_round) * 1e3,
        "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "rounds": [{k: v * 1e3 for k, v in f.items()} for f in per_round], "lowered": lowered,
        "load": os.getloadavg()[0],
        "runs": ("original" if all(c.original for c in choices) else "rewritten" if not any(c.original for c in choices)
                 else "both") if choices else "rewritten",
        **({"choice": str(choices[0])} if choices else {}),
    }
    if host_rounds:
        row["host_ms"] = {side: statistics.median(f[side] for f in host_rounds) * 1e3 for side in ("original", "moepass")}
    if profile:
        row["per_step"] = {label: step_counts(block, x, probe, 5, device, set_to_none)
                           for label, block in (("original", original), ("moepass", compiled))}
    return row


def print_row(row: dict) -> None:
    name = row["case"]
    if "ratio" not in row:
        print(f"{name:40s} {row['dtype']:9s} {row.get('skipped') or row.get('error')}", flush=True)
        return
    lo, hi = row["ratio_range"]
    print(f"{name:40s} {row['dtype']:9s} original {row['original_ms']:8.3f} ms  moepass {row['moepass_ms']:8.3f} ms  "
          f"ratio {row['ratio']:.3f} [{lo:.3f}, {hi:.3f}]  load {row['load']:.1f}", flush=True)
    if "choice" in row:
        print(f"{'':40s} runs the {row['choice']}", flush=True)
    if "note" in row:
        print(f"{'':40s} D={row['dim']}; {row['note']}", flush=True)
    if "host_ms" in row:
        print(f"{'':40s} host ms per step: original {row['host_ms']['original']:.3f}  moepass "
              f"{row['host_ms']['moepass']:.3f}", flush=True)
    for side, counts in row.get("per_step", {}).items():
        by_file = counts.get("python_calls_by_file", {})
        by_function = counts.get("python_calls_by_function", {})
        print(f"{'':40s} {side:8s} per step: " + "  ".join(f"{k} {v:g}" for k, v in counts.items()
                                                            if not k.startswith("python_calls_by"))
              + "\n" + f"{'':49s} Python calls by file: " + ", ".join(f"{f} {n:g}" for f, n in by_file.items())
              + "\n" + f"{'':49s} by function: " + ", ".join(f"{f} {n:g}" for f, n in by_function.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=None, help="timed steps per side and round (default: per size)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also every Hugging Face family moepass rewrites")
    parser.add_argument("--only", default="", help="substring of the case names to run")
    parser.add_argument("--sizes", default="layer", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--tiny", action="store_true", help="the tiny size only (--sizes tiny): host overhead")
    parser.add_argument("--profile", action="store_true",
                        help="also count ops, host reads/syncs and Python calls per step (torch.profiler, cProfile)")
    parser.add_argument("--grads", choices=["accumulate", "set_to_none"], default="accumulate",
                        help="the parameters' .grad between steps: accumulated (default), or set to None before each "
                             "step (zero_grad's default in a training loop)")
    parser.add_argument("--launches", type=int, default=1,
                        help="run every case in this many fresh processes, one after another; per case the median "
                             "and range of the launches' ratios (a process's memory layout moves a case's ratio by "
                             "up to ~7 %% here, the same way for all its rounds)")
    parser.add_argument("--isolate", action="store_true",
                        help="with --launches: every case in its own fresh process per launch, so no case runs in a "
                             "process that built and ran the cases before it (with --hf, 60+ other blocks)")
    parser.add_argument("--case", default="", help="the one case (its full name, e.g. 'layer hf olmoe') to run")
    parser.add_argument("--always-rewrite", action="store_true",
                        help="time the rewritten graph always (Plan(keep_original_if_slower=False)), not the faster of it "
                             "and the original that compile keeps by default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    sizes = ["tiny"] if args.tiny else args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
            "iters": args.iters, "grads": args.grads, "always_rewrite": args.always_rewrite, "sizes": {name: asdict(SIZES[name]) for name in sizes}}
    suffix = ("" if args.grads == "accumulate" else "_set_to_none") + ("_rewritten" if args.always_rewrite else "")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"never_slower_{device.type}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.launches > 1 or args.isolate:
        names = [name for name, _, _ in selected_cases(sizes, args)] if args.isolate else None
        return run_launches(sys.argv[1:] if argv is None else argv, args.launches, meta, out, names)
    rows: list[dict] = []
    for name, make, size in selected_cases(sizes, args):
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            try:
                row = measure(name, make, device, dtype, size, args.rounds, args.iters or size.iters, args.warmup,
                              args.profile, args.grads == "set_to_none", args.always_rewrite)
            except Exception as err:  # one case's failure is its row, the others still run
                row = {"case": name, "dtype": str(dtype).removeprefix("torch."),
                       "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
            rows.append(row)
            print_row(row)
            # written after every row: a run stopped at a time limit (a device lease) keeps what it measured
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print_worst(rows, out)
    return 0


def selected_cases(sizes: list[str], args: argparse.Namespace,
                   ) -> Iterator[tuple[str, Callable[[], nn.Module | Case], Size]]:
    """The cases the arguments select, by full name ("<size> <case>"): `--case` exactly, `--only` as a substring."""
    for size_name in sizes:
        size = SIZES[size_name]
        for name, make in [*sample_cases(size), *(hf_cases(size) if args.hf else [])]:
            name = f"{size_name} {name}"
            if (args.case and name != args.case) or (args.only and args.only not in name):
                continue
            yield name, make, size


def print_worst(rows: list[dict], out: Path) -> None:
    measured = [r for r in rows if "ratio" in r]
    worst = max(measured, key=lambda r: r["ratio"]) if measured else None
    print(f"{len(measured)} cases measured; worst ratio {worst['ratio']:.3f} ({worst['case']}, {worst['dtype']})"
          if worst else "no case measured", f"-> {out}")


def merge_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per case from the rows of several launches: the median and range of the launches' ratios (each a
    median over its rounds), the median times, and every launch's ratio, times and load."""
    merged: dict[tuple[str, str], list[dict]] = {}
    for rows in launches:
        for row in rows:
            merged.setdefault((row["case"], row["dtype"]), []).append(row)
    out = []
    for runs in merged.values():
        measured = [r for r in runs if "ratio" in r]
        if not measured:
            out.append(runs[0])
            continue
        ratios = [r["ratio"] for r in measured]
        row = {k: v for k, v in measured[0].items() if k not in ("rounds", "per_step", "host_ms")}
        row.update(ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                   original_ms=statistics.median(r["original_ms"] for r in measured),
                   moepass_ms=statistics.median(r["moepass_ms"] for r in measured),
                   load=statistics.median(r["load"] for r in measured),
                   launches=[{k: r[k] for k in ("ratio", "ratio_range", "original_ms", "moepass_ms", "load", "runs",
                                                "choice") if k in r} for r in measured])
        out.append(row)
    return out


def run_launches(argv: list[str], launches: int, meta: dict, out: Path, isolated: list[str] | None = None) -> int:
    """`main(argv)` in `launches` fresh processes, one after another, merged (`merge_launches`) into `out`; with
    `isolated` (case names), one fresh process per case and launch instead, every case once per launch."""
    base, skip = [], False  # argv without --launches, --isolate and --out (each process writes its own file)
    for a in argv:
        if not skip and not a.startswith(("--launches", "--out", "--isolate")):
            base.append(a)
        skip = a in ("--launches", "--out")
    per_launch = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(launches):
            print(f"launch {i + 1}/{launches}", flush=True)
            rows = []
            for j, case in enumerate(isolated if isolated is not None else [None]):
                part = Path(tmp) / f"launch{i}_{j}.json"
                select = [] if case is None else ["--case", case]
                subprocess.run([sys.executable, __file__, *base, *select, "--out", str(part)], check=True)
                rows += json.loads(part.read_text())["rows"]
            per_launch.append(rows)
    rows = merge_launches(per_launch)
    meta = {**meta, "launches": launches, "isolated": isolated is not None}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"over {launches} launches (median [range] of their ratios):")
    for row in rows:
        print_row(row)
    print_worst(rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
