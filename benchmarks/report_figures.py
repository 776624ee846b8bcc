"""What `benchmarks/report.py` reads from each benchmark's JSON: the figures (ratios with their median,
range and basis), the goals the issues state, and one extractor per benchmark (JSON -> figures, notes).

Every figure is a ratio of two systems measured side by side in the same run (the benchmark's own
interleaved rounds, launches or steps) or a share of one step; `Figure.basis` says which samples the
median and range are over. A ratio whose per-round samples the JSON does not keep is the ratio of the
medians, with no range (and says so). Extractors read only what the benchmarks write: a missing key is
reported as missing in the section, never filled in.
"""

from __future__ import annotations

import operator
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

COMPARE = {"<": operator.lt, "<=": operator.le, ">=": operator.ge, ">": operator.gt}


@dataclass(frozen=True)
class Goal:
    """A target an issue states: met when `value op target` (op one of COMPARE)."""

    text: str
    op: str
    target: float

    def __post_init__(self):
        if self.op not in COMPARE:
            raise ValueError(f"Goal({self.text!r}): op={self.op!r} is not one of {list(COMPARE)}")

    def met(self, value: float) -> bool:
        return bool(COMPARE[self.op](value, self.target))

    def normalised(self, value: float) -> float:
        """value / target for an upper bound, target / value for a lower bound: <= 1 means met (< 1 for
        a strict bound)."""
        return value / self.target if self.op.startswith("<") else self.target / value


@dataclass(frozen=True)
class Figure:
    """One measured figure: median and range (lo, hi) over n samples taken side by side."""

    label: str
    median: float
    lo: float | None = None
    hi: float | None = None
    n: int | None = 1  # None: the JSON does not say over how many samples
    basis: str = ""
    unit: str = "×"
    goal: Goal | None = None

    def value(self, x: float | None) -> str:
        if x is None:
            return "—"
        if self.unit == "%":
            return f"{100 * x:.1f} %"
        return f"{x:.3g}{self.unit}" if self.unit in ("×", "") else f"{x:.3g} {self.unit}"

    def range(self) -> str:
        return "—" if self.lo is None or self.hi is None else f"{self.value(self.lo)} – {self.value(self.hi)}"

    def met(self) -> str:
        return "—" if self.goal is None else ("yes" if self.goal.met(self.median) else "**no**")


