"""Hardware presets. Every figure carries its source; a scenario's own figures override them.

Bandwidths are effective bytes/s per device for one link class (what an all-to-all achieves), not
link peaks. Where only a peak is published, the effective figure is the peak times the efficiency
LAER-MoE profiled on A100 (NVLink 216.3 of 300 GB/s per direction = 0.72; InfiniBand 88.95 of
100 GB/s = 0.89), and the source says so. FLOP/s are dense bf16/fp16 peaks; `efficiency` is the
fraction expert GEMMs reach, an assumption unless calibrated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILE = Path(os.path.expanduser("~/.cache/moepass/profile.json"))
NVLINK_EFFICIENCY = 216.3 / 300.0  # LAER-MoE profiled A100 NVLink, over the 300 GB/s per-direction peak
IB_EFFICIENCY = 88.95 / 100.0  # LAER-MoE profiled 800 Gb/s InfiniBand (100 GB/s)
MICRO_OP_BYTES = 30 * 2**20  # the all-reduce unit under "priority" (cost_model.schedule); Plan.micro_op_bytes's default


_NOT_MODELLED = "not modelled: host overheads assumed hidden behind GPU kernels"
_FREE_CORES = "not modelled: the collective's helper threads (NCCL's proxy) assumed on free host cores"


@dataclass(frozen=True)
class Figure:
    value: float
    source: str

    def __float__(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Hardware:
    """One device type and its links. Field names match `cost_model.symbols` (see `values`)."""

    name: str
    device: str
    flops: Figure  # R: peak dense FLOP/s
    efficiency: Figure  # eta
    intra_bw: Figure  # B_intra
    inter_bw: Figure  # B_inter
    alpha: Figure  # latency per collective call
    memory: Figure  # device memory, bytes
    bytes_per_element: Figure  # b: activations in the all-to-all
    grad_bytes: Figure  # b_g: gradients in the all-reduce
    state_bytes: Figure  # s: weights + grads + optimizer state per parameter
    calibrated: bool = True
    # host-side terms of `cost_model.ep.host_time` and the kernel's recompute flag (`compute_time`):
    # measured on this machine by `cost_model.calibrate`; not modelled (0) for the GPU presets
    layer_overhead: Figure = Figure(0.0, _NOT_MODELLED)  # c_layer, s per EP layer step
    expert_overhead: Figure = Figure(0.0, _NOT_MODELLED)  # c_expert, s per local expert per step
    row_cost: Figure = Figure(0.0, _NOT_MODELLED)  # c_row, s per routed element (rows x D) per step
    act_cost: Figure = Figure(0.0, _NOT_MODELLED)  # c_act, s per hidden element (rows x F) per step
    restore_cost: Figure = Figure(0.0, _NOT_MODELLED)  # c_restore, s per FSEP restored element (C x S_e) per step
    page_cost: Figure = Figure(0.0, _NOT_MODELLED)  # c_page, s per minor page fault (first touch of fresh memory)
    route_cost: Figure = Figure(0.0, _NOT_MODELLED)  # c_route, s per routed token (router fwd + bwd) per step
    recompute: Figure = Figure(0.0, "GPU kernels assumed to save the gate/up GEMM outputs for backward")
    # the collective library's helper threads (`cost_model.helper_cpu`): their CPU per byte sent and per exchange,
    # how many are busy around an exchange, the cores a node's ranks share; the GPU presets price none
    xfer_byte_cost: Figure = Figure(0.0, _FREE_CORES)  # c_xb, s of helper-thread CPU per byte a rank sends
    xfer_call_cost: Figure = Figure(0.0, _FREE_CORES)  # c_xc, s of helper-thread CPU per exchange (collective call)
    xfer_wait_byte_cost: Figure = Figure(0.0, _FREE_CORES)  # c_wb, s per byte sent an exchange adds on busy cores
    xfer_wait_call_cost: Figure = Figure(0.0, _FREE_CORES)  # c_wc, s per exchange it adds on busy cores
    helper_threads: Figure = Figure(0.0, _FREE_CORES)  # n_help, helper threads busy around an exchange
    cores: Figure = Figure(math.inf, _FREE_CORES)  # n_core, cores per node (infinite: every thread has its own)
    planner_cost: Figure = Figure(0.0, _FREE_CORES)  # c_plan, s of FSEP planner CPU per solve
    planner_entry_cost: Figure = Figure(0.0, _FREE_CORES)  # c_plan_e, s per [W, E] count entry of a solve
    # the gradient all-reduce's own latency and rate (`cost_model.calibrate_allreduce`; alpha_r, B_r): None prices
    # it at the all-to-all's alpha and the link's bandwidth (the presets)
    allreduce_alpha: Figure | None = None
    allreduce_bw: Figure | None = None
    # measured efficiency of the expert FFN's GEMMs (x `flops`) by (width D, rows per expert M)
    gemm_table: tuple[tuple[int, int, float], ...] = ()

    def gemm_rate(self, D: float, M: float) -> float:
        """Effective FLOP/s of the expert GEMMs at width D and M rows per expert: `flops` x `efficiency`
        x the bilinear interpolation in (log D, log M) of `gemm_table` (clamped at its edges), 1 if empty.
        Small GEMMs run below the large-square rate: the inner dimension D and the row count M
        set how well the BLAS micro-kernel's panels fill and how often each expert's weights are packed."""
        peak = float(self.flops) * float(self.efficiency)
        if not self.gemm_table:
            return peak
        import numpy as np

        Ds = sorted({d for d, _, _ in self.gemm_table})
        Ms = sorted({m for _, m, _ in self.gemm_table})
        rate = {(d, m): r for d, m, r in self.gemm_table}
        grid = np.array([[np.log(rate[(d, m)]) for m in Ms] for d in Ds])

        def axis(values: list[int], v: float) -> tuple[int, int, float]:
            lv = np.log(np.clip(v, values[0], values[-1]))
            j = int(np.clip(np.searchsorted(np.log(values), lv) - 1, 0, max(len(values) - 2, 0)))
            if len(values) == 1:
                return 0, 0, 0.0
            w = (lv - np.log(values[j])) / (np.log(values[j + 1]) - np.log(values[j]))
            return j, j + 1, float(w)

        i0, i1, wd = axis(Ds, D)
        j0, j1, wm = axis(Ms, M)
        top = grid[i0, j0] * (1 - wm) + grid[i0, j1] * wm
        bottom = grid[i1, j0] * (1 - wm) + grid[i1, j1] * wm
        return peak * float(np.exp(top * (1 - wd) + bottom * wd))

    def values(self) -> dict[str, float]:
        """Figures keyed by the symbol names of `cost_model.symbols`."""
        return {
            "R": float(self.flops),
            "eta": float(self.efficiency),
            "B_intra": float(self.intra_bw),
            "B_inter": float(self.inter_bw),
            "alpha": float(self.alpha),
            "b": float(self.bytes_per_element),
            "b_g": float(self.grad_bytes),
            "s": float(self.state_bytes),
            "c_layer": float(self.layer_overhead),
            "c_expert": float(self.expert_overhead),
            "c_row": float(self.row_cost),
            "c_act": float(self.act_cost),
            "c_restore": float(self.restore_cost),
            "c_page": float(self.page_cost),
            "c_route": float(self.route_cost),
            "r_c": float(self.recompute),
            "c_xb": float(self.xfer_byte_cost),
            "c_xc": float(self.xfer_call_cost),
            "c_wb": float(self.xfer_wait_byte_cost),
            "c_wc": float(self.xfer_wait_call_cost),
            "n_help": float(self.helper_threads),
            "n_core": float(self.cores),
            "c_plan": float(self.planner_cost),
            "c_plan_e": float(self.planner_entry_cost),
            **({} if self.allreduce_alpha is None else {"alpha_r": float(self.allreduce_alpha)}),
            **({} if self.allreduce_bw is None else {"B_r": float(self.allreduce_bw)}),
        }

    def sources(self) -> dict[str, str]:
        return {
            f.name: getattr(self, f.name).source
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Figure)
        }

    def with_figures(self, source: str, **figures: float | None) -> Hardware:
        """A copy with the non-None `figures` replaced, each marked as coming from `source`."""
        changes = {k: Figure(float(v), source) for k, v in figures.items() if v is not None}
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_ZERO = "ZeRO paper (Rajbhandari et al. 2020): 16 bytes/param for mixed-precision Adam"
_ASSUMED_ETA = "assumption, not measured: expert grouped GEMMs at half of peak"
_ASSUMED_ALPHA = "assumption, not measured: order of a small NCCL all-to-all across nodes"


def gpu_preset(name: str, device: str, flops: Figure, intra_bw: Figure, inter_bw: Figure, memory: Figure,
               alpha: Figure = Figure(30e-6, _ASSUMED_ALPHA), dtype: str = "bf16") -> Hardware:
    """A GPU (or NPU) preset: its own figures, and the assumptions every such preset shares: expert GEMMs at
    half of peak, 2-byte `dtype` activations and gradients, mixed-precision Adam state (ZeRO's 16 bytes)."""
    return Hardware(
        name=name, device=device, flops=flops, efficiency=Figure(0.5, _ASSUMED_ETA), intra_bw=intra_bw,
        inter_bw=inter_bw, alpha=alpha, memory=memory, bytes_per_element=Figure(2, f"{dtype} activations"),
        grad_bytes=Figure(2, f"{dtype} gradients"), state_bytes=Figure(16, _ZERO),
    )


A100 = gpu_preset(
    name="a100",
    device="A100-80GB (NVLink + InfiniBand)",
    flops=Figure(312e12, "NVIDIA A100 datasheet, dense bf16"),
    intra_bw=Figure(216.3e9, "LAER-MoE (ASPLOS'26) profiled NVLink, scenarios/laer_moe_fsep.json"),
    inter_bw=Figure(88.95e9, "LAER-MoE (ASPLOS'26) profiled InfiniBand 800 Gb/s, scenarios/laer_moe_fsep.json"),
    memory=Figure(80e9, "NVIDIA A100 datasheet (80 GB variant)"),
)

H100 = gpu_preset(
    name="h100",
    device="H100-SXM (NVLink 4 + InfiniBand NDR)",
    flops=Figure(989e12, "NVIDIA H100 SXM datasheet, dense bf16"),
    intra_bw=Figure(
        450e9 * NVLINK_EFFICIENCY, "NVLink 4 peak 450 GB/s per direction x LAER's A100 NVLink efficiency 0.72"
    ),
    inter_bw=Figure(50e9 * IB_EFFICIENCY, "one NDR 400 Gb/s NIC per GPU (50 GB/s) x LAER's InfiniBand efficiency 0.89"),
    memory=Figure(80e9, "NVIDIA H100 SXM datasheet"),
)

ASCEND_910A = gpu_preset(
    name="ascend910a",
    device="Ascend 910A (HCCS + RoCE)",
    flops=Figure(320e12, "scenarios/locmoe_locality.json (Ascend 910 fp16 peak)"),
    intra_bw=Figure(
        30e9 * NVLINK_EFFICIENCY,
        "HCCS 240 Gb/s = 30 GB/s per link (Ascend 910 public spec) x 0.72 (LAER NVLink efficiency); "
        "the PCIe hop between the two groups of 4 is not modelled",
    ),
    inter_bw=Figure(
        12.5e9 * IB_EFFICIENCY, "integrated 100 Gb/s RoCE per chip (12.5 GB/s) x 0.89 (LAER IB efficiency)"
    ),
    alpha=Figure(50e-6, "assumption, not measured: HCCL small all-to-all over RoCE"),
    memory=Figure(32e9, "Ascend 910 public spec: 32 GB HBM"),
    dtype="fp16",
)

_UNCALIBRATED = "uncalibrated conservative default (run `python -m moepass calibrate`)"


def this_machine(profile: str | os.PathLike[str] | dict[str, Any] | None = None) -> Hardware:
    """This machine's figures from a calibration profile (gloo, CPU): a file, or one held in memory (a dict as
    `cost_model.calibrate.calibrate` returns it); else uncalibrated defaults."""
    data: dict[str, Any] | None = None
    path: str | Path = "a profile in memory"  # where the figures come from, as their sources name it
    if isinstance(profile, dict):
        data = profile
    else:
        file = Path(profile) if profile is not None else DEFAULT_PROFILE
        path = file
        if file.is_file():
            data = json.loads(file.read_text())
    if data is None:
        if profile is not None:
            what = "is a folder, not a file" if Path(path).is_dir() else "not found"
            raise FileNotFoundError(f"calibration profile {path} {what}: give the JSON file "
                                    f"`python -m moepass calibrate --out FILE` wrote")
        return Hardware(
            name="this-machine",
            device="this machine (CPU, gloo loopback)",
            flops=Figure(2e9, _UNCALIBRATED),
            efficiency=Figure(1.0, "the default FLOP/s is already an effective figure"),
            intra_bw=Figure(2e8, _UNCALIBRATED),
            inter_bw=Figure(2e8, _UNCALIBRATED),
            alpha=Figure(2e-4, _UNCALIBRATED),
            memory=Figure(8e9, _UNCALIBRATED),
            bytes_per_element=Figure(4, "fp32 on CPU"),
            grad_bytes=Figure(4, "fp32 on CPU"),
            state_bytes=Figure(16, "fp32 Adam: weights, grads, 2 moments"),
            calibrated=False,
        )
    src = f"calibrated {data.get('created', '?')} ({path})"
    host = {
        key: Figure(data[key], f"{src}: {what}") if key in data else Figure(0.0, f"not in the profile ({path})")
        for key, what in (
            ("layer_overhead", "2-rank EP layer at vanishing size, intercept minus 5 alpha"),
            ("expert_overhead", "expert FFN kernel beyond its GEMMs, slope per local expert"),
            ("row_cost", "permute/unpermute/combine chain fwd+bwd, slope per routed element"),
            ("act_cost", "expert FFN kernel beyond its GEMMs, slope per hidden element"),
            ("restore_cost", "FSEP restore re-layout fwd + restore again + gradient slices, slope per element"),
            ("page_cost", "fresh 64 MiB buffer fill minus a touched one's, per minor page fault"),
            ("route_cost", "router gate GEMM + moe.route forward and backward, slope per token"),
            ("xfer_byte_cost", "all-to-alls between matmuls on every rank: helper-thread CPU, slope per byte sent"),
            ("xfer_call_cost", "all-to-alls between matmuls on every rank: helper-thread CPU, intercept per call"),
            ("xfer_wait_byte_cost", "the same loop's wall gain minus the link time, slope per byte sent"),
            ("xfer_wait_call_cost", "the same loop's wall gain minus the link time, intercept per call"),
            ("helper_threads", "threads besides the main one that burned CPU during those all-to-alls"),
            ("planner_cost", "FSEP planner solves on random counts: thread CPU, intercept per solve"),
            ("planner_entry_cost", "FSEP planner solves on random counts: thread CPU, slope per [W, E] entry"),
        )
    }
    return Hardware(
        name="this-machine",
        device=f"this machine ({data.get('backend', 'gloo')}, W={data.get('world_size', 2)})",
        flops=Figure(data["flops"], src + ": fp32 matmul fit"),
        efficiency=Figure(1.0, "calibrated FLOP/s are already effective"),
        intra_bw=Figure(data["bandwidth"], src + ": all_to_all_single fit (loopback: intra = inter)"),
        inter_bw=Figure(data["bandwidth"], src + ": all_to_all_single fit (loopback: intra = inter)"),
        alpha=Figure(data["alpha"], src + ": all_to_all_single fit"),
        memory=Figure(data.get("memory", 8e9), src if "memory" in data else _UNCALIBRATED),
        bytes_per_element=Figure(4, "fp32 on CPU"),
        grad_bytes=Figure(4, "fp32 on CPU"),
        state_bytes=Figure(16, "fp32 Adam: weights, grads, 2 moments"),
        layer_overhead=host["layer_overhead"],
        expert_overhead=host["expert_overhead"],
        row_cost=host["row_cost"],
        act_cost=host["act_cost"],
        restore_cost=host["restore_cost"],
        page_cost=host["page_cost"],
        route_cost=host["route_cost"],
        xfer_byte_cost=host["xfer_byte_cost"],
        xfer_call_cost=host["xfer_call_cost"],
        xfer_wait_byte_cost=host["xfer_wait_byte_cost"],
        xfer_wait_call_cost=host["xfer_wait_call_cost"],
        helper_threads=host["helper_threads"],
        planner_cost=host["planner_cost"],
        planner_entry_cost=host["planner_entry_cost"],
        cores=Figure(data["cores"], f"{src}: the CPUs this process may run on (sched_getaffinity)") if "cores" in data
        else Figure(math.inf, f"not in the profile ({path})"),
        recompute=Figure(0.0, "moepass.grouped_ffn keeps the gate/up pre-activations for backward "
                              "(Plan.expert_recompute=True recomputes them: r_c = 1)"),
        gemm_table=tuple((int(g["D"]), int(g["M"]), float(g["efficiency"])) for g in data.get("gemm", ())
                         if "efficiency" in g),
        allreduce_alpha=Figure(data["allreduce_alpha"], f"{src}: gloo all_reduce fit") if "allreduce_alpha" in data
        else None,
        allreduce_bw=Figure(data["allreduce_bandwidth"], f"{src}: gloo all_reduce fit, bytes sent per s")
        if "allreduce_bandwidth" in data else None,
    )


PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (A100, H100, ASCEND_910A)}


