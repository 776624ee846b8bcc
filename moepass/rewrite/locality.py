"""Locality-aware routing (LocMoE, IJCAI'24): a top-1 router that prefers the experts of its own node,
with a capacity floor, dispatched over expert parallel. A math change: only when `Plan(form="locality")`
names it.

    Plan(form="locality", gate="grap" | "learned", mu=..., alpha=0.01, capacity_factor=None | c_f)

`convert` (before any graph exists) makes the block's router top-1, drops its own selection bias, group
limit, renormalisation and capacity, and records the change as pass `convert:locality`. The pass then
rewrites the canonical graph (the experts and everything around the router stay the block's own):

    logits_TE  = linear(x_TD, w_router)                          "learned": the block's own router
               | grap_logits(x_TD, E)                            "grap": mean of the i-th block of D/E channels
    weights_T1, experts_T1, probs_TE = locality_route(logits_TE) ReLU -> softmax -> argmax; weight = the
                                                                 chosen probability (no renormalisation)
    keep_T1, floor_3 = moe_loc.floor_keep(x_TD, gate_ED, experts_T1, c_f)      only with a capacity factor
    ... EP exchange (`exchange.insert_exchange`): E/P consecutive experts per rank; dropped assignments go
        to an extra bucket that is never sent and contribute zero ...
    losses     = locality_losses(probs_TE, experts_T1, log_target_E, alpha, mu, training)
    self.locality(losses, floor_3, own_share)                    records them for `moepass.aux_loss(model)`

Losses (each train-mode forward, per rank, over the rank's T tokens):
  L_aux = alpha * E * sum_i f_i * P_i    f_i: fraction of the tokens whose argmax is i (a count: no gradient),
                                         P_i: mean router probability of expert i (differentiable)
  L_loc = mu * KL(D_current || D_local)  D_current = P (the mean softmax probabilities of the rank's tokens:
                                         the batch's token -> expert distribution made differentiable),
                                         D_local = (1 - LOCAL_SMOOTHING) * uniform over the experts of the
                                         rank's node + LOCAL_SMOOTHING * uniform over all E (D_local without
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

Gradient convention as EP's (`moepass.rewrite.exchange`): expert gradients are those of the mean of the
ranks' losses; the router (replicated) holds its rank's gradient, averaged by DDP or
`moepass.runtime.grads.all_reduce_replicated_grads`.

Shape legend: T tokens of this rank, D width, E experts, P EP ranks, L = E/P local experts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from moepass import canonical, dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import Effects, PassResult
from moepass.plan import Plan
from moepass.rewrite import exchange
from moepass.rewrite.ep import EPLayout, experts_per_rank, local_weight
from moepass.rewrite.experts import shard_experts
from moepass.runtime.topology import EPGroups, ep_groups
from moepass.spec import MoESpec

PASS = "locality"
CONVERT = "convert:locality"
LOCAL_SMOOTHING = 0.1  # D_local = (1 - eps) * uniform(own-node experts) + eps * uniform(all experts)
DELTA_MAX = math.nextafter(1.0, 0.0)  # delta is clamped to [0, 1): the floor is infinite at 1


# ----------------------------------------------------------------------------------------------
# What the graph runs.
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# The conversion (before any graph) and the pass.
# ----------------------------------------------------------------------------------------------


def convert(spec: MoESpec, block: nn.Module, plan: Plan) -> tuple[MoESpec, nn.Module, dict]:
    """The router change `Plan(form="locality")` names: top-1, softmax (the pass puts ReLU before it), no
    renormalisation, no selection bias or group limit, and the locality capacity rule instead of the
    block's own. Returns the spec the canonical graph is built from and the `convert:locality` record."""
    where = spec.path or "<root>"
    if spec.heads is not None:
        raise PlanError(f"Plan.form='locality' is not built for block {where}, a Multi-Head LatentMoE: its parallel "
                        f"form is form='hp'; or use form='single'.")
    E, D = spec.num_experts, spec.model_dim
    if plan.gate == "grap" and D % E:
        raise PlanError(f"Plan.gate='grap' is invalid for block {where}: the GrAP gate averages E={E} contiguous "
                        f"blocks of D/E channels, but D={D} is not a multiple of {E} (D % E = {D % E}); use "
                        f"gate='learned' (the block's own router), or leave this block alone with "
                        f"Plan(blocks={{{spec.path!r}: None}}).")
    r = spec.router
    router = dataclasses.replace(r, top_k=1, score_func="softmax", softmax_before_topk=True, renormalize=False,
                                 n_group=1, topk_group=1, routed_scaling_factor=1.0, selection_bias=None,
                                 bias_update_rate=0.0)
    assert plan.mu is not None  # Plan requires it with form="locality"
    was = spec.summary()
    new_spec = spec.replace(router=router, capacity=None)
    stats = {"math": "changed (top-1 locality routing with its losses, named by Plan.form='locality')",
             "was": was, "router": describe_router(plan.gate), "losses": describe_losses(plan.alpha, plan.mu),
             "capacity": describe_capacity(plan.capacity_factor, E, D)}
    return new_spec, block, {"pass": CONVERT, "seconds": 0.0, "changed": True, "stats": stats}


