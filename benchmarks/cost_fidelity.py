"""Cost-model fidelity: predicted vs measured EP, FSEP, HP, locality and Lina step time on this machine (W=2, gloo).

    python -m cost_model.calibrate --out benchmarks/results/cost_profile.json   # the figures, same conditions
    python benchmarks/cost_fidelity.py                                          # 26 configs, ~2 min

or both in one go, after waiting (polling every 60 s, up to 45 min) for the 1-minute load average to fall below 2.5:

    python benchmarks/cost_fidelity.py --calibrate --wait-load 2.5 [--calibrations 3]

(`--calibrations N`, default 3 with --calibrate: one calibration before the measurement and N-1 right after it;
the configurations are priced with the figure-wise median of those profiles (`cost_model.calibrate_merge`), written
to --profile. On shared cores a calibration's figures move with the load from one minute to the next; the JSON's
`calibrations` says how each profile alone would have predicted.)

Two spawned gloo ranks (one thread each) build a bare fused MoE block (`samples.models.FusedMoE`, SwiGLU
experts, m=3 GEMMs) per configuration, compile it with `moepass.compile(block, Plan(form="ep",
topology=Topology(1, 2), a2a_chunks=1, capacity_factor=...))` and time forward + backward of the
block (input requires grad, so all four token all-to-alls run). Timing: every configuration is built
first; then `--rounds` rounds go over all configurations (interleaved, so a load change on the shared
cores hits every configuration alike), each doing one warm-up step and `--steps` timed steps
(barrier, step, per-step max over the two ranks); a configuration's measured time is the median of
its rounds x steps samples.

Prediction: `cost_model.ep.ep_layer` on the calibrated profile (`this_machine(profile)`), dropless or
capacity by the config, with the expert GEMMs' FLOP/s `Hardware.gemm_rate(D, rows per expert)`. The routing factor (rho for dropless, the kept fraction c_f for capacity) is
the busiest rank's routed rows / (T*K) read from one untimed step's byte counters (the routing of a
random router on random tokens: an input of the model, not a timing); `predicted_uniform` is the same
formula with rho = 1 (dropless) and c_f = the capacity factor. No figure is fitted to these configs.

FSEP (`--forms fsep`, or `ep,fsep`): the same block compiled with `Plan(form="fsep", slots_per_device=C)`, predicted
by `cost_model.fsep.fsep_layer` (one block: the gradient slices waited at once) with rho the busiest rank's rows
and the off-rank rows it sends or receives (both over T*K) read from the same untimed step's counters; the
restore and the gradient slices are priced at the calibrated all-to-all figures, the restore's re-layout on the
rank's thread (gather, assemble, gradient slices) at the calibrated `restore_cost` (`fsep.restore_host_time`).
HP (`--forms hp`): the block converted by `Plan(form="hp")` to a Multi-Head LatentMoE of equal active parameters
(`moepass.rewrite.latent.latent_shape`), predicted by `cost_model.hp.hp_layer` (equal exchanges: no routing factor).
Locality (`--forms locality`): top-1 configs compiled with `Plan(form="locality", gate="learned", mu=...)` on
`Topology(2, 1)` (the two ranks as two one-rank nodes; loopback, so the inter-node figure is the calibrated
all-to-all's), predicted by `ep_layer` as a capacity form with the kept fraction read from the counters.
Lina (`--forms lina`, `benchmarks/cost_fidelity_lina.py`): a bare layer at ep = W = 2 has no gradient all-reduce to
order, so these configs are two layers of a dense part (four D x D projections) and the EP block in
`moepass.DataParallel`: the dense gradients all-reduced in micro-ops of u bytes during the backward under the priority
rule, and, the control, launched when ready ("fair" in the table). Priced by `ep_step` over the layers, each with its
own routing factor (read per layer from the model as built: the counters sum the layers), plus the dense GEMMs; the
all-reduce at its own calibrated figures (`cost_model.calibrate_allreduce`; gloo's all-reduce here is 5-10x slower
per call than its all-to-all) and each micro-op a collective call on the helper threads.
`by_form`: per form the median and worst |rel err| and how many within 15 %; --forms (a subset) writes
cost_fidelity_<forms>.json.

Per phase: each timed step also records its forward alone (the forward's ops, gloo's exchanges included, are
done when the block returns on CPU), so `measured` has fwd_s and bwd_s beside step_s, and `predicted` splits
the same way (the forward: its expert GEMMs, half of the fixed layer overhead, a third of the other host terms and
of the other compute, half of the exchanges, FSEP's weight restore, the helper CPU in the exchanges' proportion);
`rel_error_fwd` / `rel_error_bwd` say which phase a config's error is in. `cpu_s` / `fwd_cpu_s` / `bwd_cpu_s`: the
calling thread's CPU time (max over the ranks); wall minus CPU is time a rank waited (at an exchange, for a core).

Page faults: an untimed step after each round's timed steps counts the thread's minor page faults (max over the ranks);
their median is the model's n_f (`page_faults_counting_step`) at the calibrated `page_cost`; the timed steps' count
(`page_faults`) is a check only: it follows the allocator's state (one HP config: 11,489 per step in one run, 0 next).

Helper threads: with the calibrated figures the CPU terms are within a few % of the ranks' main-thread CPU
(`cpu_s`); the ranks' other threads take cores too (gloo's transfer threads 1-5 ms per step under EP, 5-11 ms under
FSEP; FSEP's planner 0.7-1.2 ms), and the two ranks with them outnumber these cores, so that CPU comes out of the
main threads' time and each exchange's woken threads wait for a core. `threads_s` prices it (`cost_model.helper_cpu`:
per byte sent and per exchange, the larger of the helper CPU and the wall an exchange adds beyond its link time
among busy cores, both calibrated on all-to-alls between matmuls, plus the planner's solve; added where
ranks x (1 + helper threads) > cores; the W ranks share this machine's cores, the locality form's two one-rank
"nodes" included: n_rank = W); `rel_error_without_helper_cpu` and `by_form_without_helper_cpu` give the same model
without it, from the same measurement.

In-run CPU share: on these shared cores the calibration and the measurement see different loads, and every
CPU-bound term moves with the share of the cores the two ranks get (the calibration's concurrent matmul rate
has read 14 to 54 GFLOP/s per rank here, 93-108 alone). So beside each config in each round both ranks time
the calibration's own probe, the 256^3 fp32 matmul (`PROBE_N`), and `predicted_at_run_share` re-prices the
config with the calibrated FLOP/s times, and the host terms over, share = calibrated probe time / in-run probe
time (`at_share`; the all-to-all figures as calibrated). The share is measured, never fitted to the steps;
`by_form_at_run_share` summarises it beside `by_form` (the calibration as it is).

History (2026-11-27; median |rel err| / worst / configs within 15 % per run). With the expert FFN's host figures from a
vanishing-size layer (expert_overhead 0) and an isolated activation (act_cost 1.5 ns), every form was underpredicted
(median signed error -7.8 %; five runs: all 22 within in 2). Then, each fix pricing what the runtime does: the FFN's
figures from the kernel itself (`cost_model.calibrate_ffn`: 41-63 us per local expert, 2.7-4.1 ns per hidden
element), the median of three calibrations at 5 x 5 steps, the row chain on the rows each op touches (a capacity's
dropped assignments are gathered and combined: `host_time(routed=)`) and 21 blocks for the busy-core wait: nine runs,
worst 10.3-23.1 %, all 22 within in 2; the miss mostly one of the smallest EP configs, overpriced in its exchanges.
Every EP schedule defers the expert weight GEMMs into the dispatch-backward's flight (Lancet; event log at that
config: dispatch_bwd blocked 0.000 ms, the other four exchanges 0.16-0.68 ms each); priced (`ep_alone(deferred_wgrad=
True)`, the split sizes under a capacity too): 2.6/8.4/22, 3.7/12.0/22, 4.6/14.8/22; with the locality form
scheduled as EP is: 2.5/7.9/22, 2.4/8.0/22, 3.6/8.8/22 (load 2.1-2.9; each of the nine calibrations alone 22/22,
worst 7.5-10.6 %). One run that shared the cores with a test run (load 3.3) left out. With Lina's four configs
(26 in all), priced first with the all-to-all's alpha for the all-reduce and no helper CPU for its micro-ops: lina
-13.5 to -25.2 % (a step's ten micro-ops waited ~9 ms at the end of the backward, priced 0.9 ms); with both priced,
19:43 UTC (the committed JSON, load 1.75-2.42): 5.1/10.8/26, lina 1.1/5.3/4 (its forward -11 to -20 %, its backward
+6 to +20 %: the stacked layers' exchanges wait longer in the forward than a bare layer's); a repeat of Lina alone
(`--forms lina --calibrate`, 20:12 UTC): 1.9/3.4/4.

Not measured: chunked all-to-all. Output: per config predicted / measured / error, Spearman's rho, the median |rel err|,
the load; the JSON and a log-log plot (cost_fidelity.png).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cost_fidelity_lina as lina  # noqa: E402
from benchmarks.cost_fidelity_plot import plot, print_summary, spearman  # noqa: E402
from benchmarks.cost_fidelity_setup import PROBE_N, at_share, calibrated_profile, cpu_share, measure_over_link, on_link  # noqa: E402
from cost_model import calibrate_merge  # noqa: E402
from cost_model import ep as cm  # noqa: E402
from cost_model import fsep as fsep_formulas  # noqa: E402
from cost_model import hp as hp_formulas  # noqa: E402
from cost_model.presets import Hardware, this_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROFILE = RESULTS / "cost_profile.json"
ALL_FORMS = "ep,fsep,hp,locality,lina"
PROBE_REPS, PROBE_INNER = 10, 5  # the in-run CPU-share probe (`PROBE_N`): repetitions, matmuls per repetition
W = 2
BYTES = 4  # fp32


@dataclass(frozen=True)
class Config:
    tokens: int  # T per rank
    D: int
    F: int
    E: int
    K: int
    capacity: float | None = None  # Plan.capacity_factor (None: dropless)
    form: str = "ep"  # "ep", "fsep", "hp", "locality" or "lina"
    slots: int | None = None  # FSEP: Plan.slots_per_device (C)
    layers: int = 1  # Lina: dense part + MoE block layers (`cost_fidelity_lina.DenseMoEStack`)
    micro_op_bytes: int | None = None  # Lina: the gradient all-reduce's micro-op (u)
    priority: bool = True  # Lina: the priority rule (False: micro-ops launch when ready, sharing the link)


# Varies T, D, F, E, K and capacity; sized so the measured steps lie within ~4x of each other
# (~30-110 ms here), spread so neighbours differ by ~10-20%.
CONFIGS = (
    Config(1024, 112, 256, 4, 2),
    Config(2048, 128, 256, 8, 1),
    Config(1024, 128, 288, 32, 2),
    Config(2048, 128, 256, 8, 2, capacity=0.625),
    Config(1024, 160, 320, 8, 2),
    Config(2048, 64, 512, 16, 2),
    Config(1024, 128, 256, 8, 4),
    Config(1536, 192, 256, 8, 2),
    Config(4096, 128, 256, 8, 2, capacity=0.6),
    Config(2048, 128, 384, 8, 2),
    Config(1024, 256, 448, 4, 2),
    Config(2048, 176, 384, 16, 2),
)
# FSEP over the same W=2 ranks (`--forms fsep`): C slots per device (E/W = 4 is EP's share; more lets the planner
# replicate hot experts), dropless, the restore and the gradient slices on the same gloo link
FSEP_CONFIGS = (
    Config(1024, 128, 256, 8, 2, form="fsep", slots=4),
    Config(2048, 128, 256, 8, 2, form="fsep", slots=4),
    Config(1024, 128, 256, 8, 2, form="fsep", slots=5),
    Config(2048, 160, 320, 8, 2, form="fsep", slots=5),
)


# HP over the same W=2 ranks (`--forms hp`): the block converted to a Multi-Head LatentMoE of equal active
# parameters (`moepass.rewrite.latent.latent_shape`), heads sharded over the ranks, equal exchanges
HP_CONFIGS = (
    Config(1024, 128, 256, 8, 2, form="hp"),
    Config(2048, 128, 256, 8, 2, form="hp"),
    Config(1024, 256, 448, 8, 2, form="hp"),
)

# Locality routing over the same W=2 ranks as two one-rank nodes (`--forms locality`): top-1 with the block's
# own (learned) gate, the locality loss on (mu), the experts EP-style (E/2 per node), LocMoE's capacity rule
LOCALITY_CONFIGS = (
    Config(2048, 128, 256, 8, 1, form="locality"),
    Config(4096, 128, 256, 8, 1, form="locality"),
    Config(2048, 192, 384, 16, 1, form="locality"),
)
LOCALITY_MU = 0.01

# Lina's schedule over the same W=2 ranks (`--forms lina`, `benchmarks/cost_fidelity_lina.py`): two layers of a dense
# part (four D x D projections) and an EP block, the dense gradients all-reduced in micro-ops of u bytes during the
# backward, under the priority rule and, as the control, launched when ready
LINA_CONFIGS = (
    Config(1024, 128, 256, 8, 2, form="lina", layers=2, micro_op_bytes=64 * 1024),
    Config(1024, 128, 256, 8, 2, form="lina", layers=2, micro_op_bytes=64 * 1024, priority=False),
    Config(1024, 256, 256, 8, 2, form="lina", layers=2, micro_op_bytes=256 * 1024),
    Config(1024, 256, 256, 8, 2, form="lina", layers=2, micro_op_bytes=256 * 1024, priority=False),
)
FORM_CONFIGS = {"ep": CONFIGS, "fsep": FSEP_CONFIGS, "hp": HP_CONFIGS, "locality": LOCALITY_CONFIGS,
                "lina": LINA_CONFIGS}


def hp_shape(cfg: Config) -> object:
    """The Multi-Head LatentMoE `moepass.compile` makes of the config's block under Plan(form="hp")."""
    import moepass
    from moepass.rewrite.latent import latent_shape
    from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, TensorSource

    spec = MoESpec(path="block", recogniser="fidelity", router=RouterSpec(num_experts=cfg.E, top_k=cfg.K),
                   experts=ExpertsSpec(num_experts=cfg.E, hidden_dim=cfg.D, ffn_dim=cfg.F, activation="swiglu",
                                       w_up=TensorSource.param("experts.w_up")))
    return latent_shape(spec, moepass.Plan(form="hp", topology=moepass.Topology(1, W)), W)


