"""The cost model's references priced by hand, shared by tests/test_cost_model*.py:
a block's spec from its sizes (`spec`), FSEP's step and memory from the runtime planner's table
(`fsep_by_hand`), HP's from the converted block's sizes (`hp_by_hand`, `latent_by_hand`, `fine_grained`)."""

from __future__ import annotations

import numpy as np

from moepass.spec import ExpertsSpec, MoESpec, RouterSpec, TensorSource


def spec(E: int, K: int, D: int, F: int, gated: bool = True) -> MoESpec:
    return MoESpec(
        path="block",
        recogniser="test",
        router=RouterSpec(num_experts=E, top_k=K),
        experts=ExpertsSpec(
            num_experts=E,
            hidden_dim=D,
            ffn_dim=F,
            activation="swiglu" if gated else "gelu",
            w_up=TensorSource.param("experts.w_up") if gated else None,
        ),
    )


# ---- FSEP ---------------------------------------------------------------------------------------
#
# Expected FSEP figures are priced by hand here from the runtime planner's table (`placement.plan`, the
# model FSEP's advantage comes from) and TECHNIQUES.md §2: the busiest device's rows, the token
# all-to-all's slowest rank, the restore (C*S_e/W elements per pair) and the gradient slices back.

MIXTRAL_8 = [spec(8, 2, 4096, 14336)] * 8  # compute-heavy: the expert GEMMs dwarf every transfer


def fsep_by_hand(counts_WE: np.ndarray, hw, *, C: int, G: int, D: int, F: int, m: int, layers: int,
                 n: int = 1) -> tuple[float, float]:
    """(step seconds, memory bytes per rank) of FSEP over the W ranks of `counts_WE` [W, E] (integers,
    the same every step), `layers` blocks of one shape, token all-to-all in n chunks."""
    from moepass.runtime import placement

    v = hw.values()
    assert v["c_layer"] == v["c_expert"] == v["c_row"] == v["c_act"] == v["r_c"] == 0  # no host terms to price
    W, E = counts_WE.shape
    config = placement.PlannerConfig.from_hardware(hw, E=E, W=W, C=C, ranks_per_node=G, D=D, F=F, gated=m == 3)
    table = placement.plan(counts_WE * config.history, config).table
    slots = placement.lite_route_counts(counts_WE, table).numpy()  # [source, W*C slots]
    rows = slots.reshape(W, W, C).sum(axis=2)  # [source, device]
    assert (rows.sum(axis=1) == counts_WE.sum(axis=1)).all()
    busiest = rows.sum(axis=0).max()
    per_row = 2 * m * D * F / (v["R"] * v["eta"])  # forward seconds per routed row
    fwd = busiest * per_row
    node = np.arange(W) // G
    link = [v["B_intra"] if node[i] == node[k] else v["B_inter"] for i in range(W) for k in range(W)]
    secs = np.where(np.eye(W, dtype=bool), 0.0, rows * D * v["b"] / np.reshape(link, (W, W)))  # per pair
    transfer = max(secs.sum(axis=1).max(), secs.sum(axis=0).max())  # the slowest sender or receiver

    def pipeline(compute: float) -> float:  # n chunks: transfer j+1 behind compute j (issue order d0 d1 c0 d2 c1 ..)
        t_a, t_c = v["alpha"] + transfer / n, compute / n
        return max(2 * t_a + n * t_c, 2 * (n - 1) * t_a + min(n, 2) * t_c, 2 * n * t_a)

    a2a = pipeline(fwd) + pipeline(2 * fwd) - 3 * fwd + v["alpha"]  # + the split-size exchange
    S_e = m * D * F
    per_pair = C * S_e / W
    def exchange(b: float) -> float:
        return v["alpha"] + per_pair * b * ((G - 1) / v["B_intra"] + (W - G) / v["B_inter"])

    # the restore and the restore again in the backward (Plan.keep_restored=False); the gradient slices back:
    # waited at once in the first block, deferred behind the earlier layer's backward expert compute (2 fwd)
    # in the others (Plan.defer_expert_grads=True)
    restores = 2 * exchange(v["b"])
    t_g = exchange(v["b_g"])
    step = layers * (3 * fwd + a2a + restores) + t_g + (layers - 1) * max(0.0, t_g - 2 * fwd)
    memory = layers * (E * S_e / W * v["s"] + busiest * (2 * D + m * F) * v["b"]) + (
        C * S_e * (v["b"] + 3 * v["b_g"]))  # one layer's restored experts and gradients (+ the deferred buffers)
    return step, memory



