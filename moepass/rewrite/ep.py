"""Expert parallel (EP): the canonical dialect graph of a block → its distributed graph.

Each of the P ranks of an EP group owns L = E/P consecutive experts (rank i: experts [i*L, (i+1)*L)).
The rewrite keeps everything around the expert compute (router, capacity, shared experts, side
outputs) and replaces the single `moe.expert_ffn` node by

    x_ND, counts_E, order_N = moe.permute(x_TD, experts_TK)          # unchanged (local routing)
    recv_counts_E = wait(moe_comm.exchange_counts(counts_E))          # metadata all-to-all
    x_RD          = wait(moe_comm.all_to_all(x_ND, counts_E, recv_counts_E, "dispatch"))
    ids_R1        = moe_ep.local_expert_ids(recv_counts_E, L, R)      # rows arrive (source, expert)-major
    x_MD, counts_L, order_R = moe.permute(x_RD, ids_R1, L)            # ... sort them expert-major
    y_MD          = moe.expert_ffn(x_MD, counts_L, <local expert slice of each weight>)
    y_RD          = moe.unpermute(y_MD, order_R, 1)
    y_ND          = wait(moe_comm.all_to_all(y_RD, recv_counts_E, counts_E, "combine", out_rows=N))
    y_TKD = moe.unpermute(y_ND, order_N, K); out_TD = moe.combine(y_TKD, weights_TK)   # unchanged

Capacity (what it means under EP, precisely): capacity is applied by each rank to its own tokens
before dispatch, i.e. per (source rank, expert): every rank keeps at most C assignments per expert
and capacity group, C computed from the rank's local group size (`moe.capacity_keep` exactly as the
single-device graph runs it, on the rank's slice). A model with per-sequence capacity (Switch) is
therefore unchanged by EP (ranks hold whole sequences); a model with per-batch capacity (GShard
sample) behaves as it would under plain data parallelism with the same per-rank batch — not as one
device running the concatenated global batch. `Plan(capacity_factor=cf)` sets the factor (on a
dropless model: GShard-style k-major priority, per-rank batch groups, dropped assignments contribute
zero). Dropped assignments are routed to an extra bucket E that is never sent: they cost no bytes.
Dropless (the default for dropless models) keeps every token.

Parameters: each rank keeps only its experts' rows of every expert weight, as a DTensor on the
("dp", "ep") mesh with placements (Replicate(), Shard(0)) — the canonical [E, ...] layout sharded on
the expert dim, so names and logical shapes are the original ones for fused 3-D weights. ModuleList
experts (one tensor per expert) are stacked into fused parameters `ep_<role>` owned by the rewritten
block (the per-expert modules are removed); `moepass.logical_state_dict` maps them back.

Gradient convention (the same as DDP's): after backward, an expert parameter's gradient is the
gradient of the mean over all W ranks of their local losses — the dispatch/combine backward sums
the contributions of every rank of the EP group, `grad_scale` nodes around the expert compute
divide the weight gradients by W (on the rows, not on the weights), and a hook on the parameter
sums across DP replicas (`dp_group`, only when ep_size < world). Non-expert parameters are replicated: average
their gradients with DDP (expert parameters are excluded from it) or
`moepass.runtime.grads.all_reduce_replicated_grads`.

Shape legend: T tokens, D width, E experts, K top-k, N = T*K routed rows, P EP ranks, L = E/P local
experts, R rows received by this rank, M = R rows sorted by local expert.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from moepass import canonical, dialect
from moepass.canonical import GraphBuilder, MoEGraphModule
from moepass.errors import PlanError
from moepass.passes import PassResult
from moepass.plan import Plan
from moepass.runtime import collectives as comm
from moepass.runtime.topology import EPGroups, ep_groups
from moepass.spec import CapacitySpec, MoESpec, TensorSource

PASS = "ep"
ROLES = canonical.ROLES


# ----------------------------------------------------------------------------------------------
# Helper op and functions used by the EP graph.
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_ep::local_expert_ids", mutates_args=())
def local_expert_ids(recv_counts_E: Tensor, num_local: int, rows: int) -> Tensor:
    """Local expert of each received row: rows arrive grouped by (source rank, local expert)."""
    ids_E = torch.arange(recv_counts_E.shape[0], device=recv_counts_E.device) % num_local
    return torch.repeat_interleave(ids_E, recv_counts_E, output_size=rows).unsqueeze(1)


@local_expert_ids.register_fake
def _(recv_counts_E, num_local, rows):
    return recv_counts_E.new_empty((rows, 1), dtype=torch.int64)


LOCAL_EXPERT_IDS = torch.ops.moe_ep.local_expert_ids.default


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None


def grad_scale(x: Tensor, scale: float) -> Tensor:
    """Identity forward; the backward multiplies the gradient by `scale`.

    EP scales the expert weights' gradients by 1/W (DDP's convention, see the module doc) on the
    token side: the expert FFN's output gradient is divided by W and its input gradient multiplied
    back by W, two passes over the rows this rank computes instead of one over every expert weight
    (exact when W is a power of two; otherwise within one rounding of the division).
    """
    return _GradScale.apply(x, scale)


def ep_local(param: Tensor) -> Tensor:
    """This rank's shard of an expert parameter (differentiable; no communication)."""
    return param.to_local() if isinstance(param, DTensor) else param