PRESET_NAMES: tuple[str, ...] = (*PRESETS, "this-machine")


def preset(name: str, profile: str | os.PathLike[str] | None = None) -> Hardware:
    """A preset by name ('a100', 'h100', 'ascend910a', 'this-machine')."""
    if name == "this-machine":
        return this_machine(profile)
    if name not in PRESETS:
        from moepass.errors import nearest  # here: moepass imports this module while it initialises

        hint = nearest(name.lower(), PRESET_NAMES)
        raise ValueError(f"unknown hardware preset {name!r}: use one of {list(PRESET_NAMES)}, or a calibration "
                         f"profile path (.json){'.' + hint if hint else ''}")
    return PRESETS[name]


def is_profile_path(value: object) -> bool:
    """A calibration profile given by path (a `os.PathLike`, or a str ending in .json)."""
    return isinstance(value, os.PathLike) or (isinstance(value, str) and value.endswith(".json"))


def resolve_hardware(hardware: Hardware | str | os.PathLike[str] | None) -> Hardware:
    """The figures a compile-time decision prices with (`Plan.hardware`, `search(profile=...)`).

    None: the documented default, `this_machine()`: the calibration profile at `DEFAULT_PROFILE`
    (~/.cache/moepass/profile.json, written by `python -m moepass calibrate`) if present, else the
    uncalibrated CPU defaults. A preset name (`PRESET_NAMES`), a calibration profile path, or a
    `Hardware` are used as given.
    """
    if hardware is None:
        return this_machine()
    if isinstance(hardware, Hardware):
        return hardware
    if is_profile_path(hardware):
        return this_machine(hardware)
    if isinstance(hardware, str):
        return preset(hardware)
    raise TypeError(f"hardware={hardware!r} is invalid: use None, a preset name {list(PRESET_NAMES)}, "
                    f"a calibration profile path (.json) or a cost_model.presets.Hardware")


def for_device(device: str | None) -> Hardware | None:
    """The preset matching a device name from a scenario file ('A100-40GB', 'Ascend 910A', ...)."""
    key = (device or "").lower().replace(" ", "")
    for marker, hw in (("a100", A100), ("h100", H100), ("ascend910", ASCEND_910A)):
        if marker in key:
            return hw
    return None