def describe_router(gate_name: str) -> str:
    gate = ("GrAP (fixed: logit i = mean of the i-th block of D/E channels)" if gate_name == "grap"
            else "the block's learned router")
    return f"{gate} -> ReLU -> softmax -> argmax (top-1); weight = the chosen probability, not renormalised"


def describe_losses(alpha: float, mu: float) -> str:
    return (f"L_aux = {alpha:g}*E*sum f_i*P_i; L_loc = {mu:g}*KL(mean softmax || D_local), D_local = "
            f"{1 - LOCAL_SMOOTHING:g}*uniform(own-node experts) + {LOCAL_SMOOTHING:g}*uniform(E); train mode, "
            f"summed by moepass.aux_loss(model)")


def describe_capacity(capacity_factor: float | None, num_experts: int, dim: int) -> str:
    if capacity_factor is None:
        return "dropless (Plan.capacity_factor=None): no capacity, so no floor is measured"
    from cost_model.locality import capacity_floor

    return (f"per (source rank, expert): max(ceil(ec_min(delta)), ceil(T*{capacity_factor:g}/E)) clamped to "
            f"T; delta = min cos(token, chosen gate vector) measured each forward (one host sync per layer per "
            f"step); ec_min(delta=0) = {capacity_floor(0.0, num_experts, dim):.4g} tokens")


@dataclass
class LocalityLayout(EPLayout):
    """EP's placement plus the routing settings and this rank's node-local experts."""

    gate: str = "learned"
    alpha: float = 0.0
    mu: float = 0.0
    capacity_factor: float | None = None
    dim: int = 0
    own_experts: list[int] = field(default_factory=list)  # experts on this rank's node

    def describe(self, gm: nn.Module) -> list[str]:
        lines = [*super().describe(gm),
                 "locality routing (changes the model's math: named by Plan.form='locality'): "
                 + describe_router(self.gate),
                 f"losses: {describe_losses(self.alpha, self.mu)}; this rank's node holds experts {self.own_experts}",
                 f"capacity: {describe_capacity(self.capacity_factor, self.num_experts, self.dim)}"]
        record = getattr(gm, "locality", None)
        if isinstance(record, LocalityRecord) and record.floor_stats is not None:
            s = record.locality_state()
            lines.append(f"last forward: delta={s['delta']:.4g}, ec_min={s['floor']:.4g}, capacity={s['capacity']}")
        return lines


