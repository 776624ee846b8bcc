"""One step of a case on the timeline of its busiest rank (`cost_model.timeline`), from a plan's layout
(`Layout`: the token rows, the parameter collectives, the extra per-layer work), and the memory per rank of a
layout (`memory_breakdown`). `cost_model.systems.price` turns a plan into a layout and calls these.

Shape letters: `moepass.spec.SHAPES` (here P: ranks as sources and as destinations).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_model import ep as ep_formulas
from cost_model.presets import Hardware
from cost_model.scenarios import Case
from cost_model.timeline import Timeline


@dataclass(frozen=True)
class ParamTraffic:
    """Per-layer parameter collectives of a layout whose weights are sharded (FSEP, FSDP+EP), in seconds:
    `gather_fwd` before the layer's forward, `gather_bwd` before its backward, `grads` after its backward
    expert compute (no expert all-reduce then); `depth` layers gathered ahead; `dense`: the dense weights
    travel with them (no dense all-reduce; the dense compute waits for the gather)."""

    gather_fwd: float
    gather_bwd: float
    grads: float
    depth: int
    dense: bool = False


@dataclass(frozen=True)
class ExpertGrads:
    """The expert gradient all-reduce of a layout that is not EP's: `nbytes` per rank over `replicas` ranks at
    `bandwidth` bytes/s."""

    nbytes: float
    replicas: int
    bandwidth: float


def allreduce_ops(tl: Timeline, name: str, nbytes: float, dp: int, B: float, v: dict[str, float], bucket_bytes: float,
                  deps: list[int]) -> None:
    """A gradient all-reduce on the "other" stream, in pieces of `bucket_bytes` (none over one rank)."""
    pieces, work = allreduce_work(nbytes, dp, B, v, bucket_bytes)
    if pieces:
        tl.add("other", f"{name}.ar", work, deps, pieces)


def allreduce_work(nbytes: float, dp: int, B: float, v: dict[str, float], bucket_bytes: float) -> tuple[int, float]:
    """(pieces, seconds) of a gradient all-reduce in pieces of `bucket_bytes` over a link of bandwidth `B`, at the
    figures `v` gives an all-reduce (`cost_model.ep.allreduce_figures`); (0, 0.0): none (one rank)."""
    pieces = ep_formulas.allreduce_calls(nbytes, dp, bucket_bytes)
    if not pieces:
        return 0, 0.0
    rate, alpha = ep_formulas.allreduce_figures(v, B)
    return pieces, pieces * ep_formulas.allreduce_time(nbytes / pieces, dp, rate, alpha)


def ring_half(nbytes: float, group: float, B: float, alpha: float) -> float:
    """An all-gather or a reduce-scatter of `nbytes` (the full tensor) over `group` ranks: half a ring all-reduce."""
    return 0.0 if group == 1 else alpha + (group - 1) * nbytes / (group * B)


def dense_flops(case: Case) -> float:
    """Forward FLOPs of a layer's dense part: the attention projections (4 D x D) and scores (seq x D)."""
    return float(ep_formulas.dense_flops(case.tokens, case.D, case.seq or 0))


@dataclass(frozen=True)
class Layout:
    """What the timeline needs of a plan: the token rows, the parameter traffic, the extra per-layer work."""

    rows_PP: np.ndarray  # [src, dst] routed rows of one all-to-all group
    params: ParamTraffic | None = None
    expert_grads: ExpertGrads | None = None
    dense_grad_bytes: float | None = None  # per rank (None: the case's dense parameters)
    dense_dp: int | None = None  # ranks the dense gradients are all-reduced over (None: W)
    tp_comm: float = 0.0  # seconds per layer and pass the compute waits for (TP's all-gathers / reduce-scatters)
    router_fwd: float = 0.0  # seconds of the gate GEMM per layer forward
    recompute: bool = False
    migration: float = 0.0  # seconds per layer of parameter moves on the "other" stream (amortised)
    split_exchange: bool = False  # dropless EP: the split sizes are exchanged (one small all-to-all) before the dispatch


