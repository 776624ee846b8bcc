"""Lina's schedule in `benchmarks/cost_fidelity.py` (`--forms lina`): a model whose dense gradients are all-reduced
while the expert-parallel all-to-alls run, measured and priced by `cost_model.ep.ep_step`.

At ep = W = 2 a bare MoE block has nothing for Lina to order (its experts are not replicated, so no gradient is
all-reduced). These configs give every layer a dense part, as a transformer layer has: four D x D projections without
bias (the attention projections' GEMMs, `cost_model.ep.dense_flops` with q = 0) and a residual, then the fused MoE
block, `layers` of them (`DenseMoEStack`). Compiled with `Plan(form="ep", a2a_chunks=1)` and wrapped in
`moepass.DataParallel(micro_op_bytes=u, priority=...)`: the replicated gradients (projections and routers, P_d per
layer) are cut into micro-ops of u bytes and averaged over the two ranks during the backward, on the scheduler's own
group, under Lina's priority rule (a micro-op launches only when no all-to-all is queued or running and none is in
flight), or, `priority=False`, as soon as each is ready (the micro-ops and the all-to-alls share the link: "fair").
A timed step ends when `loss.backward()` returns, which is after the last micro-op (`GradientSync` waits for them).

Priced by `ep_step` over the layers (`policy` "priority" or "fair", P_d and u per layer, the dense backward in each
layer's window, each layer's routing factor from `routed_rows`), plus what `ep_step` leaves to the caller because every
form pays it: the dense part's forward and backward GEMMs at the calibrated FLOP/s for D x D on T rows. The
all-reduce is priced at its own calibrated figures (`cost_model.calibrate_allreduce`) and each micro-op is a
collective call on the helper threads (`cost_model.ep.ep_alone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PROJECTIONS = 4  # D x D projections per layer's dense part (`cost_model.ep.dense_flops`: 4 D^2 per token)


class DenseMoEStack(nn.Module):
    """`layers` x (residual dense part of four D x D projections, then a fused MoE block)."""

    def __init__(self, D: int, F: int, E: int, K: int, layers: int):
        super().__init__()
        from samples.models import FusedMoE

        self.dense = nn.ModuleList(nn.Sequential(*(nn.Linear(D, D, bias=False) for _ in range(PROJECTIONS)))
                                   for _ in range(layers))
        self.moe = nn.ModuleList(FusedMoE(D, F, E, K) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for dense, moe in zip(self.dense, self.moe):
            x = moe(x + dense(x))
        return x


def dense_params(D: int, E: int) -> int:
    """The replicated parameters of one layer of `DenseMoEStack`: the projections and the router (P_d)."""
    return PROJECTIONS * D * D + D * E


def build(cfg: Any, world: int) -> tuple[nn.Module, DenseMoEStack]:
    """(the config's model compiled for EP over `world` ranks on one node and wrapped in Lina's gradient sync, the
    model as built: `moepass.compile` leaves it as it was)."""
    import moepass

    model = DenseMoEStack(cfg.D, cfg.F, cfg.E, cfg.K, cfg.layers)
    plan = moepass.Plan(form="ep", topology=moepass.Topology(1, world), a2a_chunks=1, capacity_factor=cfg.capacity)
    wrapped = moepass.DataParallel(moepass.compile(model, plan), micro_op_bytes=cfg.micro_op_bytes,
                                   priority=cfg.priority)
    return wrapped, model


@torch.no_grad()
def routed_rows(model: DenseMoEStack, x: torch.Tensor, world: int) -> list[list[int]]:
    """[layer][destination rank] rows this rank's tokens `x` route to each rank's experts (contiguous, E/world per
    rank; dropless): the top-k of each block's router logits (`FusedMoE`: fp32 logits of its input) on the input a
    hook reads while the model as built runs `x` (the compiled model routes the same: EP is exact; its byte counters
    sum the layers, which hides a layer's own imbalance)."""
    inputs: list[torch.Tensor] = []
    hooks = [moe.register_forward_pre_hook(lambda _m, args: inputs.append(args[0])) for moe in model.moe]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    out = []
    for moe, h in zip(model.moe, inputs):
        logits = h.float() @ moe.router.weight.float().T
        per_expert = torch.bincount(logits.topk(moe.top_k, dim=-1).indices.flatten(), minlength=moe.num_experts)
        out.append(per_expert.view(world, -1).sum(dim=1).tolist())
    return out


def figures(cfg: Any, x: dict[str, Any]) -> dict[str, Any]:
    """`x` (one layer's figures) with the dense part's: P_d, q = 0 (no attention scores), u, b_g = b (fp32)."""
    return {**x, "P_d": dense_params(cfg.D, cfg.E), "q": 0, "u": cfg.micro_op_bytes, "b_g": x["b"]}


def dense_gemm_seconds(cfg: Any, hw: Any) -> float:
    """Forward seconds of one layer's dense part: its D x D GEMMs on T rows at the calibrated FLOP/s."""
    from cost_model import ep as cm

    return float(cm.dense_flops(cfg.tokens, cfg.D)) / float(hw.gemm_rate(cfg.D, cfg.tokens))


def step_terms(cfg: Any, xs: list[dict[str, Any]], world: int) -> Any:
    """`ep_step` over the config's layers (`xs`: each layer's figures, its routing) under its policy."""
    from cost_model import ep as cm

    return cm.ep_step([figures(cfg, x) for x in xs], ep=world, n=1, dp=1, dropless=cfg.capacity is None,
                      cross_node_dp=False, policy="priority" if cfg.priority else "fair")


def predict(cfg: Any, hw: Any, factor: float | list[float], faults: float | None,
            ep_layer: Callable[[Any, float, float], tuple[dict[str, Any], dict[str, Any]]], world: int) -> dict[str, Any]:
    """A config's step (s) and its terms: `ep_step` over its layers, each a config's EP layer with its own routing
    factor (`factor`: one per layer, or one for all) and a layer's share of the step's page faults, with the dense
    part's P_d and micro-ops; plus the dense GEMMs, forward and backward. `ep_layer(one-layer EP config, factor,
    faults)`: `cost_fidelity.predict` of one EP layer and its figure dict. The forward phase: each layer's EP forward (as that splits
    it) and its dense GEMMs; the all-reduce and the waits it causes are in the backward."""
    import dataclasses

    factors = list(factor) if isinstance(factor, list | tuple) else [factor] * cfg.layers
    one = dataclasses.replace(cfg, form="ep", layers=1)
    per_layer = (faults or 0.0) / cfg.layers
    alone, xs = zip(*(ep_layer(one, f, per_layer) for f in factors))
    t = step_terms(cfg, list(xs), world)
    dense = 3 * cfg.layers * dense_gemm_seconds(cfg, hw)
    step = float(t.step) + dense
    fwd = sum(p["fwd_s"] for p in alone) + dense / 3
    return {**alone[0], "step_s": step, "fwd_s": fwd, "bwd_s": step - fwd, "compute_s": float(t.compute) + dense,
            "a2a_s": float(t.a2a_exposed), "host_s": float(t.host), "other_s": float(t.other_comm),
            "threads_s": float(t.threads), "dispatch_bytes": float(t.a2a_bytes),
            "page_s": sum(p["page_s"] for p in alone), "dense_s": dense, "factor": sum(factors) / len(factors),
            "layer_factors": [float(f) for f in factors]}
