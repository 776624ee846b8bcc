"""Generate the canonical single-device dialect graph of an MoE block from its MoESpec.

The graph reads the user's own parameters (`get_attr` on the block), so the rewritten block keeps
the original parameter objects, names and shapes: gradients land where the optimizer expects them
and `state_dict()` is unchanged.

    hidden_states ─reshape─► x_TD ─linear─► logits_TE ─route─► weights_TK, experts_TK
        [─capacity_keep─► keep_TK]
    x_TD ─permute─► x_ND, counts_E, order_N ─expert_ffn─► y_ND ─unpermute─► y_TKD ─combine─► out_TD
        [+ shared(x_TD) · sigmoid(shared_gate(x_TD))] ─reshape─► output (+ side outputs)

With an input module (`MoESpec.input_module`, a norm on the experts' input only) the experts and shared
experts read `input_module(x_TD)` while the router reads x_TD.

With heads (Multi-Head LatentMoE, `spec.heads`), routing and experts work on latent sub-tokens:

    hidden_states ─reshape─► x_TD ─linear(w_in)─► z_TQ ─reshape─► z_Gh
    z_Gh ─einsum(router [H, E, h])─► logits_GE ─route(+ selection_bias_HE repeated to _GE)─► weights_GK, experts_GK
        [─update_selection_bias─► the block's bias buffer, train mode]
    experts_GK + head * E ─► ids_GK;  z_Gh ─permute─► expert_ffn ─unpermute─► combine ─► y_Gh
    y_Gh ─reshape─► y_TQ ─linear(w_out)─► out_TD ─reshape─► output

z_TQ and the final linear are where head parallel cuts (its token exchange goes between them).

With a per-expert output scale (`ExpertsSpec.output_scale`) the weights become weights_TK *
scale_O[experts_TK] before the combine. With zero-compute experts (`identity_experts` / `zero_experts`):

    experts_TK ─expert_slots─► slots_TK (FFN experts 0..E-1, identity E, zero E+1)
    x_TD ─permute(E+2)─► x_ND, counts_J, order_N;  x_ND ─ffn_rows─► x_MD (the leading FFN rows)
    x_MD ─expert_ffn(counts_J[:E])─► y_MD ─zero_compute_rows─► y_ND (identity rows: x, zero rows: 0) ─► unpermute

Generic experts (`ExpertsSpec.kind="generic"`, not a known FFN) put `generic_experts.run_experts(x_ND,
counts_E, expert_template, names, *stacked_E)` where `moe.expert_ffn` is: the user's expert module run
on each expert's rows with that expert's tensors (`expert_template` is a stateless copy of one expert).

Shape letters: `moepass.spec.SHAPES` (here O router outputs and J permute slots of zero-compute experts;
G = T*H sub-tokens and X = H*E experts with heads).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from moepass import dialect, eager, ffn_autograd, generic_experts
from moepass.block_state import (  # noqa: F401  (re-exported: the passes and detection use them)
    adjacent_view,
    adopt_state,
    check_block_input,
    parameter_at,
    relayout_stacked,
    stacked_buffer,
    stacked_copies,
    stacked_parameters,
    stacked_relayout,
)
from moepass.errors import PlanError
from moepass.operands import graph_leaf
from moepass.row_ops import expert_slots, ffn_rows, row_weights, weighted_rows, zero_compute_rows
from moepass.runtime import faster
from moepass.spec import (
    LOAD_OUTPUT,
    ROUTER_OUTPUT,
    TRACED_ROUTER,
    CapacitySpec,
    Constant,
    ExpertsSpec,
    MoESpec,
    RouterSpec,
    TensorSource,
)

if TYPE_CHECKING:
    from moepass.runtime.layout import ExpertLayout

CANONICAL_PASS = "canonical"


class MoEGraphModule(fx.GraphModule):
    """An MoE block rewritten as a dialect graph. Owns the original block's children and tensors.

    `spec` is the block's MoESpec, `form` the parallel form of the graph, `history` the passes that
    produced it (name, seconds, counts), `layout` where its experts live when a distributed form
    placed them (a `moepass.runtime.layout.ExpertLayout`: `EPLayout`, `FSEPLayout`; None for the single
    form). Every form fills `layout` the same way; checkpoints, gradients and the schedule read it here.
    """

    layout: ExpertLayout | None

    def __init__(self, block: nn.Module, graph: fx.Graph, spec: MoESpec, form: str = "single"):
        # on an empty graph first: else GraphModule copies each tensor it reads into stubs `adopt_state` drops
        super().__init__(block, fx.Graph(), class_name="MoEGraphModule")
        adopt_state(self, block)
        self.graph = graph
        self.spec = spec
        self.form = form
        self.history: list[dict[str, Any]] = []
        self.layout = None
        self.meta["moepass_dialect"] = True

    def recompile(self):  # type: ignore[no-untyped-def]  # fx.GraphModule's signature
        """GraphModule's recompile, then the eager fast path (`moepass.eager`): run eagerly, the block calls
        its ops' functions directly; traced or compiled, the graph's own code runs."""
        code = super().recompile()
        eager.install(self, check_block_input)
        faster.install(type(self))  # the user's block instead, where compile attached it and it was faster
        return code

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's signature
        """`.to(...)`, `.cuda()`, `to_empty(...)` give every tensor its own storage: the single form lays its
        per-expert weights in one buffer per role again (`relayout_stacked`), for the graph to read as one view
        (a model compiled on meta, then `to_empty`). Plain CPU / CUDA parameters only, not DTensor or meta."""
        super()._apply(fn, recurse)
        if getattr(self, "form", None) == "single":
            groups = stacked_parameters(self, self.spec)
            if all(type(p.data) is torch.Tensor and not p.is_meta for params in groups for p in params):
                relayout_stacked(self, self.spec)
        return self


class _StackExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):  # type: ignore[override]
        view = adjacent_view(tensors)
        return torch.stack(tensors) if view is None else view

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.unbind(0)


def stack_experts(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack(tensors)` that copies nothing when the tensors are adjacent in one storage.

    ModuleList experts keep one parameter per expert; `relayout_stacked` puts each role's parameters
    one after another in one buffer at compile time, and this reads them as one `[E, ...]` view each
    step. If something re-allocated them since (`model.to(...)`, a load that replaced the tensors),
    it stacks them (a copy): slower, never wrong; so does a Dynamo trace. The backward hands each
    parameter its slice.
    """
    if isinstance(tensors[0], fx.Proxy):  # FX re-tracing the generated code (unpickling): stay one node
        return tensors[0].tracer.create_proxy("call_function", stack_experts, (list(tensors),), {})
    if torch.compiler.is_compiling():  # traced: parameters are graph inputs, the compiler owns their layout
        return torch.stack(tensors)
    return ffn_autograd.mark_experts(_StackExperts.apply(*tensors), tensors)