@dataclass(frozen=True)
class LayerWork:
    """The per-layer figures `timeline_step` lays a step out from (seconds at full speed): the token exchange of
    one all-to-all chunk, the expert and dense compute of a layer's passes, the gradient all-reduces."""

    v: dict[str, float]  # the hardware figures (`Hardware.values`)
    ep: int
    dispatch: ep_formulas.ExactA2A  # the exact bytes of one dispatch
    t_a: float  # one dispatch or combine chunk (latency + its share of the transfer)
    rows_max: float
    expert_fwd: float
    expert_bwd: float
    dense_fwd: float
    ar_bw: float  # the gradient all-reduce's bandwidth
    expert_grads: ExpertGrads
    dense_grad: float  # bytes per rank
    dense_dp: int


def layer_work(case: Case, hw: Hardware, layout: Layout, chunks: int) -> LayerWork:
    """The figures of one layer of `case` under `layout` with the all-to-all in `chunks` (`LayerWork`)."""
    v = hw.values()
    W = case.nodes * case.per_node
    m = ep_formulas.matmuls(case.gated)
    rows_PP = layout.rows_PP
    ep = rows_PP.shape[0]
    dispatch = ep_formulas.exact_a2a(rows_PP, case.D, int(v["b"]), case.per_node)
    a2a_full = dispatch.time(v["B_intra"], v["B_inter"], v["alpha"]) if ep > 1 else 0.0
    transfer = max(0.0, a2a_full - v["alpha"]) if ep > 1 else 0.0
    rows_max = float(dispatch.computed_rows.max())
    rate = v["R"] * v["eta"]
    gemm_fwd = ep_formulas.expert_flops(rows_max, case.D, case.F, m) / rate
    # host-side work of a layer step (`cost_model.ep.host_time`: 0 unless calibrated), a third in the forward as
    # the GEMMs; the backward's GEMMs twice the forward's, plus the gate/up recomputed where the kernel does (r_c)
    host = ep_formulas.host_time(rows_max, case.D, case.F, case.E, ep, c_layer=v["c_layer"], c_expert=v["c_expert"],
                                 c_row=v["c_row"], c_act=v["c_act"], c_route=v["c_route"], tokens=case.tokens,
                                 routed=float(rows_PP.sum(axis=1).max()))
    ar_bw = v["B_inter"] if case.nodes > 1 else v["B_intra"]
    return LayerWork(
        v=v,
        ep=ep,
        dispatch=dispatch,
        t_a=v["alpha"] + transfer / chunks,
        rows_max=rows_max,
        expert_fwd=gemm_fwd + host / 3 + layout.router_fwd,
        expert_bwd=(2 + v["r_c"] * (m - 1) / m) * gemm_fwd + 2 * host / 3 + 2 * layout.router_fwd,
        dense_fwd=dense_flops(case) / rate,
        ar_bw=ar_bw,
        expert_grads=layout.expert_grads or ExpertGrads(
            ep_formulas.expert_params(case.E, case.D, case.F, m) / ep * v["b_g"], W // ep, ar_bw),
        dense_grad=case.dense_params * v["b_g"] if layout.dense_grad_bytes is None else layout.dense_grad_bytes,
        dense_dp=W if layout.dense_dp is None else layout.dense_dp,
    )


def step_floor(case: Case, hw: Hardware, layout: Layout, *, chunks: int, bucket_bytes: float) -> float:
    """A lower bound of `timeline_step`'s step, without laying it out. The compute stream runs one op at a time
    at full speed, and in each pass of a layer it waits, idle, for TP's collective, the split exchange and the
    first dispatch chunk (its experts need them) and for the last combine chunk (the next compute op needs it),
    each at most at full link speed: the step is at least that work and those waits. The two communication
    streams share the link (together at most full speed): the step is at least their work (the ops
    `timeline_step` lays out, summed per kind). A bound up to the rounding of the timeline's sums (relative
    ~1e-15): the plan search skips a plan whose floor is over its best step (`systems.fastest`)."""
    w = layer_work(case, hw, layout, chunks)
    v, params = w.v, layout.params
    recompute = w.dense_fwd + w.expert_fwd if layout.recompute else 0.0
    split = v["alpha"] if layout.split_exchange else 0.0
    waits = max(layout.tp_comm, 0.0) + (0.0 if w.ep == 1 else max(split, 0.0) + 2 * max(w.t_a, 0.0))
    compute = case.layers * (3 * w.dense_fwd + w.expert_fwd + w.expert_bwd + recompute + 2 * waits)
    per_pass = 0.0 if w.ep == 1 else 2 * chunks * max(w.t_a, 0.0) + split
    other = max(layout.migration, 0.0)
    if params is None:
        g = w.expert_grads
        other += allreduce_work(g.nbytes, g.replicas, g.bandwidth, v, bucket_bytes)[1]
    else:  # every layer's weights gathered once per pass, its gradients sent once
        other += max(params.gather_fwd, 0.0) + max(params.gather_bwd, 0.0) + max(params.grads, 0.0)
    if params is None or not params.dense:
        other += allreduce_work(w.dense_grad, w.dense_dp, w.ar_bw, v, bucket_bytes)[1]
    links = case.layers * (2 * (per_pass + max(layout.tp_comm, 0.0)) + other)
    return max(compute, links)


def timeline_step(case: Case, hw: Hardware, layout: Layout, *, chunks: int, policy: str,
                  bucket_bytes: float) -> tuple[Timeline, dict[str, float]]:
    """Lay out one step of `case` under `layout` (`layer_work`'s figures); returns the run timeline and the
    per-layer figures."""
    w = layer_work(case, hw, layout, chunks)
    v, ep, dispatch, t_a, rows_max = w.v, w.ep, w.dispatch, w.t_a, w.rows_max
    expert_fwd, expert_bwd, dense_fwd, ar_bw = w.expert_fwd, w.expert_bwd, w.dense_fwd, w.ar_bw
    expert_grads, dense_grad, dense_dp = w.expert_grads, w.dense_grad, w.dense_dp
    rows_PP = layout.rows_PP
    params = layout.params

    def moe(prefix: str, compute: float, after: int, weights: list[int]) -> list[int]:
        """Chunked dispatch -> expert compute -> combine; issue order d1 d2 c1 d3 c2 ... (schedule.py)."""
        if ep == 1:
            return [tl.add("compute", f"{prefix}.experts", compute, [after, *weights])]
        exp: list[int] = []
        comb: list[int] = []
        if layout.split_exchange:
            after = tl.add("a2a", f"{prefix}.splits", v["alpha"], [after])
        disp = [tl.add("a2a", f"{prefix}.dispatch0", t_a, [after])]
        for j in range(chunks):
            exp.append(tl.add("compute", f"{prefix}.experts{j}", compute / chunks, [disp[j], *weights] + exp[-1:]))
            if j + 1 < chunks:
                disp.append(tl.add("a2a", f"{prefix}.dispatch{j + 1}", t_a, [after]))
            comb.append(tl.add("a2a", f"{prefix}.combine{j}", t_a, [exp[j]]))
        return comb + exp

    def tp(prefix: str, after: int) -> int:
        """TP's collectives of a pass, waited by the compute (on the token link: intra-node)."""
        if layout.tp_comm <= 0:
            return after
        return tl.add("a2a", f"{prefix}.tp", layout.tp_comm, [after])

    tl = Timeline()
    gathered: dict[tuple[str, int], int] = {}

    def gather(phase: str, layer: int, deps: list[int]) -> None:
        if params is not None and 0 <= layer < case.layers:
            work = params.gather_fwd if phase == "fwd" else params.gather_bwd
            gathered[(phase, layer)] = tl.add("other", f"L{layer}.{phase}.gather", work, deps)

    def weights(phase: str, layer: int) -> list[int]:
        return [gathered[(phase, layer)]] if (phase, layer) in gathered else []

    depth = params.depth if params is not None else 0
    last = tl.add("compute", "start", 0.0)
    for layer in range(depth + 1):
        gather("fwd", layer, [last])
    dense_first = params is not None and params.dense
    for layer in range(case.layers):
        dense = tl.add("compute", f"L{layer}.fwd.dense", dense_fwd,
                       [last, *(weights("fwd", layer) if dense_first else [])])
        dense = tp(f"L{layer}.fwd", dense)
        done = moe(f"L{layer}.fwd", expert_fwd, dense, [] if dense_first else weights("fwd", layer))
        gather("fwd", layer + depth + 1, done)
        last = tl.add("compute", f"L{layer}.fwd.end", 0.0, done)
    for layer in reversed(range(case.layers - depth - 1, case.layers)):
        gather("bwd", layer, [last])
    for layer in reversed(range(case.layers)):
        if layout.recompute:  # the layer's forward again, from its kept input (token rows cached)
            last = tl.add("compute", f"L{layer}.bwd.recompute", dense_fwd + expert_fwd, [last])
        done = moe(f"L{layer}.bwd", expert_bwd, last, weights("bwd", layer))
        if params is None:
            allreduce_ops(tl, f"L{layer}.expert_grads", expert_grads.nbytes, expert_grads.replicas, expert_grads.bandwidth,
                          v, bucket_bytes, done)
        else:
            gather("bwd", layer - depth - 1, done)
            tl.add("other", f"L{layer}.grads", params.grads, done)
        if layout.migration > 0:
            tl.add("other", f"L{layer}.migration", layout.migration, done)
        last = tl.add("compute", f"L{layer}.bwd.dense", 2 * dense_fwd, done)
        last = tp(f"L{layer}.bwd", last)
        if params is None or not params.dense:
            allreduce_ops(tl, f"L{layer}.dense_grads", dense_grad, dense_dp, ar_bw, v, bucket_bytes, [last])
    tl.run(policy)
    busiest = float((dispatch.sent + dispatch.transposed().sent).max()) if ep > 1 else 0.0  # dispatch + combine
    recomputed = (dense_fwd + expert_fwd) if layout.recompute else 0.0
    return tl, {
        "expert_fwd": expert_fwd,
        "dense_fwd": dense_fwd,
        "dense_compute": case.layers * (3 * dense_fwd + (dense_fwd if layout.recompute else 0.0)),
        "recompute": case.layers * recomputed,
        "token_a2a_bytes": case.layers * 2 * busiest,  # forward and backward
        "rows_max": rows_max,
        "imbalance": rows_max / max(float(rows_PP.sum()) / ep, 1e-30),
    }


def breakdown_of(tl: Timeline, figures: dict[str, float]) -> dict[str, float]:
    """A simulated step's figures: expert vs dense compute, exposed and busy communication."""
    b = tl.breakdown()
    dense = figures["dense_compute"]
    return {
        "expert_compute": b["compute"] - dense,
        "dense_compute": dense,
        "exposed_a2a": b["exposed_a2a"],
        "exposed_other": b["exposed_other"],
        "a2a_busy": b["a2a_busy"],
        "other_busy": b["other_busy"],
        "max_a2a_wait": b["max_a2a_wait"],
        "imbalance": figures["imbalance"],
        "token_a2a_bytes": figures["token_a2a_bytes"],
        "recompute": figures["recompute"],
    }


# ---- memory ------------------------------------------------------------------------------------------------


def state_bytes(params: float, v: dict[str, float], shard: float) -> float:
    """Bytes of `params` parameters with their gradients and optimizer state (s per parameter), the optimizer
    state (s - b - b_g: fp32 master and Adam moments) sharded over `shard` ranks (1: replicated)."""
    rest = v["s"] - v["b"] - v["b_g"]
    return params * (v["b"] + v["b_g"] + rest / shard)


def activation_bytes(case: Case, rows: float, b: float) -> float:
    """Activations one MoE layer keeps for backward (`cost_model.ep.memory_per_rank` without weights)."""
    return float(ep_formulas.memory_per_rank(0, 1, case.D, case.F, ep_formulas.matmuls(case.gated), 0, rows, b))


def memory_breakdown(case: Case, v: dict[str, float], *, expert_params: float, expert_dp: float, dense_params: float,
                     dense_dp: int, rows_max: float, sharded_optimizer: bool, recompute: bool,
                     buffers: float = 0.0, fully_sharded: bool = False) -> dict[str, float]:
    """Bytes per rank by part. `expert_params` / `dense_params`: the parameters one rank owns over all layers
    (already divided by EP / TP / FSDP); `expert_dp` / `dense_dp`: the ranks that hold copies of them (the
    optimizer state shards over them when `sharded_optimizer`); `fully_sharded`: the parameters themselves
    are shards (FSDP, FSEP: no further sharding); `buffers`: gathered / restored weights in flight."""
    if fully_sharded:
        states = (expert_params + dense_params) * v["s"]
    else:
        states = (state_bytes(expert_params, v, expert_dp if sharded_optimizer else 1)
                  + state_bytes(dense_params, v, dense_dp if sharded_optimizer else 1))
    per_layer = activation_bytes(case, rows_max, v["b"])
    if recompute:  # each layer's input kept; one layer's activations alive while it is recomputed
        acts = case.layers * case.tokens * case.D * v["b"] + per_layer
    else:
        acts = case.layers * per_layer
    total = states + acts + buffers
    return {"weights+grads+optimizer": states, "activations": acts, "buffers": buffers, "total": total}
