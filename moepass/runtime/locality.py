"""Locality routing (LocMoE) at run time: what the graph `moepass.rewrite.locality` builds calls — the GrAP
gate, the top-1 locality route, the capacity floor op `moe_loc.floor_keep` (Theorem 1: one host sync of delta
per layer and step), the losses, the `locality` child module recording them, and `moepass.aux_loss`.

Losses (each train-mode forward, per rank, over the rank's T tokens):
  L_aux = alpha * E * sum_i f_i * P_i    f_i: fraction of the tokens whose argmax is i (a count: no gradient),
                                         P_i: mean router probability of expert i (differentiable)
  L_loc = mu * KL(D_current || D_local)  D_current = P (the mean softmax probabilities of the rank's tokens:
                                         the batch's token -> expert distribution made differentiable),
                                         D_local = (1 - eps) * uniform over the experts of the
                                         rank's node + eps * uniform over all E (eps:
                                         `moepass.rewrite.locality.LOCAL_SMOOTHING`) (D_local without
                                         smoothing has zeros off-node, where the KL is infinite). Every rank
                                         hosts E/P >= 1 experts, so every node has some.
  `moepass.aux_loss(model)` returns the sum of L_aux + L_loc over every locality block for its latest
  forward: `loss = ce + moepass.aux_loss(model)` trains the router (or, with "grap", the layers below it).
  Eval mode computes no loss; aux_loss then raises, as it does before any forward. Under `no_grad` in
  train mode the losses are computed (values for logging) without a graph.

Capacity floor (Theorem 1): delta = the smallest cosine between a token and the gate vector of its chosen
expert (the GrAP vectors, or the learned router rows) over the rank's tokens, clamped to [0, 1);
ec_min = `cost_model.locality.capacity_floor(delta, E, D)`; capacity per (source rank, expert) =
`expert_capacity(T, E, c_f, ec_min)` = max(ceil(ec_min), ceil(T * c_f / E)) clamped to T, as EP applies
capacity (`moepass.rewrite.ep`): each rank keeps at most that many of its own tokens per expert, in token
order. The capacity depends on the data: `moe_loc.floor_keep` reads delta on the host (one host sync of
one scalar per layer per step, inside the opaque op, so Dynamo does not break). `capacity_factor=None` is
dropless: no capacity, so no floor is measured and no sync happens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moepass import dialect

DELTA_MAX = math.nextafter(1.0, 0.0)  # delta is clamped to [0, 1): the floor is infinite at 1


def grap_logits(x_TD: Tensor, num_experts: int) -> Tensor:
    """GrAP gate: logit i = mean of the i-th contiguous block of D/E channels (in fp32)."""
    return x_TD.float().reshape(x_TD.shape[0], num_experts, -1).mean(dim=-1)


def grap_gate(num_experts: int, dim: int) -> Tensor:
    """The GrAP gate vectors [E, D]: w_i = (E/D) on the i-th block of D/E channels, 0 elsewhere."""
    block = dim // num_experts
    return torch.block_diag(*[torch.full((1, block), num_experts / dim) for _ in range(num_experts)])


def locality_route(logits_TE: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ReLU -> softmax -> argmax (the first of equal maxima, as torch.argmax). Returns the chosen
    probability [T, 1] (the combine weight, not renormalised), the chosen expert [T, 1], all probabilities."""
    probs_TE = torch.softmax(torch.relu(logits_TE.float()), dim=-1)
    experts_T1 = probs_TE.argmax(dim=-1, keepdim=True)
    return probs_TE.gather(1, experts_T1), experts_T1, probs_TE


def measured_delta(x_TD: Tensor, gate_ED: Tensor, experts_T1: Tensor) -> float:
    """delta of Theorem 1: min over tokens of cos(token, gate vector of its chosen expert), clamped to
    [0, 1). A host sync (one scalar)."""
    if x_TD.shape[0] == 0:
        return 0.0
    cos_T = F.cosine_similarity(x_TD.float(), gate_ED.float()[experts_T1[:, 0]], dim=-1)
    return min(max(float(cos_T.min()), 0.0), DELTA_MAX)


@torch.library.custom_op("moe_loc::floor_keep", mutates_args=())
def floor_keep(x_TD: Tensor, gate_ED: Tensor, experts_T1: Tensor, capacity_factor: float) -> tuple[Tensor, Tensor]:
    """The capacity mask [T, 1] of the floor rule (module doc) and [delta, ec_min, capacity] (float64)."""
    from cost_model.locality import capacity_floor, expert_capacity  # mpmath: loaded on first use

    (T, D), E = x_TD.shape, gate_ED.shape[0]
    delta = measured_delta(x_TD, gate_ED, experts_T1)  # the one host sync of the layer
    floor = capacity_floor(delta, E, D)
    capacity = expert_capacity(T, E, capacity_factor, floor)
    keep_T1 = dialect.capacity_keep_ref(experts_T1, E, capacity, 0, True)
    return keep_T1, torch.tensor([delta, floor, capacity], dtype=torch.float64, device=x_TD.device)