def per_round(label: str, a: Sequence[float], b: Sequence[float], basis: str, **kw) -> Figure:
    """The ratio a_i / b_i of samples taken side by side (round i of both): median and range."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{label}: {len(a)} and {len(b)} samples do not pair up")
    r = [x / y for x, y in zip(a, b)]
    return Figure(label, statistics.median(r), min(r), max(r), len(r), basis, **kw)


def stats(label: str, values: Sequence[float], basis: str, **kw) -> Figure:
    return Figure(label, statistics.median(values), min(values), max(values), len(values), basis, **kw)


def from_stats(label: str, s: dict, basis: str, **kw) -> Figure:
    """A {median, min, max[, n]} record as the benchmark wrote it."""
    return Figure(label, s["median"], s.get("min"), s.get("max"), s.get("n"), basis, **kw)


# --------------------------------------------------------------------------------------------------
# Goals the issues state (issue number, what, target).
# --------------------------------------------------------------------------------------------------

G12_FLOOR = Goal("issue 12: fwd+bwd ≤ 1.2× the compute floor", "<=", 1.2)
G12_TEP = Goal("issue 12: faster than transformers' EP (< 1×)", "<", 1.0)
G12_FILL = Goal("issue 12: allocation/zero-fill ≤ 5 % of the step", "<=", 0.05)
G14_BALANCE = Goal("issue 14: FSEP max/mean load ≤ 1.15", "<=", 1.15)
G14_SKEW = Goal("issue 14: FSEP ≥ 1.2× faster than EP under skew", ">=", 1.2)
G14_BALANCED = Goal("issue 14: FSEP within 10 % of EP when balanced", "<=", 1.1)
G15_HP = Goal("issue 15: HP ≥ 1.3× faster than EP at K=8", ">=", 1.3)
G15_FLAT = Goal("issue 15: HP bytes per rank flat in K", "<=", 1.0)
G15_SHARE = Goal("issue 15: EP all-to-all ≥ 25 % of its step at K=2 (the link's setting)", ">=", 0.25)
G15_QUALITY = Goal("issue 15: converted loss within 3 % of the original's", "<=", 1.03)
G16_BYTES = Goal("issue 16: inter-node bytes ≤ 0.6× the switch router's", "<=", 0.6)
G16_LOSS = Goal("issue 16: final held-out loss within 2 %", "<=", 1.02)
G18_LINA = Goal("issue 18: Lina ≥ 1.2× faster than plain EP + DDP", ">=", 1.2)
G18_SHARE = Goal("issue 18: all-to-all ≥ 25 % of the plain step", ">=", 0.25)
G18_OVERLAP = Goal("issue 18: ≤ 1 all-reduce micro-op overlaps any all-to-all", "<=", 1.0)
G31_WORST = Goal("issue 31: every configuration's |predicted / measured - 1| ≤ 15 %", "<=", 0.15)

# --------------------------------------------------------------------------------------------------
# Extractors: a benchmark's JSON -> (figures, notes). The first figure is the one the summary shows
# when none has a goal.
# --------------------------------------------------------------------------------------------------

Extracted = tuple[list[Figure], list[str]]
ERROR_LINE = re.compile(r"\b\w*(?:Error|Exception): \S.*")


def failed_launches(failures: Sequence[dict]) -> list[str]:
    """One note per failed launch: which, and the last error line of its log (the log stays in the JSON)."""
    notes = []
    for f in failures:
        errors = [m.group(0) for m in ERROR_LINE.finditer(f.get("log", ""))]
        notes.append(f"launch {f.get('launch', f.get('system'))} (round {f.get('round')}, attempt {f.get('attempt')}) "
                     "failed: "
                     + (errors[-1] if errors else "see its log in the JSON 'failures'"))
    return notes


def ep_layer(doc: dict) -> Extracted:
    figs, notes = [], []
    for workload, per_w in doc["results"].items():
        w1 = per_w.get("W1", {}).get("systems", {})
        for world, entry in per_w.items():
            systems = entry["systems"]
            mine = systems["moepass"]["fwd_bwd"]
            basis = "launches, system and floor timed in the same launch"
            goal = G12_FLOOR if workload == "issue" else None
            figs.append(per_round(f"{workload} {world} fwd+bwd: moepass / floor", mine["launch_medians_ms"],
                                  mine["floor_own_launches"]["launch_medians_ms"], basis, goal=goal))
            if "transformers_ep" in systems:
                figs.append(per_round(f"{workload} {world} fwd+bwd: moepass / transformers' EP",
                                      mine["launch_medians_ms"],
                                      systems["transformers_ep"]["fwd_bwd"]["launch_medians_ms"],
                                      "interleaved launches (same round)",
                                      goal=G12_TEP if workload == "issue" else None))
            if "original" in w1:
                figs.append(per_round(f"{workload} {world} fwd+bwd: moepass / original at W=1",
                                      mine["launch_medians_ms"], w1["original"]["fwd_bwd"]["launch_medians_ms"],
                                      "interleaved launches (same round)" + ("; ideal 0.5" if world == "W2" else "")))
    notes.append(f"{doc.get('rounds')} round(s) of interleaved launches; quick: {doc.get('quick')}")
    notes += failed_launches(doc.get("failures", []))
    return figs, notes


def ep_step(doc: dict) -> Extracted:
    figs = []
    for workload, systems in doc["results"].items():
        mine = systems["moepass_ep"]["launch_medians_s"]
        for other in ("transformers_ep", "original_2t", "original_1t"):
            if other in systems:
                figs.append(per_round(f"{workload}: moepass EP / {other}", mine, systems[other]["launch_medians_s"],
                                      "interleaved launches (same round)"))
    notes = [f"{doc.get('launches_per_system')} launch(es) per system, {doc.get('timed_steps')} timed steps each"]
    notes += failed_launches(doc.get("failures", []))
    return figs, notes


def schedule(doc: dict) -> Extracted:
    figs, notes = [], []
    plain, lina = doc["plain"], doc["lina"]
    figs.append(Figure("step time: plain EP + DDP / Lina", doc["speedup_plain_over_lina"], n=doc["config"]["rounds"],
                       basis="ratio of the medians over interleaved rounds (per-round ratios not in the JSON)",
                       goal=G18_LINA))
    figs.append(from_stats("all-to-all share of the plain step", plain["a2a_share"], "steps", unit="%",
                           goal=G18_SHARE))
    figs.append(Figure("most all-reduce micro-ops overlapping one all-to-all (Lina)",
                       lina["max_allreduce_per_a2a"], n=None, basis="the maximum over every step", unit="",
                       goal=G18_OVERLAP))
    for mode in ("plain", "lina"):
        alone, shared = doc[mode].get("a2a_s_alone"), doc[mode].get("a2a_s_with_allreduce")
        if alone and shared:
            figs.append(Figure(f"{mode}: all-to-all with / without a concurrent all-reduce",
                               shared["median"] / alone["median"], n=None, basis="ratio of the medians (event log)"))
    link = doc.get("link_settings", {})
    notes.append("link: " + ", ".join(f"{k} {v}" for k, v in link.items() if k in ("layout", "rate", "qdisc", "limited"))
                 if link else "link settings: not in the JSON")
    return figs, notes


def fsep(doc: dict) -> Extracted:
    figs, notes = [], []
    for tokens, block in doc["by_tokens"].items():
        for scenario, res in block["results"].items():
            steps = {s: v["round_medians_ms"] for s, v in res["step_ms"].items()}
            basis = "interleaved rounds (fsep, ep, fsdp, floor)"
            if scenario == "balanced":
                figs.append(per_round(f"{tokens} balanced: FSEP / EP step", steps["fsep"], steps["ep"], basis,
                                      goal=G14_BALANCED))
            else:
                figs.append(per_round(f"{tokens} {scenario}: EP / FSEP step", steps["ep"], steps["fsep"], basis,
                                      goal=G14_SKEW))
                figs.append(from_stats(f"{tokens} {scenario}: FSEP max/mean rows per device",
                                       res["max_over_mean"]["fsep"], "steps", goal=G14_BALANCE))
                figs.append(from_stats(f"{tokens} {scenario}: EP max/mean rows per device",
                                       res["max_over_mean"]["ep"], "steps (same counts)"))
            if "fsdp" in steps:
                figs.append(per_round(f"{tokens} {scenario}: FSDP / FSEP step", steps["fsdp"], steps["fsep"], basis))
            memory = res.get("memory_per_layer", {}).get("measured/formula")
            if memory is not None:
                notes.append(f"{tokens} {scenario}: FSEP parameter memory measured / formula = {memory:.4g}")
    notes.append(f"{doc.get('rounds')} round(s) x {doc.get('steps_per_round')} steps; quick: {doc.get('quick')}")
    return figs, notes


def hp(doc: dict) -> Extracted:
    figs, notes = [], []
    for k, entry in doc["per_k"].items():
        r = entry["ratio_ep_over_hp"]
        figs.append(Figure(f"K={k}: EP / HP step (limited link)", r["median_of_medians"], r["min"], r["max"],
                           len(r["per_round"]), "ratio of the round medians; range of the per-round ratios",
                           goal=G15_HP if int(k) == 8 else None))
        if entry.get("ratio_ep_over_hp_unlimited") is not None:
            figs.append(Figure(f"K={k}: EP / HP step (no limit)", entry["ratio_ep_over_hp_unlimited"],
                               n=doc.get("rounds", 1), basis="ratio of the medians"))
    goals = doc.get("goals", {})
    if "hp_token_bytes_max_over_min_across_k" in goals:
        figs.append(Figure("HP token bytes per rank, max / min over K", goals["hp_token_bytes_max_over_min_across_k"],
                           basis="bytes counted per step", goal=G15_FLAT))
    if "ep_a2a_in_flight_share_at_k2" in goals:
        figs.append(Figure("EP all-to-all in flight, share of its step at K=2", goals["ep_a2a_in_flight_share_at_k2"],
                           basis="event log", unit="%", goal=G15_SHARE))
    notes.append(f"network namespaces: {doc.get('netns')}; valid measurement: {doc.get('valid_measurement')}")
    return figs, notes


def hp_quality(doc: dict) -> Extracted:
    figs = [Figure(f"{setting}: held-out loss converted / original", entry["ratio"],
                   basis=f"final held-out loss after {doc['train']['steps']} steps, trained side by side",
                   goal=G15_QUALITY if setting == "default" else None)
            for setting, entry in doc["converted"].items()]
    return figs, [f"mode: {doc.get('mode')}"]


def locality(doc: dict) -> Extracted:
    figs, notes = [], []
    for data, block in doc["by_data"].items():
        rec = block["records"]
        half = len(rec["switch"]) // 2
        loc = [sum(r["inter_bytes"]) for r in rec["locality"][half:]]
        sw = [sum(r["inter_bytes"]) for r in rec["switch"][half:]]
        domain = data == "domain"
        figs.append(per_round(f"{data}: inter-node bytes locality / switch", loc, sw,
                              "steps of the second half (both systems on the same batch, step by step)",
                              goal=G16_BYTES if domain else None))
        figs.append(Figure(f"{data}: final held-out loss locality / switch", block["heldout_loss_ratio"],
                           basis="held-out loss after the last step", goal=G16_LOSS if domain else None))
        figs.append(per_round(f"{data}: step time locality / switch",
                              [r["step_s"] for r in rec["locality"][half:]], [r["step_s"] for r in rec["switch"][half:]],
                              "steps of the second half"))
    notes.append(f"network namespaces: {doc.get('netns')}; valid measurement: {doc.get('valid_measurement')}; "
                 f"{doc.get('sizes', {}).get('steps')} steps")
    return figs, notes


def cost_fidelity(doc: dict) -> Extracted:
    pred = [c["predicted"]["step_s"] for c in doc["configs"]]
    meas = [c["measured"]["step_s"] for c in doc["configs"]]
    forms = ", ".join(doc.get("by_form", {})) or "EP"
    worst = max(abs(c["rel_error"]) for c in doc["configs"])
    figs = [per_round(f"predicted / measured step ({forms})", pred, meas, "configurations (measured interleaved)"),
            Figure("worst |relative error|", worst, n=len(pred), basis="configurations", unit="%", goal=G31_WORST),
            Figure("Spearman rank correlation predicted vs measured", doc["spearman"], n=len(pred),
                   basis="configurations", unit=""),
            Figure("median |relative error|", doc["median_abs_rel_error"], n=len(pred), basis="configurations",
                   unit="%")]
    return figs, [f"calibration: {doc.get('profile')} (created {doc.get('profile_created')})"]


def kernel_bytes(doc: dict) -> Extracted:
    rows = doc["results"]
    figs = [stats("unfused reference / generated kernel bytes, all ops", [r["reference_over_kernel"] for r in rows],
                  "ops x configs (analytic counts)")]
    figs += [Figure(f"{r['config']} {r['op']}: reference / kernel bytes", r["reference_over_kernel"],
                    basis="analytic counts") for r in rows]
    return figs, ["analytic: bytes counted, not timed (the reference is a lower bound, see the benchmark)"]


def kernels(doc: dict) -> Extracted:
    timing, figs = doc["timing"], []
    notes = [f"GPU timing ran on {timing.get('device')}" if timing["ran"] else f"GPU timing not run: {timing.get('reason')}"]
    for shape in doc["shapes"]:
        for k in shape["kernels"]:
            fraction = k.get("measured", {}).get("roofline_fraction", {})
            for hw, f in fraction.items():
                figs.append(Figure(f"{shape['name']} {k['pass']} {k['kernel']}: roofline / measured time ({hw})", f,
                                   basis="triton.testing.do_bench"))
    if not figs:
        notes.append("analytic FLOPs/bytes and roofline times only (in the JSON)")
    return figs, notes


def fsep_planner(doc: dict) -> Extracted:
    figs = []
    for c in doc["configs"]:
        tag = f"W={c['W']} E={c['E']} C={c['C']}"
        mom = c["max_over_mean"]
        figs.append(Figure(f"{tag}: EP / planner max-over-mean rows", mom["ep"]["median"] / mom["planner"]["median"],
                           n=c["runs"], basis="ratio of the medians over runs (same counts)"))
        figs.append(from_stats(f"{tag}: planner max/mean rows per device", {**mom["planner"], "n": c["runs"]}, "runs"))
        figs.append(Figure(f"{tag}: plan() solve time", 1e3 * c["solve_s"]["median"], 1e3 * c["solve_s"]["min"],
                           1e3 * c["solve_s"]["max"], c["runs"], "runs", unit="ms"))
        pricing = c.get("pricing_both_candidates_s")
        if pricing:
            figs.append(Figure(f"{tag}: pricing after / before (route_totals / dense)",
                               pricing["after_route_totals"]["median"] / pricing["before_dense_S"]["median"],
                               n=c["runs"], basis="ratio of the medians (same tables)"))
    return figs, []


def expert_profile(doc: dict) -> Extracted:
    figs = [Figure("allocation / zero-fill share of the step", doc["alloc_fill_share"], n=doc["layer"]["steps"],
                   basis="torch.profiler self CPU time", unit="%", goal=G12_FILL),
            Figure("GEMM share of the step", doc["gemm_share"], n=doc["layer"]["steps"],
                   basis="torch.profiler self CPU time", unit="%")]
    return figs, [f"step {doc['step_ms']:.1f} ms (1 thread, load {doc.get('load1')})"]


def compile_time(doc: dict) -> Extracted:
    figs, notes = [], []
    by_style: dict[str, list[dict]] = {}
    for run in doc["runs"]:
        by_style.setdefault(run["config"]["style"], []).append(run)
    for style, runs in by_style.items():
        runs.sort(key=lambda r: r["config"]["layers"])
        small, large = runs[0], runs[-1]
        if large is not small:
            layers = large["config"]["layers"] / small["config"]["layers"]
            figs.append(Figure(f"{style}: total time per layer, {large['config']['layers']} / "
                               f"{small['config']['layers']} layers", large["total_seconds"] / small["total_seconds"]
                               / layers, basis="one process, sizes measured in turn; 1 = linear in layers"))
        figs.append(Figure(f"{style}: compile inplace / with copy ({large['config']['layers']} layers)",
                           large["compile_inplace_seconds_given_report"] / large["compile_seconds_given_report"],
                           n=large["repeats"], basis="min over repeats, same process"))
        c = large["config"]
        notes.append(f"{style}: {c['layers']} layers x {c['experts']} experts, D={c['dim']}: detect "
                     f"{large['detect_seconds']:.2f} s, total {large['total_seconds']:.2f} s")
    return figs, notes


EXTRACTORS: dict[str, Callable[[dict], Extracted]] = {
    "compile_time": compile_time, "ep_layer": ep_layer, "ep_step": ep_step, "schedule": schedule, "fsep": fsep,
    "hp": hp, "hp_quality": hp_quality, "locality": locality, "cost_fidelity": cost_fidelity,
    "kernel_bytes": kernel_bytes, "kernels": kernels, "fsep_planner": fsep_planner, "expert_profile": expert_profile,
}