def jitter(x: torch.Tensor, eps: float, training: bool) -> torch.Tensor:
    """Train-mode multiplicative input noise U(1-eps, 1+eps), drawn as Mixtral draws it."""
    if not training or eps <= 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)


@graph_leaf  # its control flow cannot run on a traced size (an unpickled graph is traced again)
def capacity_of(tokens: int, group_size: int, top_k: int, num_experts: int, factor: float | None,
                fixed: int | None, min_capacity: int, rounding: str = "ceil") -> int:
    """Per-group expert capacity for this call (a Python int, computed from static sizes)."""
    group_tokens = group_size if group_size > 0 else tokens
    return CapacitySpec(capacity_factor=factor, fixed=fixed, min_capacity=min_capacity, rounding=rounding).capacity(
        group_tokens, top_k, num_experts)


@graph_leaf
def sequence_group_size(hidden_states: torch.Tensor, scope: str) -> int:
    """Tokens per capacity group: a sequence (dim -2 of [B, S, D]) or all tokens (0)."""
    return hidden_states.shape[-2] if scope == "sequence" and hidden_states.dim() >= 3 else 0


# The expert FFN's weight operands in `moe.expert_ffn` order, with their node names.
WEIGHT_NAMES = {"w_gate": "w_gate_EFD", "w_up": "w_up_EFD", "w_down": "w_down_EDF", "b_gate": "b_gate_EF",
                "b_up": "b_up_EF", "b_down": "b_down_ED"}


ROLES = tuple(WEIGHT_NAMES)