def layer_figures(cfg: Config, hw: Hardware, factor: float, faults: float | None) -> dict[str, Any]:
    """The figure dict of the config's block on the calibrated `hw`: its shape, the routing factor as rho (dropless)
    or c_f (capacity), the GEMM rate at its rows per expert, the step's page faults, the W ranks on one node."""
    dropless = cfg.capacity is None
    rows_per_expert = cfg.tokens * cfg.K * factor / (cfg.E / W)
    return {**hw.values(), "T": cfg.tokens, "K": cfg.K, "D": cfg.D, "F": cfg.F, "m": 3, "E": cfg.E, "G": W,
            "rho": factor if dropless else 1.0, "c_f": 1.0 if dropless else factor,
            "R": hw.gemm_rate(cfg.D, rows_per_expert), "eta": 1.0, "n_f": faults or 0.0, "n_rank": W}


def predict(cfg: Config, hw: Hardware, factor: float | list[float] | None = None, a2a_share: float | None = None,
            faults: float | None = None) -> dict[str, Any]:
    """Cost-model step time (s) of one EP, FSEP, HP or locality layer fwd+bwd, or a Lina config's model (`lina.predict`),
    and its terms; `factor`: rho (dropless) or the kept fraction c_f (capacity) of the busiest rank (Lina: one per
    layer, or one for all), None for uniform routing; `a2a_share` (FSEP): the rows the
    busiest rank sends or receives off-rank over T*K (None: 1/2, uniform); `faults`: the minor page faults of one
    step (n_f, None: 0)."""
    dropless = cfg.capacity is None
    if factor is None:
        factor = 1.0 if cfg.capacity is None else cfg.capacity
    if cfg.form == "lina":  # `factor`: one per layer, or one for all; each layer priced as this config's EP layer
        return lina.predict(cfg, hw, factor, faults, lambda one, f, n_f: (predict(one, hw, f, faults=n_f),
                                                                          layer_figures(one, hw, f, n_f)), W)
    x = layer_figures(cfg, hw, factor, faults)
    if cfg.form == "hp":  # equal exchanges: the routing does not move a rank's rows (cost_model.hp)
        shape: Any = hp_shape(cfg)
        x.update(H=shape.heads, h=shape.head_dim, E=shape.experts, K=shape.top_k, F=shape.ffn_dim,
                 R=hw.gemm_rate(shape.head_dim, cfg.tokens * shape.heads * shape.top_k / shape.experts), rho=1.0)
        t = hp_formulas.hp_layer(x, ep=W, dp=1, cross_node=False)
        fwd_gemm = 2 * cfg.tokens * shape.heads * shape.top_k * shape.head_dim * shape.ffn_dim * 3 / x["R"]
    elif cfg.form == "fsep":  # one block: its gradient slices waited at once (not deferred)
        share = 0.5 if a2a_share is None else a2a_share
        t = fsep_formulas.fsep_layer(x, W=W, C=int(cfg.slots or 1), n=1, rho=factor, a2a_rows=(share, 0.0))
    else:
        if cfg.form == "locality":  # a capacity form (the kept rows read from the counters), one rank per node
            x.update(G=1, rho=1.0, c_f=factor)
            dropless = False
        t = cm.ep_layer(x, ep=W, n=1, dp=1, dropless=dropless, cross_node_dp=False)
    if cfg.form != "hp":  # the forward's expert GEMMs on the busiest rank's rows
        fwd_gemm = float(cm.expert_flops(cfg.tokens * cfg.K * factor, cfg.D, cfg.F, 3)) / float(x["R"])
    # the forward phase: its GEMMs (a third of the fwd + bwd FLOPs besides the recompute), half of the fixed layer
    # overhead c_layer (the vanishing-size EP layer's forward and backward take equal CPU time here: 0.9-1.3 ms each,
    # thread CPU time at T=16, D=F=16, E=8 and 64, K=1), a third of the other host work, half of the exchanges
    # (dispatch + combine of four) and, FSEP, one of its three restores (the weights; the backward's weights again
    # and the gradient slices, b = b_g here); the backward phase the rest
    c_layer = float(x.get("c_layer", 0))
    restore_fwd = float(t.other_comm) / 3 if cfg.form == "fsep" else 0.0
    links = float(t.a2a_exposed) + float(t.other_comm)  # the helper threads' CPU follows the exchanges' link time
    fwd = fwd_gemm + float(t.compute - (3 + float(x.get("r_c", 0)) * 2 / 3) * fwd_gemm) / 3 + c_layer / 2 \
        + (float(t.host) - c_layer) / 3 + float(t.a2a_exposed) / 2 + restore_fwd \
        + (float(t.threads) * (float(t.a2a_exposed) / 2 + restore_fwd) / links if links else 0.0)
    return {"step_s": float(t.step), "fwd_s": fwd, "bwd_s": float(t.step) - fwd, "compute_s": float(t.compute),
            "a2a_s": float(t.a2a_exposed), "host_s": float(t.host), "other_s": float(t.other_comm),
            "threads_s": float(t.threads),
            "dispatch_bytes": float(t.a2a_bytes), "page_s": float(x["c_page"]) * float(x["n_f"]),
            "restore_host_s": float(fsep_formulas.restore_host_time(
                int(cfg.slots or 0), fsep_formulas.expert_elements(cfg.D, cfg.F, 3), x["c_restore"]))
            if cfg.form == "fsep" else 0.0,
            "factor": float(factor), "gemm_flops": float(x["R"])}