def node_experts(groups: EPGroups, local_experts: int) -> list[int]:
    """The experts whose EP owner shares this rank's node (node-major ranks, E/P consecutive per rank)."""
    topology, node = groups.topology, groups.topology.node_of(groups.rank)
    return [e for e in range(groups.ep_size * local_experts)
            if topology.node_of(groups.ep_ranks[e // local_experts]) == node]


def local_target(num_experts: int, own: list[int]) -> Tensor:
    """D_local [E] (module doc): uniform over the node's experts `own`, smoothed with LOCAL_SMOOTHING."""
    assert own, "under EP every rank hosts E/P >= 1 experts"
    target_E = torch.full((num_experts,), LOCAL_SMOOTHING / num_experts)
    target_E[own] += (1.0 - LOCAL_SMOOTHING) / len(own)
    return target_E


def _node(graph: fx.Graph, name: str) -> fx.Node:
    for n in graph.nodes:
        if n.name == name:
            return n
    raise ValueError(f"the locality rewrite expects a node {name!r} in the canonical graph")


def rewrite_locality(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The locality pass (module doc): top-1 locality router, floor capacity, losses, EP dispatch."""
    spec = gm.spec
    assert spec.top_k == 1 and spec.capacity is None, "locality.convert runs before canonical.build"
    assert plan.mu is not None  # Plan validates it for form="locality"
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    E, D = spec.num_experts, spec.model_dim
    L = experts_per_rank(spec, plan, groups)
    own = node_experts(groups, L)
    layout = LocalityLayout(num_experts=E, groups=groups, shard_dim=0, local_experts=L,
                            first_expert=groups.ep_rank * L, gate=plan.gate, alpha=float(plan.alpha),
                            mu=float(plan.mu), capacity_factor=plan.capacity_factor, dim=D, own_experts=own)
    effects = Effects()
    attrs = shard_experts(gm, spec, layout, PASS, effects, replica_hooks=plan.grad_sync == "none")
    on_node_E = torch.zeros(E, dtype=torch.bool, device=device)
    on_node_E[own] = True
    grap_ED = grap_gate(E, D).to(device) if plan.gate == "grap" and plan.capacity_factor is not None else None
    effects.modules["locality"] = LocalityRecord(spec.path, local_target(E, own).log().to(device), on_node_E, grap_ED)

    graph = gm.graph
    b = GraphBuilder(PASS, spec.path)
    b.graph = graph
    route = exchange.only(graph, dialect.ROUTE, "moe.route")
    old = {user.args[1]: user for user in route.users}  # getitem 0: weights, 1: experts
    x_TD, logits = _node(graph, "x_TD"), route.args[0]
    assert isinstance(logits, fx.Node)
    with graph.inserting_before(route):
        if plan.gate == "grap":  # the block's router is no longer read; the side output shows the GrAP logits
            grap = b.fn(grap_logits, x_TD, E, name="grap_logits_TE")
            output = next(n for n in graph.nodes if n.op == "output")
            for side in ("logits_TE", "router_logits"):
                found = [n for n in graph.nodes if n.name == side]
                if found:
                    output.replace_input_with(found[0], grap)
            logits = grap
            weight = gm.get_parameter(spec.router.weight.paths[0]) if spec.router.logits_from == "linear" else None
            for path, param in gm.named_parameters():  # frozen: nothing reads it (checkpoints keep it)
                if param is weight or (weight is None and path.startswith(spec.router.module_path + ".")):
                    effects.parameters[path] = nn.Parameter(param.detach(), requires_grad=False)
        routed = b.fn(locality_route, logits, name="locality_route")
        weights_T1 = b.item(routed, 0, "weights_T1")
        experts_T1 = b.item(routed, 1, "experts_T1")
        probs_TE = b.item(routed, 2, "probs_TE")

        keep_T1 = floor_3 = None
        if plan.capacity_factor is not None:
            gate_ED = (b.attr("locality.gate_ED") if plan.gate == "grap"
                       else b.tensor(spec.router.weight, "gate_vectors_ED"))
            kept = b.fn(FLOOR_KEEP, b.method("detach", x_TD, name="x_TD_detached"),
                        b.method("detach", gate_ED, name="gate_ED_detached"), experts_T1,
                        float(plan.capacity_factor), name="floor_keep")
            keep_T1, floor_3 = b.item(kept, 0, "keep_T1"), b.item(kept, 1, "floor_stats")
    for index, new in ((0, weights_T1), (1, experts_T1)):  # the block's top-k routing is gone
        if index in old:
            old[index].replace_all_uses_with(new)
            graph.erase_node(old[index])
    graph.erase_node(route)
    if keep_T1 is not None:  # dropped tokens contribute zero
        with graph.inserting_after(keep_T1):
            kept_weights = b.fn(torch.mul, weights_T1, keep_T1, name="kept_weights_T1")
        weights_T1.replace_all_uses_with(kept_weights, delete_user_cb=lambda u: u is not kept_weights)

    reads: dict[str, fx.Node] = {}

    def weights() -> list[fx.Node | None]:  # local shards: nothing to issue
        return canonical.expert_weights(b, spec.experts,
                                        lambda source, role: local_weight(b, attrs[role], source, role, reads))

    exchange.insert_exchange(gm, b, buckets=E, local=L, group_name=groups.ep_group.group_name,
                             world=groups.world_size, route=None, issue_weights=lambda: weights, keep=keep_T1,
                             hierarchy=exchange.hierarchy_of(plan, groups))

    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        losses = b.fn(locality_losses, probs_TE, experts_T1, b.attr("locality.log_target_E"), float(plan.alpha),
                      float(plan.mu), b.attr("training"), name="locality_losses")
        share = b.fn(own_node_share, experts_T1, b.attr("locality.on_node_E"), name="own_node_share")
        b.module("locality", losses, floor_3, share, name="locality_record")
    gm.form = PASS
    gm.layout = layout
    stats = {"experts": E, "local_experts": L, "ep_size": groups.ep_size, "dp_size": groups.dp_size,
             "gate": plan.gate, "own_node_experts": own, "capacity": "floor rule" if keep_T1 is not None else "dropless"}
    return PassResult(gm, changed=True, stats=stats, effects=effects)