class GraphBuilder:
    """fx.Graph construction with readable node names and provenance on every node."""

    def __init__(self, pass_name: str, block_path: str):
        self.graph = fx.Graph()
        self.pass_name = pass_name
        self.block_path = block_path
        # One read of each weight and one chunk of it, however many roles use its pieces: two reads
        # would give autograd two chunk backwards, each zero-filling and concatenating a full gradient.
        self._reads: dict[tuple[str, ...], fx.Node] = {}
        self._chunks: dict[tuple[str, int, int], fx.Node] = {}
        self._unflat: dict[tuple[str, int], fx.Node] = {}

    def _stamp(self, node: fx.Node) -> fx.Node:
        node.meta["moepass"] = {"pass": self.pass_name, "block": self.block_path}
        return node

    def input(self, name: str, default: Any = inspect.Signature.empty) -> fx.Node:
        return self._stamp(self.graph.placeholder(name, default_value=default))

    def attr(self, target: str, name: str | None = None) -> fx.Node:
        return self._stamp(self.graph.create_node("get_attr", target, name=name or target.replace(".", "_")))

    def fn(self, target: Any, *args: Any, name: str | None = None, **kwargs: Any) -> fx.Node:
        return self._stamp(self.graph.create_node("call_function", target, args, kwargs, name=name))

    def method(self, method: str, *args: Any, name: str | None = None) -> fx.Node:
        return self._stamp(self.graph.create_node("call_method", method, args, {}, name=name))

    def module(self, target: str, *args: Any, name: str | None = None, **kwargs: Any) -> fx.Node:
        return self._stamp(self.graph.create_node("call_module", target, args, kwargs, name=name))

    def item(self, node: fx.Node, index: int, name: str) -> fx.Node:
        return self.fn(operator.getitem, node, index, name=name)

    def output(self, value: Any) -> fx.Node:
        return self._stamp(self.graph.output(value))

    def tensor(self, source: TensorSource | None, name: str) -> fx.Node | None:
        """Nodes reading one canonical weight from the block's parameters (see TensorSource)."""
        if source is None:
            return None
        node = self._reads.get(source.paths)
        if node is None:
            parts = [self.attr(p) for p in source.paths]
            node = self.fn(stack_experts, parts, name=f"{name}_stacked") if source.stacked else parts[0]
            self._reads[source.paths] = node
        return self.view(source, node, name)

    def view(self, source: TensorSource, node: fx.Node, name: str) -> fx.Node:
        """`source`'s unflatten, chunk and transpose applied to an already read (stacked or sharded) tensor."""
        if source.unflatten is not None:  # [E·n, ...] -> [E, n, ...] (a local shard of whole experts: E/P·n rows)
            flat_key = (node.name, source.unflatten)
            if flat_key not in self._unflat:  # one view of the tensor for every role reading it (as its chunk)
                self._unflat[flat_key] = self.method("unflatten", node, 0, (-1, source.unflatten),
                                                     name=f"{name}_unflat")
            node = self._unflat[flat_key]
        if source.chunk is not None:
            index, count = source.chunk
            key = (node.name, count, source.chunk_dim)
            if key not in self._chunks:
                self._chunks[key] = self.method("chunk", node, count, source.chunk_dim, name=f"{name}_chunks")
            node = self.item(self._chunks[key], index, name=f"{name}_chunk")
        if source.interleave is not None:
            node = self.fn(interleaved, node, source.interleave, source.chunk_dim, name=f"{name}_interleaved")
        if source.transpose:
            node = self.method("transpose", node, -2, -1, name=f"{name}_t")
        return node


def interleaved(tensor: torch.Tensor, start_step: tuple[int, int], dim: int) -> torch.Tensor:
    """Every step-th slice of `tensor` along `dim`, from `start` (a view: its gradient lands in place)."""
    start, step = start_step
    return tensor[(slice(None),) * (dim % tensor.dim()) + (slice(start, None, step),)]


def view_of(source: TensorSource, tensor: torch.Tensor) -> torch.Tensor:
    """`GraphBuilder.view` run eagerly: `source`'s unflatten, chunk and transpose applied to an already read tensor."""
    if source.unflatten is not None:
        tensor = tensor.unflatten(0, (-1, source.unflatten))
    if source.chunk is not None:
        index, count = source.chunk
        tensor = tensor.chunk(count, source.chunk_dim)[index]
    if source.interleave is not None:
        tensor = interleaved(tensor, source.interleave, source.chunk_dim)
    return tensor.transpose(-2, -1) if source.transpose else tensor