def compiled(c: Config) -> Any:
    """The config's model as `moepass.compile` rewrites it for its form on the W ranks."""
    import moepass
    from samples.models import FusedMoE

    if c.form == "fsep":
        plan = moepass.Plan(form="fsep", topology=moepass.Topology(1, W), a2a_chunks=1, slots_per_device=c.slots)
    elif c.form == "hp":
        plan = moepass.Plan(form="hp", topology=moepass.Topology(1, W))
    elif c.form == "locality":  # the two ranks as two one-rank nodes
        plan = moepass.Plan(form="locality", topology=moepass.Topology(W, 1), gate="learned", mu=LOCALITY_MU,
                            capacity_factor=c.capacity)
    else:
        plan = moepass.Plan(form="ep", topology=moepass.Topology(1, W), a2a_chunks=1, capacity_factor=c.capacity)
    return moepass.compile(FusedMoE(c.D, c.F, c.E, c.K), plan)


def rank_worker(rank: int, port: int | None, configs: tuple[Config, ...], rounds: int, steps: int, results,
                timeout_s: float):
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is not None:  # else set by `benchmarks.netns` in the rank's namespace
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        import moepass

        layers, inputs, routing = [], [], []
        for i, c in enumerate(configs):
            torch.manual_seed(i)  # the same block on both ranks
            layer, built = lina.build(c, W) if c.form == "lina" else (compiled(c), None)
            x = torch.randn(c.tokens, c.D, generator=torch.Generator().manual_seed(1000 * i + rank)).requires_grad_()
            moepass.reset_comm_stats()
            layer(x).sum().backward()  # warm-up, and the routing's byte counters
            stats = moepass.comm_stats()
            gathered: list = [None] * W
            mine = {k: stats[k] for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "counts") if k in stats}
            if built is not None:  # Lina's layers: each one's routing (the counters sum them)
                mine["layer_rows"] = lina.routed_rows(built, x.detach(), W)
            dist.all_gather_object(gathered, mine)
            layers.append(layer)
            inputs.append(x)
            routing.append(gathered)
        samples: list[list[float]] = [[] for _ in configs]
        fwd_samples: list[list[float]] = [[] for _ in configs]
        cpu_samples: list[list[float]] = [[] for _ in configs]  # the calling thread's CPU time (user + sys)
        fwd_cpu_samples: list[list[float]] = [[] for _ in configs]
        fault_samples: list[list[float]] = [[] for _ in configs]  # the calling thread's minor page faults
        counted_faults: list[list[float]] = [[] for _ in configs]  # those of the untimed step after each round's
        probes: list[list[float]] = [[] for _ in configs]
        a, b = torch.randn(PROBE_N, PROBE_N), torch.randn(PROBE_N, PROBE_N)
        for _ in range(rounds):
            for i, (layer, x) in enumerate(zip(layers, inputs)):
                for _ in range(PROBE_REPS):  # the calibration's square matmul, both ranks at once, beside the config
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(PROBE_INNER):
                        torch.mm(a, b)
                    probes[i].append((time.perf_counter() - t0) / PROBE_INNER)
                times, fwd_times, cpu_times, fwd_cpu, faults = [], [], [], [], []
                for j in range(steps + 1):
                    for p in layer.parameters():
                        p.grad = None
                    x.grad = None
                    dist.barrier()
                    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                    t0, c0 = time.perf_counter(), time.thread_time()
                    loss = layer(x).sum()
                    t1, c1 = time.perf_counter(), time.thread_time()  # the forward's ops (gloo's included) are done
                    loss.backward()
                    if j:  # one warm-up step per round
                        times.append(time.perf_counter() - t0)
                        fwd_times.append(t1 - t0)
                        cpu_times.append(time.thread_time() - c0)
                        fwd_cpu.append(c1 - c0)
                        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
                for p in layer.parameters():  # the counting step (untimed): its page faults are the model's input
                    p.grad = None
                x.grad = None
                dist.barrier()
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                layer(x).sum().backward()
                counted = torch.tensor([resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0], dtype=torch.float64)
                dist.all_reduce(counted, op=dist.ReduceOp.MAX)
                counted_faults[i].append(float(counted))
                slowest = torch.tensor([times, fwd_times, cpu_times, fwd_cpu, faults], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                samples[i] += slowest[0].tolist()
                fwd_samples[i] += slowest[1].tolist()
                cpu_samples[i] += slowest[2].tolist()
                fwd_cpu_samples[i] += slowest[3].tolist()
                fault_samples[i] += slowest[4].tolist()
        slow = torch.tensor(probes, dtype=torch.float64)
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put([{"samples_s": s, "fwd_samples_s": f, "stats": r, "probe_s": p, "cpu_s": c, "fwd_cpu_s": fc,
                          "faults": pf, "counted_faults": cf}
                         for s, f, r, p, c, fc, pf, cf in zip(samples, fwd_samples, routing, slow.tolist(), cpu_samples,
                                                              fwd_cpu_samples, fault_samples, counted_faults)])
        dist.barrier()
        for layer in layers:
            if isinstance(layer, moepass.DataParallel):
                layer.close()
    finally:
        dist.destroy_process_group()


def measure(configs: tuple[Config, ...], rounds: int = 3, steps: int = 3, timeout_s: float = 600.0) -> list[dict]:
    """Per config: every timed step (s, max over ranks) and both ranks' byte counters of one step."""
    from cost_model.calibrate import spawn_ranks

    (out,) = spawn_ranks(rank_worker, (configs, rounds, steps), 1, "measurement", timeout_s, world=W)
    return out


def routing_rows(cfg: Config, stats: list[dict]) -> np.ndarray:
    """[source rank, destination rank] rows of the forward dispatch, from both ranks' counters (W=2: self and
    intra; the locality form's two one-rank nodes: self and inter)."""
    row = cfg.D * BYTES
    rows = np.zeros((W, W))
    for r, s in enumerate(stats):
        rows[r, r] = s["dispatch"]["self"] / row
        rows[r, 1 - r] = (s["dispatch"]["intra"] + s["dispatch"]["inter"]) / row
    return rows


def error_summary(errors: list[float]) -> dict[str, Any]:
    """Median and worst of |relative errors|, and how many are within 15 %."""
    errors = [abs(e) for e in errors]
    return {"median_abs_rel_error": float(np.median(errors)), "worst_abs_rel_error": max(errors),
            "within_15pct": sum(e <= 0.15 for e in errors)}


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predict-only", action="store_true", help="print predictions; no measurement")
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", type=int, default=None, help="the first N configurations (development)")
    parser.add_argument("--forms", default=ALL_FORMS,
                        help=f"comma-separated forms to measure: a subset of {ALL_FORMS} (default: all of them)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON (default benchmarks/results/cost_fidelity.json; cost_fidelity_<forms>.json for "
                             "other --forms)")
    parser.add_argument("--calibrate", action="store_true", help="run cost_model.calibrate into --profile first")
    parser.add_argument("--wait-load", type=float, default=None, metavar="L",
                        help="first wait (poll every 60 s, up to --wait-max s) for the 1-min load average < L")
    parser.add_argument("--wait-max", type=float, default=45 * 60)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's JSON")
    parser.add_argument("--calibrations", type=int, default=3, metavar="N",
                        help="with --calibrate: N calibrations, one before the measurement and N-1 after it; "
                             "predictions use their figure-wise median (default 3)")
    parser.add_argument("--link", metavar="RATE", help="the ranks in network namespaces joined by a tc-limited link "
                        "of RATE, e.g. 1gbit (root; benchmarks/cost_fidelity_setup.py)")
    args = parser.parse_args(argv)
    if args.out is None:
        tag = "_".join(sorted(set(args.forms.split(","))))
        tag = ("" if tag == "_".join(sorted(ALL_FORMS.split(","))) else f"_{tag}") + ("_link" if args.link else "")
        args.out = RESULTS / f"cost_fidelity{tag}.json"
    if args.plot_only:
        saved = json.loads(args.out.read_text())
        plot(saved["configs"], args.out.with_suffix(".png"), saved["spearman"], saved["median_abs_rel_error"])
        return 0
    waited = 0.0
    if args.wait_load is not None and not args.predict_only:
        while load_average() >= args.wait_load and waited < args.wait_max:
            print(f"load average {load_average():.2f} >= {args.wait_load}: waiting ({waited / 60:.0f} min so far)",
                  flush=True)
            time.sleep(60)
            waited += 60
        print(f"load average {load_average():.2f} after waiting {waited / 60:.0f} min", flush=True)
    load_at_calibration = None
    profiles: list[dict[str, Any]] = []
    if args.calibrate and not args.predict_only:
        if args.calibrations < 1:
            parser.error(f"--calibrations {args.calibrations}: use 1 or more (1 = before the measurement only)")
        load_at_calibration = list(os.getloadavg())
        profiles.append(calibrated_profile())
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(json.dumps(profiles[0], indent=1) + "\n")
    hw = this_machine(args.profile)
    forms = set(args.forms.split(","))
    if forms - set(FORM_CONFIGS):
        parser.error(f"--forms {args.forms!r}: use a comma-separated subset of {ALL_FORMS}")
    chosen = sum((FORM_CONFIGS[form] for form in FORM_CONFIGS if form in forms), ())
    configs = chosen[: args.only] if args.only else chosen
    if args.predict_only:
        for c in configs:
            p = predict(c, hw)
            print(asdict(c), f"{p['step_s'] * 1e3:.2f} ms (compute {p['compute_s'] * 1e3:.2f}, a2a "
                  f"{p['a2a_s'] * 1e3:.2f}, host {p['host_s'] * 1e3:.2f}, helper threads {p['threads_s'] * 1e3:.2f})")
        return 0
    load_before = os.getloadavg()
    t0 = time.time()
    link: dict[str, Any] | None = None
    if args.link:
        measured, link = measure_over_link(configs, args.rounds, args.steps, args.link)
    else:
        measured = measure(configs, args.rounds, args.steps)
    load_after = os.getloadavg()
    if profiles:  # the rest after the measurement; the configurations are priced with the median profile
        profiles += [calibrated_profile() for _ in range(args.calibrations - 1)]
        args.profile.write_text(json.dumps(calibrate_merge.median_profile(profiles), indent=1) + "\n")
        hw = this_machine(args.profile)
    profile = json.loads(args.profile.read_text())
    shares = [cpu_share(profile, m.get("probe_s", [])) for m in measured]
    share_run = float(np.median([x for x in shares if x])) if any(shares) else None
    each_hw = [this_machine(p) for p in profiles] if len(profiles) > 1 else []
    if link is not None:
        hw, *each_hw = (on_link(h, link) for h in (hw, *each_hw))
    rows: list[dict[str, Any]] = []
    for c, m, share_c in zip(configs, measured, shares):
        hw_run = at_share(hw, share_c) if share_c else None
        if c.form == "hp":  # equal exchanges: every rank computes T*H*K rows whatever the routing
            factor, share, sent = 1.0, None, []
        else:
            rows_PP = routing_rows(c, m["stats"])
            factor = float(rows_PP.sum(axis=0).max() / (c.tokens * c.K))
            sent = cm.exact_a2a(rows_PP, c.D, BYTES, G=W).sent.tolist()
            off = rows_PP - np.diag(np.diag(rows_PP))
            share = float(max(off.sum(axis=1).max(), off.sum(axis=0).max()) / (c.tokens * c.K))
        faults = float(np.median(m["counted_faults"]))  # counted on the untimed step (like the routing), priced below
        if c.form == "lina":  # each layer's busiest rank, not the counters' (they sum the layers)
            factor = [max(np.sum([s["layer_rows"][layer] for s in m["stats"]], axis=0)) / (c.tokens * c.K)
                      for layer in range(c.layers)]
        pred = predict(c, hw, factor, share, faults)
        meas = float(np.median(m["samples_s"]))
        fwd = float(np.median(m["fwd_samples_s"]))
        rows.append({
            "config": asdict(c),
            "predicted": pred,
            "predicted_uniform": predict(c, hw, faults=faults),
            "measured": {"step_s": meas, "samples_s": m["samples_s"], "fwd_s": fwd, "bwd_s": meas - fwd,
                         "fwd_samples_s": m["fwd_samples_s"],
                         "cpu_s": float(np.median(m["cpu_s"])), "fwd_cpu_s": float(np.median(m["fwd_cpu_s"])),
                         "bwd_cpu_s": float(np.median(m["cpu_s"])) - float(np.median(m["fwd_cpu_s"])),
                         "page_faults": float(np.median(m["faults"])), "page_faults_counting_step": faults,
                         "dispatch_bytes": [s["dispatch"]["intra"] + s["dispatch"]["inter"] for s in m["stats"]
                                            if "dispatch" in s]},
            "exact_dispatch_bytes": sent,
            "rel_error": (pred["step_s"] - meas) / meas,
            "rel_error_fwd": (pred["fwd_s"] - fwd) / fwd,
            "rel_error_bwd": (pred["bwd_s"] - (meas - fwd)) / (meas - fwd),
        })
        alone = predict(c, hw.with_figures("helper threads on cores of their own", cores=math.inf), factor, share, faults)
        rows[-1]["rel_error_without_helper_cpu"] = (alone["step_s"] - meas) / meas  # the same model, threads_s = 0
        if hw_run is not None:
            run = predict(c, hw_run, factor, share, faults)
            rows[-1].update(cpu_share=share_c, predicted_at_run_share=run,
                            rel_error_at_run_share=(run["step_s"] - meas) / meas)
        rows[-1]["predicted_by_calibration"] = [predict(c, h, factor, share, faults)["step_s"] for h in each_hw]
    pred_s = [r["predicted"]["step_s"] for r in rows]
    meas_s = [r["measured"]["step_s"] for r in rows]
    rho = spearman(pred_s, meas_s)
    med = float(np.median([abs(r["rel_error"]) for r in rows]))
    med_uniform = float(np.median([abs(r["predicted_uniform"]["step_s"] - r["measured"]["step_s"])
                                   / r["measured"]["step_s"] for r in rows]))
    def by_form_of(key: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for form in dict.fromkeys(r["config"]["form"] for r in rows):
            errs = [r[key] for r in rows if r["config"]["form"] == form and key in r]
            if errs:
                out[form] = {"configs": len(errs), **error_summary(errs)}
        return out

    by_form = by_form_of("rel_error")
    by_form_run = by_form_of("rel_error_at_run_share")
    by_form_alone = by_form_of("rel_error_without_helper_cpu")
    out = {
        "hardware": hw.name, "calibrated": hw.calibrated, "profile": str(args.profile), "link": link,
        "profile_created": profile.get("created"),
        "figures": {k: profile.get(k) for k in ("alpha", "bandwidth", "flops", "layer_overhead", "expert_overhead",
                                                "row_cost", "act_cost", "restore_cost", "page_cost", "route_cost",
                                                "xfer_byte_cost", "xfer_call_cost", "xfer_wait_byte_cost",
                                                "xfer_wait_call_cost", "helper_threads", "cores",
                                                "allreduce_alpha", "allreduce_bandwidth",
                                                "planner_cost", "planner_entry_cost",
                                                "flops_one_process")},
        "world_size": W, "rounds": args.rounds, "steps_per_round": args.steps,
        "load_average_at_calibration": load_at_calibration, "waited_for_load_s": waited,
        "load_average_before": list(load_before), "load_average_after": list(load_after),
        "seconds": time.time() - t0,
        "spearman": rho, "median_abs_rel_error": med, "median_abs_rel_error_uniform_routing": med_uniform,
        "measured_spread": max(meas_s) / min(meas_s),
        "by_form": by_form,
        "cpu_share_in_run": share_run,
        "by_form_at_run_share": by_form_run,
        "by_form_without_helper_cpu": by_form_alone,
        "configs": rows,
    }
    if each_hw:
        out["calibrations"] = [
            {"created": p.get("created"), "load_average": p.get("load_average"),
             "figures": {k: p.get(k) for k in out["figures"]},
             **error_summary([(r["predicted_by_calibration"][i] - m) / m for r, m in zip(rows, meas_s)])}
            for i, p in enumerate(profiles)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), rho, med)
    print_summary(out, rows, len(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
