"""Calibration of the router's per-token host cost (`cost_model.ep.host_time`'s c_route).

The router of every form runs once per token (per sub-token under HP: T*H of them): its gate GEMM [T, D] x [D, E]
and `moe.route` (scores, top-k, renormalisation), forward and backward: a few elements per token, so its cost is per
token, not per routed element (c_row) or per hidden element (c_act). `cost_model.calibrate` times `route_step` on
its concurrent ranks at TOKENS tokens (width D, E experts, top-K: none of them a fidelity configuration's) and fits
seconds over tokens -> `route_cost`.
"""

from __future__ import annotations

from typing import Any

TOKENS = (1024, 4096, 16384)  # tokens per timed router step
D, E, K = 64, 8, 2
UNITS = {"route_cost": "s per routed token per layer step: the router's gate GEMM and moe.route, forward + backward"}


def route_step(tokens: int, seed: int, width: int = D, experts: int = E, top_k: int = K) -> Any:
    """One router step on `tokens` random tokens: fp32 logits of the gate, `moe.route` (softmax, top-k,
    renormalised), the backward of the weights' sum into the tokens and the gate. Returns the step and the
    (tokens, gate) tensors it leaves gradients on (as `cost_model.calibrate.restore_step`)."""
    import torch

    import moepass.dialect  # noqa: F401  (registers torch.ops.moe)

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen, requires_grad=True)
    gate = torch.randn(experts, width, generator=gen, requires_grad=True)

    def step() -> None:
        x.grad = gate.grad = None
        logits = torch.nn.functional.linear(x, gate).float()
        weights, _ = torch.ops.moe.route(logits, None, "softmax", True, top_k, True, 1, 1, "max", 1.0)
        weights.sum().backward()

    return step, (x, gate)