# ----------------------------------------------------------------------------------------------
# What the pass records on the rewritten block (read by checkpoint and grads).
# ----------------------------------------------------------------------------------------------


@dataclass
class EPLayout:
    """Where the experts of one EP block live. Names are relative to the block."""

    num_experts: int
    local_experts: int  # L
    first_expert: int  # this rank's experts are [first_expert, first_expert + L)
    groups: EPGroups
    sharded: list[str] = field(default_factory=list)  # params sharded in place (original names)
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ep_<role> -> original per-expert paths

    def expert_param_names(self) -> list[str]:
        return [*self.sharded, *self.stacked]


# ----------------------------------------------------------------------------------------------
# Parameters: shard in place, or stack ModuleList experts into owned fused parameters.
# ----------------------------------------------------------------------------------------------


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def _as_dtensor(local: Tensor, groups: EPGroups, requires_grad: bool) -> nn.Parameter:
    dt = DTensor.from_local(local, groups.mesh, [Replicate(), Shard(0)], run_check=False)
    return nn.Parameter(dt, requires_grad=requires_grad)


def _shard_parameters(gm: MoEGraphModule, spec: MoESpec, groups: EPGroups, layout: EPLayout) -> dict[str, str]:
    """Replace expert weights by their local shards; returns role -> parameter name read by the graph."""
    E, lo, hi = spec.num_experts, layout.first_expert, layout.first_expert + layout.local_experts
    names: dict[str, str] = {}
    stacked_by_paths: dict[tuple[str, ...], str] = {}
    for role in ROLES:
        source: TensorSource | None = getattr(spec.experts, role)
        if source is None:
            continue
        if not source.stacked:
            path = source.paths[0]
            if path not in layout.sharded:
                owner, name = _owner(gm, path)
                param = owner._parameters.get(name)
                if param is None or param.dim() == 0 or param.shape[0] != E:
                    raise PlanError(
                        f"Plan.form='ep' cannot shard block {spec.path or '<root>'}: expert weight {path!r} "
                        f"has shape {None if param is None else tuple(param.shape)}, expected a leading expert "
                        f"dim of {E}; leave this block alone with Plan(blocks={{{spec.path!r}: None}}).")
                local = param.detach()[lo:hi].clone()
                owner._parameters[name] = _as_dtensor(local, groups, param.requires_grad)
                layout.sharded.append(path)
            names[role] = path
            continue
        if source.paths not in stacked_by_paths:
            new_name = f"ep_{role}"
            params = [gm.get_parameter(p) for p in source.paths]
            if len(params) != E:
                raise PlanError(f"Plan.form='ep': block {spec.path or '<root>'} stacks {len(params)} tensors for "
                                f"{role}, expected one per expert ({E}).")
            local = torch.stack([p.detach() for p in params[lo:hi]]).clone()
            gm.register_parameter(new_name, _as_dtensor(local, groups, params[0].requires_grad))
            layout.stacked[new_name] = source.paths
            stacked_by_paths[source.paths] = new_name
        names[role] = stacked_by_paths[source.paths]
    return names


