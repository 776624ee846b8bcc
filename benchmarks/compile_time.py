"""Detection and compile time of a large sample: 32 MoE layers × 64 experts, D=256 (issue 17: ≤ 3 s).

    python benchmarks/compile_time.py [--layers 32 --experts 64 --dim 256 --style loop --repeats 3 --threads 1]

Measured at a quarter, half and all of the layers, each figure the median of `--repeats` runs: `detect`,
`compile` given the report (a deep copy of the model, rewritten), `compile(inplace=True)`, and their
totals; then the per-layer slope and intercept of a least-squares line through the sizes (linear in
layers: identical blocks are checked once, each block is built once). Writes
benchmarks/results/compile_time.json with the machine and its load average before and after (on a shared
machine the figures vary with the load, and more threads than free cores slow torch down). Each figure is
also given as CPU seconds of this process (user + system; `*_cpu_seconds`): single-threaded, what a quiet
machine would show as wall time, and far less sensitive to the other processes than wall time.

The floor: compile copies every expert weight once (the user's model is never changed), into fresh memory
that the kernel must fault in page by page. `floor` measures one copy of the same number of bytes into
fresh memory, and into memory already touched (the memcpy alone), with the minor page faults each takes;
`page_faults` per run counts the faults of compile itself, `page_fault_cpu_seconds` estimates their cost
at the floor's rate. The floor is also measured in every repeat, just before its compile (interleaved: on
this VM the cost of fresh memory varies several-fold from minute to minute), giving `compile - floor` per
repeat; user and system CPU are reported apart (user: moepass's own work and the memcpy; system: the
kernel faulting the fresh memory in).

The issue's figure is what a user sees: `first_compile`, the model built in a fresh process and then one
detect and one compile, each sample its own process (`fresh_processes`, the layer counts interleaved round
by round; the floor measured in the same process after compile). The in-process repeats above run with
several copies of the model alive and freed in turn, which on this VM makes fresh memory several times
slower than in a new process: they time moepass's work (user CPU) well, the wall time less so.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import moepass
from moepass import canonical
from samples.models import SampleConfig, TinyMoELM

OUT = Path(__file__).parent / "results" / "compile_time.json"


@dataclass
class Timing:
    """One call: wall seconds, CPU seconds of this process (user + system: on a loaded machine, what a
    quiet one would take as wall time, single-threaded), split into user (moepass's own work and the
    memcpy) and system (the kernel, here faulting in fresh memory), and minor page faults."""

    seconds: float
    cpu_seconds: float
    page_faults: int
    user_seconds: float = 0.0
    system_seconds: float = 0.0


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def timed(fn, *args, **kwargs):
    """(result, Timing) of one call `fn(*args, **kwargs)`."""
    (user, system, faults), start = usage(), time.perf_counter()
    result = fn(*args, **kwargs)
    seconds = time.perf_counter() - start
    user_after, system_after, faults_after = usage()
    user, system = user_after - user, system_after - system
    return result, Timing(seconds, user + system, faults_after - faults, user, system)


def expert_bytes(model: torch.nn.Module, report: moepass.DetectionReport) -> int:
    """Bytes of the per-expert weights that form="single" lays into one buffer per role."""
    return sum(p.numel() * p.element_size() for spec in report.blocks
               for group in canonical.stacked_parameters(model.get_submodule(spec.path), spec) for p in group)


def fresh_copy(source: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(source).copy_(source)


def copy_floor(nbytes: int) -> dict:
    """One copy of `nbytes` into fresh memory (page faults included) and into touched memory (memcpy)."""
    source = torch.ones(nbytes // 4)
    target, fresh = timed(fresh_copy, source)
    _, touched = timed(target.copy_, source)
    return {"bytes": nbytes, "fresh_copy_seconds": fresh.seconds, "fresh_copy_cpu_seconds": fresh.cpu_seconds,
            "fresh_copy_page_faults": fresh.page_faults, "touched_copy_seconds": touched.seconds,
            "touched_copy_cpu_seconds": touched.cpu_seconds,
            "cpu_seconds_per_page_fault": (fresh.cpu_seconds - touched.cpu_seconds) / max(fresh.page_faults, 1)}


def measure(layers: int, experts: int, dim: int, style: str, repeats: int) -> dict:
    torch.manual_seed(0)
    cfg = SampleConfig(dim=dim, ffn_dim=2 * dim, num_experts=experts, top_k=2, layers=layers, style=style, heads=4)
    model = TinyMoELM(cfg)
    plan = moepass.Plan(form="single")
    detect_t, compile_t, inplace_t, floor_t = [], [], [], []
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    with torch.no_grad():
        expected = model(tokens)
    source = None
    for _ in range(repeats):
        report, timing = timed(moepass.detect, model)
        detect_t.append(timing)
        if source is None:
            source = torch.ones(expert_bytes(model, report) // 4)
        floor_copy, timing = timed(fresh_copy, source)  # the floor, just before compile
        floor_t.append(timing)
        compiled, timing = timed(moepass.compile, model, plan, report=report)
        compile_t.append(timing)
        del floor_copy  # after compile: its pages are not handed back to compile
        with torch.no_grad():
            torch.testing.assert_close(compiled(tokens), expected, rtol=1e-4, atol=1e-5)
        del compiled
        fresh = copy.deepcopy(model)
        _, timing = timed(moepass.compile, fresh, plan, report=report, inplace=True)
        inplace_t.append(timing)
        del fresh
    assert len(report.blocks) == layers, report.summary()
    del source
    detect, compile_, inplace = (statistics.median(t.seconds for t in ts) for ts in (detect_t, compile_t, inplace_t))
    detect_cpu, compile_cpu, inplace_cpu = (statistics.median(t.cpu_seconds for t in ts)
                                            for ts in (detect_t, compile_t, inplace_t))
    over_floor = [c.seconds - f.seconds for c, f in zip(compile_t, floor_t)]
    return {
        "config": {"layers": layers, "experts": experts, "dim": dim, "ffn_dim": 2 * dim, "top_k": 2, "style": style},
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "expert_bytes": expert_bytes(model, report),
        "detect_seconds": detect,
        "compile_seconds_given_report": compile_,
        "compile_inplace_seconds_given_report": inplace,
        "total_seconds": detect + compile_,
        "total_inplace_seconds": detect + inplace,
        "detect_ms_per_block": 1e3 * detect / layers,
        "hypotheses_checked_per_block": sum(len(d.tried) for d in report.details) / layers,
        "detect_cpu_seconds": detect_cpu,
        "compile_cpu_seconds": compile_cpu,
        "compile_inplace_cpu_seconds": inplace_cpu,
        "total_cpu_seconds": detect_cpu + compile_cpu,
        "detect_user_seconds": statistics.median(t.user_seconds for t in detect_t),
        "compile_user_seconds": statistics.median(t.user_seconds for t in compile_t),
        "compile_system_seconds": statistics.median(t.system_seconds for t in compile_t),
        "total_user_seconds": statistics.median(d.user_seconds + c.user_seconds for d, c in zip(detect_t, compile_t)),
        "total_seconds_min": min(d.seconds + c.seconds for d, c in zip(detect_t, compile_t)),
        "total_seconds_max": max(d.seconds + c.seconds for d, c in zip(detect_t, compile_t)),
        "floor_seconds": statistics.median(t.seconds for t in floor_t),
        "floor_system_seconds": statistics.median(t.system_seconds for t in floor_t),
        "compile_over_floor_seconds": statistics.median(over_floor),
        "compile_over_floor_range": [min(over_floor), max(over_floor)],
        "page_faults": statistics.median(t.page_faults for t in compile_t),
        "repeats": repeats,
        "samples": {name: [dataclasses.asdict(t) for t in ts]
                    for name, ts in (("detect", detect_t), ("compile", compile_t), ("compile_inplace", inplace_t),
                                     ("floor", floor_t))},
    }


def first_compile(layers: int, experts: int, dim: int, style: str) -> dict:
    """What a user sees: in this (fresh) process, the model built, then one `detect` and one `compile` (each
    timed), then the floor: one fresh copy of the expert bytes, after compile."""
    torch.manual_seed(0)
    cfg = SampleConfig(dim=dim, ffn_dim=2 * dim, num_experts=experts, top_k=2, layers=layers, style=style, heads=4)
    model = TinyMoELM(cfg)
    report, detect = timed(moepass.detect, model)
    compiled, compile_ = timed(moepass.compile, model, moepass.Plan(form="single"), report=report)
    assert len(compiled.moepass_info.rewritten) == layers
    _, floor = timed(fresh_copy, torch.ones(expert_bytes(model, report) // 4))
    return {"detect": dataclasses.asdict(detect), "compile": dataclasses.asdict(compile_),
            "floor": dataclasses.asdict(floor)}


def fresh_processes(layer_counts: list[int], experts: int, dim: int, style: str, repeats: int,
                    threads: int) -> list[dict]:
    """`first_compile` in a new process per sample, the layer counts interleaved round by round; per layer
    count the medians and ranges of detect + compile, its user and system CPU, and the floor."""
    samples: dict[int, list[dict]] = {n: [] for n in layer_counts}
    for _ in range(repeats):
        for n in layer_counts:
            out = subprocess.run([sys.executable, __file__, "--first-compile", "--layers", str(n), "--experts",
                                  str(experts), "--dim", str(dim), "--style", style, "--threads", str(threads)],
                                 capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
            samples[n].append(json.loads(out.stdout.strip().splitlines()[-1]))
    runs = []
    for n, got in samples.items():
        total = [s["detect"]["seconds"] + s["compile"]["seconds"] for s in got]
        user = [s["detect"]["user_seconds"] + s["compile"]["user_seconds"] for s in got]
        system = [s["detect"]["system_seconds"] + s["compile"]["system_seconds"] for s in got]
        floor = [s["floor"]["seconds"] for s in got]
        runs.append({"layers": n, "total_seconds": statistics.median(total), "total_range": [min(total), max(total)],
                     "detect_seconds": statistics.median(s["detect"]["seconds"] for s in got),
                     "user_seconds": statistics.median(user), "system_seconds": statistics.median(system),
                     "floor_seconds": statistics.median(floor), "floor_range": [min(floor), max(floor)],
                     "samples": got})
    return runs


def linear_fit(runs: list[dict], key: str) -> dict:
    """Least-squares seconds = intercept + slope * layers over the sizes measured."""
    if len(runs) < 2:
        return {"seconds_per_layer": None, "intercept_seconds": None}
    slope, intercept = statistics.linear_regression([r["config"]["layers"] for r in runs], [r[key] for r in runs])
    return {"seconds_per_layer": slope, "intercept_seconds": intercept}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--style", default="loop", choices=["loop", "fused", "gshard", "mixed"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the figures do not depend on idle cores)")
    p.add_argument("--first-compile", action="store_true", help=argparse.SUPPRESS)  # one child of fresh_processes
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.first_compile:
        print(json.dumps(first_compile(args.layers, args.experts, args.dim, args.style)))
        return 0
    styles = [args.style] if args.style != "mixed" else ["loop", "fused", "gshard"]
    layer_counts = sorted({max(1, args.layers // 4), max(1, args.layers // 2), args.layers})
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
               "processor": platform.machine(), "threads": args.threads, "load_average": os.getloadavg()}
    # first: the in-process repeats allocate and free many GiB, after which fresh memory on this VM stays
    # several times slower for minutes
    first = {style: fresh_processes(layer_counts, args.experts, args.dim, style, args.repeats, args.threads)
             for style in styles}
    runs = [measure(layers, args.experts, args.dim, style, args.repeats) for style in styles for layers in layer_counts]
    fits = {style: {key: linear_fit([r for r in runs if r["config"]["style"] == style], key)
                    for key in ("total_seconds", "total_cpu_seconds", "compile_seconds_given_report", "detect_seconds")}
            for style in styles}
    floor = copy_floor(max(r["expert_bytes"] for r in runs))
    for style, got in first.items():
        fits[style]["first_compile_total_seconds"] = linear_fit(
            [{"config": {"layers": r["layers"]}, "total_seconds": r["total_seconds"]} for r in got], "total_seconds")
    machine["load_average_after"] = os.getloadavg()
    for run in runs:
        run["page_fault_cpu_seconds"] = run["page_faults"] * floor["cpu_seconds_per_page_fault"]
        c = run["config"]
        print(f"{c['style']:>7}: {c['layers']} layers x {c['experts']} experts, D={c['dim']}: "
              f"detect {run['detect_seconds']:.2f} s ({run['detect_ms_per_block']:.0f} ms/block, "
              f"{run['hypotheses_checked_per_block']:.2f} hypotheses/block), compile {run['compile_seconds_given_report']:.2f} s "
              f"({run['compile_inplace_seconds_given_report']:.2f} s inplace; {run['page_faults']:.0f} page faults "
              f"~ {run['page_fault_cpu_seconds']:.2f} s CPU): total {run['total_seconds']:.2f} s "
              f"({run['total_inplace_seconds']:.2f} s inplace; {run['total_cpu_seconds']:.2f} s CPU), "
              f"median of {run['repeats']}, range [{run['total_seconds_min']:.2f}, {run['total_seconds_max']:.2f}]")
        print(f"{'':>9}user CPU: detect {run['detect_user_seconds']:.2f} s + compile {run['compile_user_seconds']:.2f} s "
              f"= {run['total_user_seconds']:.2f} s; compile's system CPU {run['compile_system_seconds']:.2f} s; "
              f"floor (fresh copy of the expert bytes, just before each compile) {run['floor_seconds']:.2f} s "
              f"({run['floor_system_seconds']:.2f} s system); compile - floor {run['compile_over_floor_seconds']:.2f} s "
              f"[{run['compile_over_floor_range'][0]:.2f}, {run['compile_over_floor_range'][1]:.2f}]")
    for style, fit in fits.items():
        for key in ("total_seconds", "total_cpu_seconds"):
            if fit[key]["seconds_per_layer"] is not None:
                print(f"{style:>7}: {key} = {fit[key]['intercept_seconds']:.3f} s + "
                      f"{fit[key]['seconds_per_layer']:.3f} s x layers")
    print(f"floor: one copy of {floor['bytes'] / 2**30:.2f} GiB into fresh memory {floor['fresh_copy_seconds']:.2f} s "
          f"({floor['fresh_copy_cpu_seconds']:.2f} s CPU, {floor['fresh_copy_page_faults']} page faults), into touched "
          f"memory {floor['touched_copy_seconds']:.2f} s ({floor['touched_copy_cpu_seconds']:.2f} s CPU)")
    for style, got in first.items():
        for r in got:
            print(f"{style:>7}: first compile in a fresh process (what a user sees), {r['layers']} layers: detect + compile "
                  f"{r['total_seconds']:.2f} s [{r['total_range'][0]:.2f}, {r['total_range'][1]:.2f}] (detect "
                  f"{r['detect_seconds']:.2f} s; user CPU {r['user_seconds']:.2f} s, system {r['system_seconds']:.2f} s); "
                  f"floor after it {r['floor_seconds']:.2f} s [{r['floor_range'][0]:.2f}, {r['floor_range'][1]:.2f}], "
                  f"median of {len(r['samples'])} processes")
        fit = fits[style]["first_compile_total_seconds"]
        if fit["seconds_per_layer"] is not None:
            print(f"{style:>7}: first compile total = {fit['intercept_seconds']:.3f} s + "
                  f"{fit['seconds_per_layer']:.3f} s x layers")
    print(f"load average {machine['load_average']} before, {machine['load_average_after']} after; "
          f"{args.threads} torch thread(s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine, "runs": runs, "first_compile": first, "fits": fits, "floor": floor},
                              indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