@floor_keep.register_fake
def _(x_TD, gate_ED, experts_T1, capacity_factor):
    if x_TD.dim() != 2 or gate_ED.dim() != 2 or gate_ED.shape[1] != x_TD.shape[1] or experts_T1.shape != (
            x_TD.shape[0], 1):
        raise ValueError(f"moe_loc.floor_keep: x_TD {tuple(x_TD.shape)} must be [T, D], gate_ED "
                         f"{tuple(gate_ED.shape)} [E, D] and experts_T1 {tuple(experts_T1.shape)} [T, 1]")
    return torch.empty_like(experts_T1, dtype=torch.bool), x_TD.new_empty(3, dtype=torch.float64)


FLOOR_KEEP = torch.ops.moe_loc.floor_keep.default


def locality_losses(probs_TE: Tensor, experts_T1: Tensor, log_target_E: Tensor, alpha: float, mu: float,
                    training: bool) -> tuple[Tensor, Tensor] | None:
    """(L_aux, L_loc) of the module doc in train mode; None in eval mode."""
    if not training:
        return None
    T, E = probs_TE.shape
    ones_T = torch.ones_like(experts_T1[:, 0], dtype=probs_TE.dtype)
    f_E = torch.zeros(E, dtype=probs_TE.dtype, device=probs_TE.device).index_add_(0, experts_T1[:, 0], ones_T) / T
    P_E = probs_TE.mean(dim=0)
    l_aux = alpha * E * (f_E * P_E).sum()
    log_P_E = P_E.clamp_min(torch.finfo(P_E.dtype).tiny).log()
    l_loc = mu * (P_E * (log_P_E - log_target_E)).sum()
    return l_aux, l_loc


def own_node_share(experts_T1: Tensor, on_node_E: Tensor) -> Tensor:
    """Fraction of the rank's tokens whose chosen expert lives on its node (before capacity)."""
    return on_node_E[experts_T1[:, 0]].float().mean()


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class LocalityRecord(nn.Module):
    """Child `locality` of a locality block: this rank's constants the graph reads, and what its latest
    forward measured. `moepass.aux_loss` reads the losses; `locality_state()` returns every figure as Python
    numbers (one host sync, when asked).

    The constants differ per rank (D_local), so they are plain tensor attributes moved by `_apply`, not
    buffers: DDP broadcasts rank 0's buffers to every rank at each forward."""

    _is_impure = True  # FX: the graph calls it for its side effect; dead-code elimination keeps the node
    CONSTANTS = ("log_target_E", "on_node_E", "gate_ED")

    def __init__(self, block: str, log_target_E: Tensor, on_node_E: Tensor, gate_ED: Tensor | None):
        super().__init__()
        self.block = block
        self.log_target_E = log_target_E  # log D_local [E]
        self.on_node_E = on_node_E  # bool [E]: the expert lives on this rank's node
        self.gate_ED = gate_ED  # the GrAP gate vectors [E, D] (gate="grap" with a capacity factor), else None
        self.latest: Any = None  # None: no forward yet; "eval": the latest forward ran in eval mode; (aux, loc)
        self.floor_stats: Tensor | None = None  # [delta, ec_min, capacity] of the latest forward, or None
        self.own_share: Tensor | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> LocalityRecord:  # .to(device) / .half() move the constants
        for name in self.CONSTANTS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))
        return super()._apply(fn, recurse)

    def forward(self, losses: tuple[Tensor, Tensor] | None, floor_stats: Tensor | None, own_share: Tensor) -> None:
        if not torch.compiler.is_compiling() and _is_fake(own_share):
            return  # the verifier's shape propagation, not a forward
        self.latest = "eval" if losses is None else losses
        self.floor_stats = floor_stats
        self.own_share = own_share

    def locality_state(self) -> dict[str, float | None]:
        stats: list[float] | None = None if self.floor_stats is None else self.floor_stats.tolist()
        losses = self.latest if isinstance(self.latest, tuple) else None
        return {"delta": None if stats is None else stats[0], "floor": None if stats is None else stats[1],
                "capacity": None if stats is None else int(stats[2]),
                "own_node_share": None if self.own_share is None else float(self.own_share),
                "aux": None if losses is None else losses[0].item(), "loc": None if losses is None else losses[1].item()}

    def __getstate__(self) -> dict[str, Any]:  # a deep copy or pickle does not carry the latest step's tensors
        state = dict(super().__getstate__())
        state.update(latest=None, floor_stats=None, own_share=None)
        return state


def aux_loss(model: nn.Module) -> Tensor:
    """The summed auxiliary loss (L_aux + L_loc) of every locality block of `model` for its latest forward:
    `loss = ce + moepass.aux_loss(model)`. A zero tensor when the model has no locality block. Raises
    RuntimeError before any forward, and after a forward in eval mode (which computes no loss)."""
    records = [(path, m) for path, m in model.named_modules() if isinstance(m, LocalityRecord)]
    if not records:
        param = next(iter(model.parameters()), None)
        return torch.zeros((), device=None if param is None else param.device)
    total: Tensor | None = None
    for _, record in records:
        if record.latest is None:
            raise RuntimeError(f"moepass.aux_loss: locality block {record.block or '<root>'!r} has not run a forward "
                               f"yet; call aux_loss after the model's forward, before backward.")
        if not isinstance(record.latest, tuple):
            raise RuntimeError(f"moepass.aux_loss: the latest forward of locality block {record.block or '<root>'!r} "
                               f"ran in eval mode, which computes no auxiliary loss; call model.train() before the "
                               f"forward whose loss you train on.")
        aux, loc = record.latest
        total = aux + loc if total is None else total + aux + loc
    assert total is not None
    return total