def _drop_stacked_originals(gm: MoEGraphModule, spec: MoESpec, layout: EPLayout) -> None:
    """Remove the per-expert tensors that were stacked (every rank would otherwise hold all experts)."""
    consumed = {p for paths in layout.stacked.values() for p in paths}
    for path in consumed:
        owner, name = _owner(gm, path)
        del owner._parameters[name]
    container = spec.experts.container
    if consumed and container:
        module = gm.get_submodule(container)
        if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
            parent, name = _owner(gm, container)
            del parent._modules[name]


def _expert_grad_hook(groups: EPGroups):
    """Expert gradient := its sum over DP replicas (the 1/W is already in it: `grad_scale`)."""

    def hook(grad: Tensor) -> Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()  # a hook must not modify its argument
        comm.all_reduce_sum_(local, groups.dp_group)
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


# ----------------------------------------------------------------------------------------------
# The graph rewrite.
# ----------------------------------------------------------------------------------------------


def ep_capacity(spec: MoESpec, plan: Plan) -> CapacitySpec | None:
    """The capacity the EP graph applies per (source rank, expert): see the module doc."""
    if plan.capacity_factor is None:
        return spec.capacity
    if spec.capacity is None:
        return CapacitySpec(capacity_factor=float(plan.capacity_factor))
    return dataclasses.replace(spec.capacity, capacity_factor=float(plan.capacity_factor), fixed=None)


def _only(graph: fx.Graph, target, what: str) -> fx.Node:
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is target]
    if len(found) != 1:
        raise ValueError(f"EP rewrite expects exactly one {what} node in the canonical graph, found {len(found)}")
    return found[0]


def _local_weight(b: GraphBuilder, attr: str, source: TensorSource, role: str, reads: dict[str, fx.Node]) -> fx.Node:
    """get_attr → local shard → the source's chunk / transpose (as the canonical graph reads it).

    A parameter several roles read (gate and up halves of one tensor) is read and chunked once.
    """
    if attr not in reads:
        reads[attr] = b.fn(ep_local, b.attr(attr, name=f"{role}_param"), name=f"{role}_local")
    return b.view(source, reads[attr], f"{role}_local")


def rewrite_graph(gm: MoEGraphModule, weight_attrs: dict[str, str], layout: EPLayout) -> dict[str, int]:
    """Replace the expert compute of `gm.graph` by dispatch / local experts / combine (in place)."""
    graph, spec = gm.graph, gm.spec
    E, L = spec.num_experts, layout.local_experts
    group_name = layout.groups.ep_group.group_name
    b = GraphBuilder(PASS, spec.path)
    b.graph = graph
    permute = _only(graph, dialect.PERMUTE, "moe.permute")
    ffn = _only(graph, dialect.EXPERT_FFN, "moe.expert_ffn")
    keeps = [n for n in graph.nodes if n.op == "call_function" and n.target is dialect.CAPACITY_KEEP]
    x_ND, counts = ffn.args[0], ffn.args[1]

    if keeps:  # dropped assignments go to bucket E, sorted last and never sent
        x_TD, experts_TK, _ = permute.args
        with graph.inserting_before(permute):
            kept_experts = b.fn(torch.where, keeps[0], experts_TK, E, name="experts_kept_TK")
        permute.args = (x_TD, kept_experts, E + 1)

    with graph.inserting_before(ffn):
        counts_E = b.fn(operator.getitem, counts, slice(0, E), name="send_counts_E") if keeps else counts
        recv_counts_E = b.fn(comm.WAIT, b.fn(comm.EXCHANGE_COUNTS, counts_E, group_name, name="exchange_counts"),
                             name="recv_counts_E")
        x_RD = b.fn(comm.WAIT, b.fn(comm.ALL_TO_ALL, x_ND, counts_E, recv_counts_E, group_name, "dispatch", -1,
                                    name="dispatch"), name="x_RD")
        rows_R = b.method("size", x_RD, 0, name="rows_R")
        ids_R1 = b.fn(LOCAL_EXPERT_IDS, recv_counts_E, L, rows_R, name="local_experts_R1")
        local = b.fn(dialect.PERMUTE, x_RD, ids_R1, L, name="local_permute")
        x_MD, counts_L, order_R = b.item(local, 0, "x_MD"), b.item(local, 1, "counts_L"), b.item(local, 2, "order_R")
        reads: dict[str, fx.Node] = {}
        weights = canonical.expert_weights(
            b, spec.experts, lambda source, role: _local_weight(b, weight_attrs[role], source, role, reads))
        world = layout.groups.world_size
        if world > 1:  # expert-weight gradients / W, the input gradient unchanged (see grad_scale)
            x_MD = b.fn(grad_scale, x_MD, float(world), name="x_MD_grad_times_W")
        y_MD = b.fn(dialect.EXPERT_FFN, x_MD, counts_L, *weights, *ffn.args[8:], name="y_MD")
        if world > 1:
            y_MD = b.fn(grad_scale, y_MD, 1.0 / world, name="y_MD_grad_over_W")
        y_R1D = b.fn(dialect.UNPERMUTE, y_MD, order_R, 1, name="y_R1D")
        y_RD = b.method("flatten", y_R1D, 0, 1, name="y_RD")
        rows_N = b.method("size", x_ND, 0, name="rows_N")
        y_ND = b.fn(comm.WAIT, b.fn(comm.ALL_TO_ALL, y_RD, recv_counts_E, counts_E, group_name, "combine", rows_N,
                                    name="combine"), name="y_ND_combined")
    ffn.replace_all_uses_with(y_ND)
    graph.erase_node(ffn)
    graph.eliminate_dead_code()
    graph.lint()
    return {"experts": E, "local_experts": L, "ep_size": layout.groups.ep_size, "dp_size": layout.groups.dp_size,
            "capacity": int(bool(keeps))}