def fused_gate_up_source(experts: ExpertsSpec) -> TensorSource | None:
    """The one tensor gate and up are read from, when they are its two halves along F (gate first)
    and carry no biases: the expert FFN then takes it whole (`grouped_ffn.fused_gate_up`)."""
    g, u = experts.w_gate, experts.w_up
    if u is None or experts.b_gate is not None or experts.b_up is not None:
        return None
    if g.chunk != (0, 2) or u.chunk != (1, 2) or dataclasses.replace(g, chunk=None) != dataclasses.replace(u, chunk=None):
        return None
    f_axis = (-1, 2) if g.transpose else (-2, 1)  # the F axis before the transpose, if any
    if g.chunk_dim not in f_axis:
        return None
    return dataclasses.replace(g, chunk=None)


def expert_weights(b: GraphBuilder, experts: ExpertsSpec, read: Any) -> list[fx.Node | None]:
    """The six weight operands of `moe.expert_ffn` (gate, up, down, and their biases); `read(source, role)`
    makes the node of one. Fused gate/up (one tensor's halves) passes the whole tensor as gate, no up.
    Generic experts: their stacked tensors, in `ExpertsSpec.tensors` order (`generic_experts.run_experts`)."""
    if experts.kind == "generic":
        return [read(source, role) for role, source in experts.sources().items()]
    fused = fused_gate_up_source(experts)
    sources = {role: getattr(experts, role) for role in ROLES}
    if fused is not None:
        sources.update(w_gate=fused, w_up=None)
    return [None if sources[role] is None else read(sources[role], role) for role in ROLES]


def routed_experts(b: GraphBuilder, spec: MoESpec, x_rows: fx.Node, experts_ids: fx.Node, weights: fx.Node,
                   num_experts: int, names: dict[str, str]) -> fx.Node:
    """permute -> expert_ffn -> unpermute -> combine over `num_experts` experts: the weighted sum of each
    row's K expert outputs. `names` gives the node names by role (x, counts, order, y, y_k, out).

    With zero-compute experts (`ExpertsSpec.identity_experts` / `zero_experts`) the permute sorts by slot
    (`expert_slots`: FFN experts, then identity, then zero rows), the expert FFN gets only the FFN rows,
    and `zero_compute_rows` puts back the identity rows' inputs and the zero rows' zeros before the
    unpermute: those rows never reach the expert FFN (nor, under EP, the all-to-all)."""
    x, K = spec.experts, spec.top_k
    zero_compute = x.routed_experts != x.num_experts
    slots = num_experts
    if zero_compute:
        experts_ids = b.fn(expert_slots, experts_ids, x.ffn_ids, x.identity_experts, x.routed_experts,
                           name="slots_TK")
        slots = num_experts + 2
    permuted = b.fn(dialect.PERMUTE, x_rows, experts_ids, slots, name="permute")
    x_N = b.item(permuted, 0, names["x"])
    counts = b.item(permuted, 1, "counts_J" if zero_compute else names["counts"])
    order_N = b.item(permuted, 2, names["order"])
    x_all, counts_J = x_N, counts
    if zero_compute:
        counts = b.fn(operator.getitem, counts_J, slice(0, num_experts), name=names["counts"])
        x_N = b.fn(ffn_rows, x_all, counts, name="x_MD")
    if spec.weights_on == "input":  # each row enters its expert times its weight; the combine sums the outputs
        w_N = b.fn(row_weights, weights, order_N, name="weights_N")
        x_N = b.fn(weighted_rows, x_N, w_N, name=f"{names['x']}_weighted")
        weights = b.fn(torch.ones_like, weights, name="unit_weights_TK")
    y_N = expert_compute(b, x, x_N, counts, "y_MD" if zero_compute else names["y"])
    if zero_compute:
        y_N = b.fn(zero_compute_rows, y_N, x_all, counts_J, name=names["y"])
    y_K = b.fn(dialect.UNPERMUTE, y_N, order_N, K, name=names["y_k"])
    return b.fn(dialect.COMBINE, y_K, weights, name=names["out"])


def expert_compute(b: GraphBuilder, x: ExpertsSpec, x_N: fx.Node, counts: fx.Node, name: str) -> fx.Node:
    """The node computing every expert on its rows: `moe.expert_ffn`, or for generic experts
    `generic_experts.run_experts` on the block's stateless template and each stacked expert tensor."""
    if x.kind == "generic":
        stacked = expert_weights(b, x, lambda source, role: b.tensor(source, f"{role}_E"))
        return b.fn(generic_experts.run_experts, x_N, counts, b.attr(generic_experts.TEMPLATE),
                    tuple(n for n, _ in x.tensors), *stacked, name=name)
    casts = () if x.compute_dtype is None else (False, getattr(torch, x.compute_dtype))  # recompute, compute_dtype
    return b.fn(dialect.EXPERT_FFN, x_N, counts,
                *expert_weights(b, x, lambda source, role: b.tensor(source, WEIGHT_NAMES[role])),
                x.activation, x.clamp_limit, x.swiglu_alpha, *casts, name=name)


