"""Calibration of the expert FFN kernel's host cost beyond its GEMMs (`cost_model.ep.host_time`'s c_expert, c_act).

The expert FFN (`moepass.grouped_ffn`) runs, besides its GEMMs, the gated activation and its backward, the
copies and gradient accumulations around them and, on a CPU where it goes expert by expert (`Rows.per_expert`,
every layer whose [rows, F] intermediates reach `grouped_ffn.PER_EXPERT_ELEMENTS`), a Python loop of ~20 ops per
expert. `cost_model.calibrate` times `ffn_steps` on its concurrent ranks at SIZES (none of them a fidelity
configuration's): the kernel's forward + backward, and right after it the same GEMMs as plain `torch.mm`s on the
same shapes (the part `cost_model.ep.compute_time` prices from the GEMM table). Their difference is fitted as

    excess = c_0 + c_expert * E_local + c_act * rows * F

-> `expert_overhead` = c_expert (per local expert) and `act_cost` = c_act (per hidden element); c_0, the call's
fixed cost, is part of the layer's (`layer_overhead`, from the vanishing-size layer). Measured on the kernel itself,
not on an isolated activation: the per-element figure is ~2x the activation's alone (the kernel's other [rows, F]
passes), and the per-expert loop is what a layer with many local experts pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# (local experts, rows, D, F): every one runs expert by expert (rows * F >= grouped_ffn.PER_EXPERT_ELEMENTS)
SIZES = ((2, 1024, 128, 256), (4, 1024, 128, 256), (8, 1024, 128, 256), (16, 1024, 128, 256),
         (4, 512, 128, 256), (4, 2048, 128, 256), (4, 1024, 128, 512), (8, 1024, 64, 256))
UNITS = {
    "expert_overhead": "s per local expert per layer step (fwd+bwd): the expert FFN kernel's per-expert loop",
    "act_cost": "s per hidden element (rows x F) per layer step (fwd+bwd): the expert FFN kernel's time beyond "
                "its GEMMs (activation, its recompute and backward, copies)",
}


def ffn_steps(experts: int, rows: int, width: int, hidden: int, seed: int) -> tuple[Any, Any]:
    """(kernel step, GEMM step) on `rows` random rows spread evenly over `experts` SwiGLU experts of [hidden, width]:
    the kernel's forward + backward (`moepass.grouped_ffn`, as the dialect's expert op runs it), and its 9 GEMMs
    per expert as plain `torch.mm`s on the same shapes and layouts (forward x W_g^T, x W_u^T, a W_d^T; backward
    g W_d, g_gate W_g, g_up W_u, and the three weight gradients)."""
    import torch

    from moepass import grouped_ffn

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    grad_y = torch.randn(rows, width, generator=gen)
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    counts[-1] += rows - int(counts.sum())
    w_gate, w_up = (torch.randn(experts, hidden, width, generator=gen) * width**-0.5 for _ in range(2))
    w_down = torch.randn(experts, width, hidden, generator=gen) * hidden**-0.5
    options = ("swiglu", 0.0, 0.0)

    def kernel() -> None:
        y, h_gate, h_up = grouped_ffn.forward(x, counts, w_gate, w_up, w_down, None, None, None, *options)
        grouped_ffn.backward(grad_y, x, h_gate, h_up, counts, w_gate, w_up, w_down, None, None, None, *options)

    sizes = counts.tolist()
    xs = list(x.split(sizes))
    gys = list(grad_y.split(sizes))
    hs = [torch.randn(n, hidden, generator=gen) for n in sizes]

    def gemms() -> None:
        for e, (x_n, gy_n, h_n) in enumerate(zip(xs, gys, hs)):
            torch.mm(x_n, w_gate[e].t())
            torch.mm(x_n, w_up[e].t())
            torch.mm(h_n, w_down[e].t())
            torch.mm(gy_n, w_down[e])
            torch.mm(h_n, w_gate[e])
            torch.mm(h_n, w_up[e])
            torch.mm(gy_n.t(), h_n)
            torch.mm(h_n.t(), x_n)
            torch.mm(h_n.t(), x_n)

    return kernel, gemms


def figures(excess: Sequence[tuple[int, float]], sizes: Sequence[tuple[int, int, int, int]] = SIZES) -> dict[str, float]:
    """`expert_overhead` and `act_cost` from [(index into sizes, kernel - GEMM seconds)]: the least-squares plane
    c_0 + c_expert * E_local + c_act * rows * F, each slope at least 0."""
    import numpy as np

    design = np.array([[1.0, sizes[i][0], sizes[i][1] * sizes[i][3]] for i, _ in excess])
    (_, per_expert, per_element), *_ = np.linalg.lstsq(design, np.array([s for _, s in excess]), rcond=None)
    return {"expert_overhead": max(0.0, float(per_expert)), "act_cost": max(0.0, float(per_element))}
