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
into it (gradient accumulation). The loop sample, where the last >1.0 case came from (2026-11-27, this CPU, 1 thread):
  before: 1.039-1.043 accumulating, 0.997 [0.979, 1.043] with none. A symbol profile (`perf record -e cpu-clock`,
  500 steps, original vs moepass, ms per step) put the excess in memory traffic, not in the GEMMs (same 50 `mm`s,
  at MKL's peak on both sides): sgemm's C scaling +0.45 (writing the whole [E, F, D] gradients into cold
  memory), the accumulation of those 12 MiB into the per-expert `.grad`s after the whole backward (+0.6 against
  +0.33 for the original, which adds each expert's fresh gradient right away), the backward's two recomputed
  activation passes (+0.25). Fix (`moepass.ffn_autograd`): eagerly, ModuleList experts run expert by expert as
  autograd's own ops on each expert's tensors (the op's values bit for bit), so each gradient is accumulated as
  it is made, and autograd keeps act(h) and a; where that keeps more than the weight gradients it saves
  (`ffn_autograd.pays`: NLLB-MoE's 4096-row block) the op runs; and the per-expert engine sums a bias inside its
  GEMM (`addmm`, as nn.Linear does: no zero fill of a fresh product, no second pass). After (22:14-22:41 UTC, load
  1.0, `--launches 3`, median [range] of the launches' ratios): loop 0.998 [0.987, 1.019] accumulating, 0.998
  [0.981, 1.001] with none; fused 0.025, gshard 0.500. Hugging Face families (`--hf --rounds 3 --launches 3`):
  65 measured, all <= 1.0 except NLLB-MoE 1.015 [1.004, 1.025] and AFMoE 1.002 [1.000, 1.004]. NLLB-MoE's block
  (the HF code one-hots a 0/1 mask, so two "experts" of 3584 and 512 rows do 8 rows per token) depends on the
  process: alone, 5 launches, 0.969 [0.946, 1.026] (1.023 [1.004, 1.054] before `addmm`); with glibc's
  thresholds pinned (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, no fresh-page faults) 1.016-1.028 before
  `addmm`, the rest being its [T, 8, D] unpermute/combine gathers (`memmove` +1 % of the step). AFMoE (fused
  gate/up, all tokens on 2 experts) pays the op's two recomputed activation passes (~0.6 %).
Coverage and isolation (2026-11-28, this CPU, 1 thread, load 0.6-1.0). The sweep above timed 65 of the 66
  families tests/test_hf_hub.py holds exact under single, each in a process that had built and run every family
  before it. Now `--isolate` runs each case in a fresh process per launch; a family whose config refuses the size
  is built with the fewest roles left tiny (`build_at`: granitemoehybrid at D=32, zaya at K=1); one whose blocks
  are all outlined from their decoder layers is timed as its whole tiny model on 512 token ids (gemma4_text,
  diffusion_gemma_text); a block that writes into its input (Switch's router jitter) runs on a copy, both sides
  (`FreshInput`). Isolated, 2 launches, the code before this stop: 65 measured, all <= 1.0 (NLLB-MoE 0.993 [0.984,
  1.002], loop 0.958, AFMoE 0.819: 1.002 in the shared process, where its original page-faulted). Newly measured,
  Switch Transformers was 1.859: it keeps 8 tokens per expert and sequence (128 of 512) and moepass's graph ran
  all 512 through the experts, zeroing the dropped ones by weight; `moepass.rewrite.dropped` now routes them
  around the experts. After (`--hf --rounds 3 --launches 2 --isolate`, 01:00-01:29 UTC): 70 cases (3 samples, 67
  families, every exact one) measured, median 0.730; above 1.0: Switch 1.066 [1.039, 1.093] (5 launches: 1.050
  [1.033, 1.094]) and NLLB-MoE 1.004 [1.000, 1.009] (5 launches: 1.018 [0.993, 1.024]); loop 0.976, gemma4_text
  (whole model) 0.944, diffusion_gemma_text 0.923, granitemoehybrid 0.883. Switch's rest: its router module runs
  as it is (jitter, its own softmax and capacity), then the graph routes again from its logits (`moe.route`'s
  softmax and top-1, `capacity_keep`; torch's CPU softmax over E=8 takes 54 us for 512 tokens, 8 us over E=16) and
  the route's backward recomputes the softmax; the permute, unpermute and combine still run over all T*K rows.
  What would meet it: reading the router module's own dispatch (its capacity-masked one-hot and probabilities) as
  the selection, as detection reads NLLB-MoE's, so nothing is routed twice. NLLB-MoE: the same GEMMs on both sides
  (88 % of the step), the rest within 2 % either way from process to process (its [T, 8, D] unpermute/combine
  against the original's per-"expert" index_add).
Goal: median ratio <= 1.0 for every case. Writes JSON to --out (default benchmarks/results/never_slower_<device>.json).
    python benchmarks/never_slower.py --hf --rounds 3 --launches 2 --isolate   # the families, one process each

Profile (CPU, torch 2.13, 1 thread; tiny size, per forward+backward step, original | moepass before -> after;
issue 29/32 host-overhead work):
                  ops (aten+custom)      custom-op dispatches   aten::item   Python calls
    loop          1158 | 1299 -> 514     8 -> 0                 0 | 72 -> 0  344 | 1128 -> 926
    fused          304 | 1004 -> 496     8 -> 0                 0 | 48 -> 0   96 |  723 -> 538
    gshard         448 | 1017 -> 477     9 -> 0                 4 | 50 -> 0  116 |  761 -> 554
Where the host time went, and what was done:
  * Every dialect op called eagerly went through torch.library's custom-op machinery: the C++ dispatcher, the
    Python autograd kernel (`autograd_impl`), a redispatch, the `torch._dynamo.disable` wrapper around the
    implementation, `fill_defaults` and the output-aliasing check, and the same on the way back: ~30-60 us
    per op and direction (cProfile of 200 steps: 1600 `autograd_impl`/dynamo-disable calls). A rewritten block
    run eagerly now executes a second forward generated from its graph whose ops are `moepass.eager.EagerOp`s
    (the op's own function, and the same autograd.Function torch.library would build), bit-identical; traced
    or compiled, the graph's code with the ops runs (tests/test_eager.py). The Triton (`moe_lowered`) ops of
    the CUDA path take the same route.
  * The `aten::item` were not moepass's: CPU `torch._grouped_mm` reads each group offset with `.item()` and
    runs ~13 ops per expert. A GEMM of at most `grouped_ffn.PADDED_MACS` multiply-adds now runs as one `bmm`
    over rows padded to [E, N, ...] (no host read, a few ops whatever E); larger GEMMs keep `_grouped_mm`
    (one CUDA kernel, no sync). The capacity mask uses a scatter, not `F.one_hot` (which reads min/max).
  * The input check ran as a forward pre-hook (nn.Module's slow call path): it is now the forward's first call.
  * Issue 29 item 8, second pass (tiny size, load 8, per step, moepass): loop 1291 aten ops / 72 item / 971
    Python calls, ratio 1.03 [0.97, 1.15]; fused 1001 / 48 / 565, 2.09 [1.93, 2.69]; gshard 1001 / 48 / 582,
    1.81 [1.64, 2.93]. The `aten::item` are CPU `torch._grouped_mm`'s own (one `.item()` of host memory and
    ~13 ops per expert group; no device sync, and on CUDA `_grouped_mm` reads nothing). Tried: the per-expert
    `torch.mm(out=)` loop on a CPU (same bits, 759 ops, 0 item) was slower at this size (the Python loop:
    0.27 ms against 0.11 ms for the six GEMMs) and equal at the layer size: not kept. Kept: the gated
    activations write their gradients into the halves of the one [N, 2F] gate/up gradient (no `torch.cat`) and
    multiply in place: bit-identical, 1-2 fewer [N, F] buffers per call (what costs at the layer size, below).
  * The layer-size loop sample (1.2-1.3x) is not arithmetic: moepass runs the same 375 `mm` calls, and the
    excess is fresh-memory page faults (~1000-2000 per step against 0 for the original, each ~10-20 us on this
    VM). moepass writes each role's weight gradient as one [E, F, D] buffer (4 MiB here; the original writes
    per-expert [F, D] pieces): glibc's dynamic mmap threshold then returns those pages to the OS at every free
    and the next step faults them in again. Evidence: with MALLOC_MMAP_THRESHOLD_=1000000000
    MALLOC_TRIM_THRESHOLD_=4000000000 the faults go to 0 and the ratio to 0.94 (one run, load 4.5); one 16 MiB
    allocation freed at start-up (which raises the threshold) takes them from ~1040 to ~128 per step.
    Fixed in moepass (`grouped_ffn.reusable_grad_buffer`): a host-memory weight gradient of 1 MiB or more is
    written by the expert loop into a buffer kept per weight and handed out again only when its storage has no
    other holder (autograd added it into `.grad`, or `zero_grad(set_to_none=True)` dropped the `.grad` that
    took it), so no gradient anyone holds is overwritten. Page faults per step, layer loop sample, minor
    faults from getrusage, 10 steps: 3040 -> 304 accumulating into .grad, 880 -> 0 with
    zero_grad(set_to_none=True) between steps; fused 154 -> 51, 0 -> 0. On a GPU the caching allocator
    never returns the pages and the buffer is not used.
  * What remains is structural: moepass's graph runs route/permute/FFN/unpermute/combine and their backward
    in Python (~200 top-level ops per step against ~115 for the fused sample, whose backward is all C++
    autograd); at the layer size the GEMMs dominate and the op counts of both sides are alike.
The Triton path (H100, triton 3.6; benchmarks/results/gpu/README.md, session 4): the device waits for the host,
so the step is its host time. moepass made 2,500-3,000 Python calls per step against 95-382 for the samples.
Two causes removed: Triton's launch path per launch (knobs read from the environment, binding and specialising,
the autotuner's and jit caches; `lowering/launcher.py` now takes it once per launch signature and calls the
compiled kernel's launcher after: 35 -> 17 us per autotuned launch) and `triton.cdiv` / `next_power_of_2` in host
code (constexpr functions that unwrap every argument: `codegen.cdiv` / `next_pow2`). Layer fused 1.095 -> 0.733,
gshard 1.278 -> 0.939, loop 0.41 -> 0.35; Python calls per step 2,698 -> 1,542 (fused). llama4_text's block (one
batched matmul over every expert and token: a few ops, 1.6 ms) stays below moepass's ~3 ms host floor: 1.69.
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
            rounds: int, iters: int, warmup: int, profile: bool, set_to_none: bool = False) -> dict:
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
        compiled = moepass.compile(copy.deepcopy(original), moepass.Plan(form="single"), example_inputs=example)
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
            "iters": args.iters, "grads": args.grads, "sizes": {name: asdict(SIZES[name]) for name in sizes}}
    suffix = "" if args.grads == "accumulate" else "_set_to_none"
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
                              args.profile, args.grads == "set_to_none")
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
                   launches=[{k: r[k] for k in ("ratio", "ratio_range", "original_ms", "moepass_ms", "load")}
                             for r in measured])
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