PLAIN_NAMES = dict(x="x_ND", counts="counts_E", order="order_N", y="y_ND", y_k="y_TKD", out="out_TD")
HEAD_NAMES = dict(x="z_Nh", counts="counts_X", order="order_N", y="y_Nh", y_k="y_GKh", out="y_Gh")


def routing_names(spec: MoESpec) -> tuple[str, str, str]:
    """Names of the (logits, selected experts, selection bias as route reads it) nodes of `spec`'s graph:
    per token, or per sub-token with heads (the semantic check reads them)."""
    if spec.heads is not None:
        return "logits_GE", "experts_GK", "selection_bias_GE"
    return "logits_TE", "experts_TK", "selection_bias_E"


def head_expert_ids(experts_GK: torch.Tensor, num_heads: int, experts_per_head: int) -> torch.Tensor:
    """Global expert ids of sub-tokens (rows token-major, head-minor): head j's choice e is j*E + e."""
    G, K = experts_GK.shape
    offsets_1H1 = torch.arange(num_heads, device=experts_GK.device).view(1, num_heads, 1) * experts_per_head
    return (experts_GK.reshape(G // num_heads, num_heads, K) + offsets_1H1).reshape(G, K)


def build_heads_graph(spec: MoESpec) -> fx.Graph:
    """The canonical graph of a Multi-Head LatentMoE (`spec.heads`): see the module docstring."""
    assert spec.heads is not None
    b = GraphBuilder(CANONICAL_PASS, spec.path)
    r, hd, K = spec.router, spec.heads, spec.top_k
    H, h, D, E = hd.num_heads, hd.head_dim, hd.model_dim, r.num_experts

    inputs = [b.input(n) for n in spec.input_names]
    hidden = inputs[0]
    if r.jitter_eps > 0:
        hidden = b.fn(jitter, hidden, r.jitter_eps, b.attr("training"), name="hidden_jittered")
    x_TD = b.method("reshape", hidden, -1, D, name="x_TD")
    z_TQ = b.fn(F.linear, x_TD, b.tensor(hd.w_in, "w_in_QD"), name="z_TQ")  # W_mh: every head's projection
    z_Gh = b.method("reshape", z_TQ, -1, h, name="z_Gh")

    # per-head routers: logits[t, j] = z[t, j] @ router[j].T, in the router's dtype
    w_router = b.tensor(r.weight, "w_router_HEh")
    z_in = z_Gh
    if r.dtype == "float32":
        z_in = b.method("float", z_Gh, name="z_Gh_f32")
        w_router = b.method("float", w_router, name="w_router_f32")
    z_THh = b.method("view", z_in, -1, H, h, name="z_THh")
    logits_THE = b.fn(torch.einsum, "thc,hec->the", z_THh, w_router, name="logits_THE")
    logits_GE = b.method("reshape", logits_THE, -1, E, name="logits_GE")
    logits_f32 = b.method("float", logits_GE, name="logits_f32")
    bias_HE = b.tensor(r.selection_bias, "selection_bias_HE")
    bias_GE = None
    if bias_HE is not None:  # each head's bias, one row per sub-token
        tokens = b.method("size", x_TD, 0, name="tokens")
        bias_GE = b.method("repeat", bias_HE, tokens, 1, name="selection_bias_GE")
    routed = b.fn(dialect.ROUTE, logits_f32, bias_GE, r.score_func, r.softmax_before_topk, K, r.renormalize,
                  r.n_group, r.topk_group, r.group_score, r.routed_scaling_factor, name="route")
    weights_GK = b.item(routed, 0, "weights_GK")
    experts_GK = b.item(routed, 1, "experts_GK")  # per head: 0 .. E-1
    if bias_HE is not None and r.bias_update_rate > 0:  # aux-loss-free balancing, train mode only
        b.fn(dialect.UPDATE_SELECTION_BIAS, bias_HE, experts_GK, r.bias_update_rate, b.attr("training"),
             name="update_selection_bias")
    ids_GK = b.fn(head_expert_ids, experts_GK, H, E, name="ids_GK")  # head j's experts: j*E .. j*E+E-1

    y_Gh = routed_experts(b, spec, z_Gh, ids_GK, weights_GK, H * E, HEAD_NAMES)
    y_TQ = b.method("reshape", y_Gh, -1, H * h, name="y_TQ")
    out_TD = b.fn(F.linear, y_TQ, b.tensor(hd.w_out, "w_out_DQ"), name="out_TD")  # W_mg
    out = b.method("view_as", out_TD, inputs[0], name="out")
    outputs = [out] + [logits_GE for _ in spec.side_outputs]  # the only side output: router_logits
    b.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    return b.graph


def build_graph(spec: MoESpec) -> fx.Graph:
    """The canonical dialect graph of `spec`, as a plain fx.Graph."""
    if spec.heads is not None:
        return build_heads_graph(spec)
    b = GraphBuilder(CANONICAL_PASS, spec.path)
    r, E, K, D = spec.router, spec.num_experts, spec.top_k, spec.experts.hidden_dim

    inputs = block_inputs(b, spec)
    hidden = inputs[0]
    if r.jitter_eps > 0:
        training = b.attr("training")
        hidden = b.fn(jitter, hidden, r.jitter_eps, training, name="hidden_jittered")
    x_TD = b.method("reshape", hidden, -1, D, name="x_TD")

    # router: logits in the router's dtype, then selection in fp32
    router_logits = None  # what the router module returns as logits (its hooks record this value)
    out = None  # the router module's call, when the graph calls it
    if r.logits_from == "selection":  # the user's router module selects: its weights and experts as they are
        assert r.module_output_index is not None and r.module_experts_index is not None  # RouterSpec.validate
        out = router_call(b, r, hidden, x_TD, dict(zip(spec.input_names, inputs)))
        weights_TK = b.method("reshape", b.item(out, r.module_output_index, "router_weights"), -1, K,
                              name="weights_TK")
        experts_TK = b.method("reshape", b.item(out, r.module_experts_index, "router_experts"), -1, K,
                              name="experts_TK")
        return build_experts_and_output(b, spec, inputs, hidden, x_TD, weights_TK, experts_TK, None, None, None,
                                        router_out=out)
    if r.logits_from in ("module", "traced"):  # called on the block's input as given, like HF blocks call it
        out = router_call(b, r, hidden, x_TD, dict(zip(spec.input_names, inputs)))
        router_logits = out if r.module_output_index is None else b.item(out, r.module_output_index,
                                                                          "router_logits")
        logits_TE = b.method("reshape", router_logits, -1, E, name="logits_TE")
    else:
        w_router = b.tensor(r.weight, "w_router_ED")
        bias = b.tensor(r.bias, "b_router_E")
        if r.dtype == "float32":
            x_in = b.method("float", x_TD, name="x_TD_f32")
            w_router = b.method("float", w_router, name="w_router_f32")
            bias = None if bias is None else b.method("float", bias, name="b_router_f32")
        else:
            x_in = x_TD
        logits_TE = b.fn(F.linear, x_in, w_router, bias, name="logits_TE")
    logits_f32 = b.method("float", logits_TE, name="logits_f32")
    selection_bias = b.tensor(r.selection_bias, "selection_bias_E")
    routed = b.fn(dialect.ROUTE, logits_f32, selection_bias, r.score_func, r.softmax_before_topk, K,
                  r.renormalize, r.n_group, r.topk_group, r.group_score, r.routed_scaling_factor, name="route")
    weights_TK = b.item(routed, 0, "weights_TK")
    experts_TK = b.item(routed, 1, "experts_TK")
    return build_experts_and_output(b, spec, inputs, hidden, x_TD, weights_TK, experts_TK, logits_TE, router_logits,
                                    selection_bias, router_out=out)


def block_inputs(b: GraphBuilder, spec: MoESpec) -> list[fx.Node]:
    """The graph's inputs: the hidden states, then the block's further inputs (token ids), each checked by
    `further_input`."""
    hidden = b.input(spec.input_names[0])
    further = [b.input(name, default=None) if name in spec.unused_inputs else  # taken as the block takes it, unread
               b.fn(further_input, b.input(name, default=None), hidden, name, spec.path, name=f"{name}_checked")
               for name in spec.input_names[1:]]
    return [hidden, *further]


def further_input(value: torch.Tensor | None, hidden: torch.Tensor, name: str, path: str) -> torch.Tensor:
    """A block input after the hidden states (the token ids a hash router is keyed by). Shape propagation
    (the verifier, the lowering) runs the graph on the hidden states alone: fake token ids stand in; a real
    call without them is an error (ValueError naming the block and the input)."""
    if value is not None:
        return value
    if isinstance(hidden, torch._subclasses.FakeTensor):
        return hidden.new_zeros(hidden.shape[:-1], dtype=torch.int64)
    raise ValueError(f"MoE block {path or '<root>'!r} takes {name} after the hidden states (its router is keyed by "
                     f"them): call it as block(hidden_states, {name}).")


def router_call(b: GraphBuilder, r: RouterSpec, hidden: fx.Node, x_TD: fx.Node,
                block_inputs: dict[str, fx.Node]) -> fx.Node:
    """The router module called as the block calls it: on the input (as given, or as [T, D] tokens), then
    `module_args`: the block's own tensors, or its further inputs by name (token ids)."""
    first = hidden if r.module_input == "hidden" else x_TD
    extra = [name.value if isinstance(name, Constant) else block_inputs[name] if name in block_inputs
             else b.attr(name) for name in r.module_args]
    target = TRACED_ROUTER if r.logits_from == "traced" else r.module_path
    return b.module(target, first, *extra, name="router_out")


def build_experts_and_output(b: GraphBuilder, spec: MoESpec, inputs: list[fx.Node], hidden: fx.Node, x_TD: fx.Node,
                             weights_TK: fx.Node, experts_TK: fx.Node, logits_TE: fx.Node | None,
                             router_logits: fx.Node | None, selection_bias: fx.Node | None,
                             router_out: fx.Node | None = None) -> fx.Graph:
    """Capacity, the routed experts, pass-through, shared experts and the outputs (see the module doc).
    `router_out`: the router module's call (a shared expert may take its outputs)."""
    r, E, K = spec.router, spec.num_experts, spec.top_k
    selected = {"topk_weights": weights_TK, "topk_experts": experts_TK}  # as routed, before capacity
    dropped_TK = None
    if spec.capacity is not None:
        c = spec.capacity
        tokens = b.method("size", x_TD, 0, name="tokens")
        group = b.fn(sequence_group_size, hidden, c.scope, name="group_size")
        capacity = b.fn(capacity_of, tokens, group, K, E, c.capacity_factor, c.fixed, c.min_capacity, c.rounding,
                        name="capacity")
        keep_TK = b.fn(dialect.CAPACITY_KEEP, experts_TK, E, capacity, group, c.priority == "k_major",
                       name="keep_TK")
        if c.drop_policy == "identity":
            dropped_TK = b.fn(torch.logical_not, keep_TK, name="dropped_TK")
            dropped_TK = b.fn(operator.mul, weights_TK, dropped_TK, name="dropped_weights_TK")
        weights_TK = b.fn(operator.mul, weights_TK, keep_TK, name="kept_weights_TK")

    if spec.experts.output_scale is not None:  # expert r's output times scale[r]: folded into its weight
        scale_O = b.method("reshape", b.tensor(spec.experts.output_scale, "output_scale"), -1, name="output_scale_O")
        scale_TK = b.fn(operator.getitem, scale_O, experts_TK, name="output_scale_TK")
        weights_TK = b.fn(operator.mul, weights_TK, scale_TK, name="scaled_weights_TK")

    if r.logits_from == "selection" and r.selection_scale != 1.0:  # the block scales its router module's weights
        weights_TK = b.fn(operator.mul, weights_TK, r.selection_scale, name="selection_scaled_weights_TK")

    if selection_bias is not None and r.bias_update_rate > 0:  # aux-loss-free balancing, train mode only
        b.fn(dialect.UPDATE_SELECTION_BIAS, selection_bias, experts_TK, r.bias_update_rate, b.attr("training"),
             name="update_selection_bias")
    if spec.load_counter is not None:  # the block's own load statistic, train mode only
        b.fn(dialect.COUNT_LOAD, b.tensor(spec.load_counter, "load_counter_O"), experts_TK, b.attr("training"),
             name="count_load")
    xe_TD = x_TD  # what the experts read: the tokens, or the block's input module on them (the router read x_TD)
    if spec.input_module is not None:
        xe_TD = b.module(spec.input_module, x_TD, name="experts_in_TD")
    out_TD = routed_experts(b, spec, xe_TD, experts_TK, weights_TK, E, PLAIN_NAMES)

    if spec.output_bias is not None:  # a bias the block adds to the combined output, outside the experts
        out_TD = b.fn(operator.add, out_TD, b.tensor(spec.output_bias, "output_bias_D"), name="out_plus_bias_TD")

    if dropped_TK is not None:  # dropped top-1 tokens pass their input through, scaled by their weight
        passthrough_TD = b.fn(operator.mul, x_TD, b.method("to", dropped_TK, x_TD, name="dropped_w"),
                              name="passthrough_TD")
        out_TD = b.fn(operator.add, out_TD, passthrough_TD, name="out_with_passthrough_TD")

    if spec.shared is not None:
        if spec.shared.router_outputs:  # it also takes router outputs (MoESpec.validate: the router is a module)
            assert router_out is not None
            taken = [(key, b.item(router_out, i, f"shared_arg_{i}")) for key, i in spec.shared.router_outputs]
            shared_TD = b.module(spec.shared.module_path, xe_TD, *[n for key, n in taken if not key], name="shared_TD",
                                 **{key: n for key, n in taken if key})
        else:
            shared_TD = b.module(spec.shared.module_path, xe_TD, name="shared_TD")
        if spec.shared.gate_path is not None:
            gate_T1 = b.module(spec.shared.gate_path, xe_TD, name="shared_gate_T1")
            shared_TD = b.fn(operator.mul, b.fn(torch.sigmoid, gate_T1, name="shared_gate_sigmoid"), shared_TD,
                             name="shared_gated_TD")
        out_TD = b.fn(operator.add, out_TD, shared_TD, name="out_plus_shared_TD")

    out = out_TD if spec.flat_output else b.method("view_as", out_TD, inputs[0], name="out")
    if spec.autocast_output:
        out = b.fn(dialect.AUTOCAST_OUTPUT, out, name="out_autocast")
    if spec.output_module is not None:  # the block's last call, on what it returns (a norm), as it is
        out = b.module(spec.output_module, out, name="out_post")
    side: dict[str, Any] = {"router_logits": logits_TE if router_logits is None else router_logits, "none": None,
                            **selected}
    for name in spec.side_outputs:
        if name.startswith(ROUTER_OUTPUT):  # what the router module returns there, as it is (spec.validate)
            assert router_out is not None
            side[name] = b.item(router_out, int(name.removeprefix(ROUTER_OUTPUT)), name.replace(".", "_"))
        elif name.startswith(LOAD_OUTPUT):  # each expert's load, in the dtype the block returns it in
            dtype = getattr(torch, name.removeprefix(LOAD_OUTPUT))
            load_O = b.fn(dialect.expert_load_ref, experts_TK, spec.router.num_experts, name="expert_load_O")
            side[name] = b.method("to", load_O, dtype, name="expert_load_as_returned")
    outputs = [out] + [side[name] for name in spec.side_outputs]
    b.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    return b.graph


def build(spec: MoESpec, block: nn.Module) -> MoEGraphModule:
    """The canonical MoEGraphModule for `block` (whose structure `spec` describes)."""
    gm = MoEGraphModule(block, build_graph(spec), spec)
    if spec.experts.kind == "generic":  # the function the generic expert op runs (it holds no tensor)
        assert spec.experts.template is not None  # ExpertsSpec.validate
        if hasattr(block, generic_experts.TEMPLATE):
            raise PlanError(f"block {spec.path or '<root>'!r} has an attribute {generic_experts.TEMPLATE!r}, the name "
                            f"its rewritten form gives the generic experts' template; rename it, or leave this block "
                            f"alone with Plan(blocks={{{spec.path!r}: None}}).")
        gm.add_module(generic_experts.TEMPLATE, generic_experts.stateless_template(
            block.get_submodule(spec.experts.template)))
    if spec.router.logits_from == "traced":  # the block's own router code up to the logits (holds no tensor)
        if hasattr(block, TRACED_ROUTER):
            raise PlanError(f"block {spec.path or '<root>'!r} has an attribute {TRACED_ROUTER!r}, the name its "
                            f"rewritten form gives its traced router; rename it, or leave this block alone with "
                            f"Plan(blocks={{{spec.path!r}: None}}).")
        gm.add_module(TRACED_ROUTER, copy.deepcopy(spec.router.traced))
    gm.history.append({"pass": CANONICAL_PASS, "seconds": 0.0, "stats": {"nodes": len(gm.graph.nodes)}})
    return gm