# ---- HP -----------------------------------------------------------------------------------------
#
# Expected HP figures are priced by hand from TECHNIQUES.md §3 and the rewrite (moepass/rewrite/hp.py):
# the converted block from the equal-active-parameter rule (moepass/rewrite/latent.py's formula, written
# out again here), T*H*K expert rows of width h on every rank, w_in and w_out 2*T*D*Q FLOPs each, the
# routers 2*T*Q*E, four unchunked equal exchanges of T*Q/P elements to each peer, and the gradient
# all-reduces (head parameters over W/P replicas, w_in/w_out over W) behind the next layer's backward.
# The sweep is Mixtral-8x7B's layer made fine-grained: E = 4K experts of F = 2*14336/K (K*F constant).


def fine_grained(K: int, D: int = 4096) -> MoESpec:
    return spec(4 * K, K, D, 2 * 14336 // K)


def latent_by_hand(*, D: int, E: int, K: int, F: int, n: int, H: int, h: int) -> int:
    """The latent experts' hidden width: floor((K n D F + D E - 2 D H h - H E h) / (H K n h)), rounded down
    to a multiple of 4 when that keeps 98% of the original's active parameters."""
    before, fixed = K * n * D * F + D * E, 2 * D * H * h + H * E * h
    m = (before - fixed) // (H * K * n * h)
    aligned = m - m % 4
    return aligned if aligned >= 4 and before - fixed - H * K * n * h * aligned <= 0.02 * before else m


def hp_by_hand(hw, *, T: int, D: int, E: int, K: int, F: int, n: int, W: int, G: int, P: int, layers: int,
               H: int | None = None, h: int | None = None) -> dict[str, float]:
    """Step seconds, compute, token bytes sent per rank and memory per rank of HP over P of W ranks."""
    v = hw.values()
    H = H or P * max(1, -(-4 // P))  # the world size, at least 4, a multiple of it
    h = h or D // H
    Q, Fl, rate = H * h, latent_by_hand(D=D, E=E, K=K, F=F, n=n, H=H, h=h), v["R"] * v["eta"]
    fwd = (2 * T * H * K * h * Fl * n + 2 * T * D * Q + 2 * T * D * Q + 2 * T * Q * E) / rate
    on_node = min(P, G)
    per_peer = T * Q / P * v["b"]
    exchange = v["alpha"] + per_peer * (on_node - 1) / v["B_intra"] + per_peer * (P - on_node) / v["B_inter"]
    B = v["B_inter"] if W > G else v["B_intra"]

    def ring(nbytes: float, group: int) -> float:
        return 0.0 if group == 1 else v["alpha"] + 2 * (group - 1) / group * nbytes / B

    heads = H // P * E * (h + n * h * Fl)  # routers and experts of this rank's heads
    ar = ring(heads * v["b_g"], W // P) + ring(2 * D * Q * v["b_g"], W)
    rows = T * H * K
    memory = (heads + 2 * D * Q) * v["s"] + rows * (2 * h + n * Fl) * v["b"] + 2 * T * Q * v["b"]
    return {"step": layers * (3 * fwd + 4 * exchange + max(0.0, ar - 2 * fwd)), "compute": layers * 3 * fwd,
            "bytes": layers * 4 * T * Q * (P - 1) / P * v["b"], "memory": layers * memory, "ffn": Fl}