def rewrite_ep(gm: MoEGraphModule, plan: Plan) -> PassResult:
    """The EP pass: shard the block's experts over the EP group and rewrite its graph (see module doc)."""
    spec = gm.spec
    device = next(iter(gm.parameters())).device
    groups = ep_groups(plan.topology, plan.ep_size, device.type)
    E, P = spec.num_experts, groups.ep_size
    if E % P:
        world = groups.world_size
        given = f"Plan.ep_size={P}" if plan.ep_size is not None else f"Plan.ep_size=None (the world size, {P})"
        valid = [d for d in range(1, world + 1) if world % d == 0 and E % d == 0]
        raise PlanError(f"{given} is invalid for block {spec.path or '<root>'}: its {E} experts do not split evenly "
                        f"over {P} EP ranks; use an ep_size dividing both {E} and the world size {world} "
                        f"(valid: {valid}), or leave this block alone with Plan(blocks={{{spec.path!r}: None}}).")
    assert spec.capacity == ep_capacity(spec, plan), "pipeline.resolve applies the EP capacity before canonical.build"
    L = E // P
    layout = EPLayout(num_experts=E, local_experts=L, first_expert=groups.ep_rank * L, groups=groups)
    weight_attrs = _shard_parameters(gm, spec, groups, layout)
    stats = rewrite_graph(gm, weight_attrs, layout)
    _drop_stacked_originals(gm, spec, layout)  # after the graph stopped reading them
    gm.recompile()
    if groups.dp_size > 1:  # replicas of the same experts sum their gradients
        for name in layout.expert_param_names():
            gm.get_parameter(name).register_hook(_expert_grad_hook(groups))
    gm.form = PASS
    gm.layout = layout
    return PassResult(gm, changed=True, stats=stats)


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Fully qualified names of every EP-sharded expert parameter in `model`."""
    names = []
    for path, module in model.named_modules():
        layout = module.layout if isinstance(module, MoEGraphModule) else None
        if isinstance(layout, EPLayout):
            names += [f"{path}.{n}" if path else n for n in layout.expert_param_names()]
    return names


def finalize_model(model: nn.Module) -> None:
    """Model-level set-up after all blocks are rewritten: DDP ignores the expert parameters."""
    names = expert_parameter_names(model)
    if names:
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(model, names)


