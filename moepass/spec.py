"""MoESpec: the one representation of an MoE block that every pass reads.

A spec says *what* a block computes (router, experts, shared experts, capacity) and *where its
weights live* in the user's module, never how the block is implemented. The canonical dialect graph
is generated from it (`moepass.canonical`), and the semantic check compares that graph against the
user's block before anything is rewritten.

Tensors are named by role and shape (`x_TD`, `w_up_EFD`, `counts_E`): `SHAPES` below is the one table of
shape letters for moepass, lowering and cost_model, one meaning each (`tests/test_shape_letters.py` keeps
files from defining their own). With heads (Multi-Head LatentMoE, `HeadsSpec`) every token is H sub-tokens
of width h, each routed among its own head's E experts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS
from moepass.errors import PlanError, nearest

# The shape letters: a name's suffix lists its tensor's dims in order (`w_up_EFD`: [E, F, D]); a digit is a
# literal size (`ids_R1`: [R, 1]). Lower-case letters are for sizes that only a few files meet.
SHAPES: dict[str, str] = {
    "A": "expert groups of group-limited routing (n_group)",
    "B": "batch: sequences",
    "C": "expert slots per device (FSEP)",
    "D": "model width",
    "E": "routed experts (of one head, with heads)",
    "F": "expert hidden width",
    "G": "sub-tokens, T*H (with heads: token-major, head-minor)",
    "H": "heads",
    "I": "expert groups each token keeps (topk_group)",
    "J": "permute slots with zero-compute experts: the E FFN experts, identity, zero (E + 2)",
    "K": "top-k: choices per token",
    "L": "local experts per rank, E/P",
    "M": "rows the expert FFN computes (the rows of N or R it keeps, sorted by expert)",
    "N": "routed rows, T*K (G*K with heads)",
    "O": "router outputs: the E experts plus identity and zero experts",
    "P": "ranks of a group (peers)",
    "Q": "sub-token width, H*h",
    "R": "rows a rank receives in an exchange",
    "S": "sequence length",
    "T": "tokens (of this rank)",
    "U": "buckets of an exchange: experts under EP, the P*C global slots under FSEP",
    "V": "experts per expert group, E/A",
    "W": "ranks of the world",
    "X": "experts of all heads, H*E (head-major)",
    "Y": "a kernel tile's rows",
    "Z": "a kernel tile's columns",
    "a": "steps of a routing history (the counts a planner sees before the step it places)",
    "b": "a kernel's row blocks, ceil(rows / BLOCK)",
    "c": "an expert's capacity: the slots of a GShard dispatch",
    "e": "elements of one rank's shard of a flat buffer (FSDP's all-gather input, reduce-scatter output)",
    "h": "head width",
    "l": "the local part of the letter before it (Ql = Q/P, Hl = H/P)",
    "m": "residues modulo an expert's replica count (FSEP's placement cost)",
    "n": "nodes",
    "p": "a grouped GEMM's reduction width (a [N, p] by an expert's [p, q]; wgrad: out[e] = a_Np^T b_Nq)",
    "q": "a grouped GEMM's output width",
    "r": "ranks per node",
    "s": "elements of one slot's slice of an expert weight (FSEP)",
    "u": "the slots of one node, r*C (a node's part of U)",
}

ScoreFunc = Literal["softmax", "sigmoid"]
Activation = Literal["swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu", "relu2", "clamped_swiglu", "softcapped_swiglu"]

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
CAPACITY_SCOPES = ("batch", "sequence")
CAPACITY_PRIORITIES = ("k_major", "token_major")
DROP_POLICIES = ("zero", "identity")
CAPACITY_ROUNDINGS = ("ceil", "floor")  # how capacity_factor * tokens * k / E becomes a count
ROUTER_DTYPES = ("float32", "input")
LOGITS_SOURCES = ("linear", "module", "selection", "traced")
TRACED_ROUTER = "moepass_router_logits"  # where the rewritten block holds a traced router's logits function
MODULE_INPUTS = ("hidden", "tokens")
# what a block returns after its hidden states: its router's logits; each expert's load (how many of the
# tokens' K choices picked it, [O], in the dtype the suffix names); None (a slot a framework fills elsewhere);
# the selection itself (each token's K weights, K experts)
SIDE_OUTPUTS = ("router_logits", "none", "topk_weights", "topk_experts")  # the last two: [T, K], as routed
LOAD_OUTPUT = "expert_load."  # + a dtype name: "expert_load.int64", "expert_load.float32"
# + an index: what the router module returns at that index, returned by the block as it is (a router state the
# next layer's router reads); needs a router called as a module
ROUTER_OUTPUT = "router_output."
LOAD_DTYPES = ("int64", "int32", "float32", "float64", "float16", "bfloat16")
EXPERT_KINDS = ("ffn", "generic")
WEIGHTS_ON = ("output", "input")  # what a token's routing weight multiplies: each expert's output, or its input
FFN_ROLES = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")  # `moe.expert_ffn`'s operand order


def _check_choice(path: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{path}={value!r} is invalid: use one of {list(choices)}.{nearest(value, choices)}")


@dataclass(frozen=True)
class TensorSource:
    """How to read one canonical weight tensor from the block's own parameters.

    `paths` are parameter names relative to the block: one parameter read as it is, or (`stacked`)
    one per expert, stacked along a new leading (expert) dim. Then, in order: `unflatten=n` reads a tensor stored
    flattened as [E·n, ...] as [E, n, ...] (dim 0 split, a view); `chunk=(index, parts)` takes one of
    `parts` equal chunks along `chunk_dim` (or `interleave=(start, step)` takes every step-th slice
    along it); `transpose=True` swaps the last two dims.
    """

    paths: tuple[str, ...]
    transpose: bool = False
    chunk: tuple[int, int] | None = None
    chunk_dim: int = -1
    stacked: bool = False  # stack `paths` (one per expert) along a new leading dim
    # `(start, step)`: every step-th slice along `chunk_dim` from `start` (gate and up rows interleaved in one
    # tensor: gate = rows 0, 2, 4, ..., up = rows 1, 3, 5, ...); taken where a `chunk` would be
    interleave: tuple[int, int] | None = None
    # n: the tensor is stored flattened as [E·n, ...] (one 2-D tensor for every expert's rows): read as [E, n, ...]
    unflatten: int | None = None

    @classmethod
    def param(cls, path: str, **kw: object) -> TensorSource:
        return cls(paths=(path,), **kw)  # type: ignore[arg-type]

    @classmethod
    def stack(cls, paths: list[str] | tuple[str, ...], **kw: object) -> TensorSource:
        return cls(paths=tuple(paths), stacked=True, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Constant:
    """A constant a block passes to its router module beside tensors (`None` for an absent bias, a flag, a
    number): `RouterSpec.module_args` holds it as it is, where a string names a tensor or a block input."""

    value: None | bool | int | float | str

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class RouterSpec:
    """Token → expert selection. Logits are computed as `x @ weight.T (+ bias)`."""

    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    softmax_before_topk: bool = True  # softmax: over all E, then top-k (Mixtral); False: top-k logits, then softmax
    renormalize: bool = True  # weights of the K chosen experts divided by their sum
    n_group: int = 1  # group-limited selection (DeepSeek-V3): E experts in n_group groups
    topk_group: int = 1  # ... keep the best topk_group groups
    group_score: str = "top2_sum"  # how a group is scored from its experts' selection scores
    routed_scaling_factor: float = 1.0
    jitter_eps: float = 0.0  # train-mode multiplicative input jitter U(1-eps, 1+eps)
    dtype: str = "float32"  # "float32": logits in fp32 (x and weight upcast); "input": x's dtype
    weight: TensorSource = TensorSource.param("gate.weight")
    bias: TensorSource | None = None  # bias of the router linear: part of the logits
    selection_bias: TensorSource | None = None  # added to scores for selection only (aux-loss-free)
    # aux-loss-free balancing done by the block itself: after every train-mode forward, under no_grad,
    # selection_bias[e] += bias_update_rate * sign(mean load - load[e]) (per head with heads); 0: never
    bias_update_rate: float = 0.0
    # "module": call the router module at `module_path` (fires its hooks) for the logits; "selection": the
    # module computes the selection itself and returns the weights and the experts (the user's router as it
    # is, whatever rule it implements: the fields above then only describe it when it matched a known kind)
    logits_from: str = "linear"
    module_path: str = "gate"
    module_output_index: int | None = None  # the router module returns a tuple: logits (or weights) at this index
    module_experts_index: int | None = None  # logits_from="selection": the selected experts at this index
    module_input: str = "hidden"  # the router module's first argument: "hidden" (as given) or "tokens" ([T, D])
    # further arguments: tensors of the block (parameter / buffer paths) or further block inputs by name
    # (`MoESpec.input_names`, e.g. the token ids a hash router is keyed by)
    # (a `Constant` is passed as it is: `None` for an absent expert bias, a flag)
    module_args: tuple[str | Constant, ...] = ()
    # logits_from="selection": whether the module's selection matched the known rule the fields above name
    # (on the detection probe: a description for reports and the cost model; the graph runs the module)
    known_kind: bool = True
    # logits_from="selection": a constant the block scales the module's weights by before combining them (or,
    # the same by linearity, its combined output: `out * K` after a router that returned softmax / K)
    selection_scale: float = 1.0
    # logits_from="traced": the block's own router code up to its logits, traced from its forward (an
    # fx.GraphModule holding no tensor: called on the hidden states, then the block tensors `module_args`
    # names); the fields above say what follows the logits (score function, selection, renormalisation)
    traced: Any = field(default=None, compare=False, repr=False)

    def validate(self, where: str) -> None:
        if self.num_experts < 1:
            raise PlanError(f"{where}.num_experts={self.num_experts} is invalid: an MoE needs at least 1 expert.")
        if not 1 <= self.top_k <= self.num_experts:
            raise PlanError(f"{where}.top_k={self.top_k} is invalid: top_k must lie in [1, num_experts="
                            f"{self.num_experts}]; lower top_k or add experts.")
        _check_choice(f"{where}.score_func", self.score_func, SCORE_FUNCS)
        _check_choice(f"{where}.group_score", self.group_score, GROUP_SCORES)
        _check_choice(f"{where}.dtype", self.dtype, ROUTER_DTYPES)
        _check_choice(f"{where}.logits_from", self.logits_from, LOGITS_SOURCES)
        _check_choice(f"{where}.module_input", self.module_input, MODULE_INPUTS)
        if self.logits_from == "traced" and self.traced is None:
            raise PlanError(f"{where}.logits_from='traced' is invalid without `traced`, the router's logits function "
                            f"(detection makes it from the block's forward); use logits_from='linear' otherwise.")
        if self.logits_from == "selection" and (self.module_output_index is None or self.module_experts_index is None):
            raise PlanError(f"{where}.logits_from='selection' is invalid without module_output_index and "
                            f"module_experts_index: name where the router module returns its weights and experts.")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise PlanError(f"{where}.n_group={self.n_group} is invalid: it must divide num_experts={self.num_experts}.")
        if not 1 <= self.topk_group <= self.n_group:
            raise PlanError(f"{where}.topk_group={self.topk_group} is invalid: use 1..n_group={self.n_group}.")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise PlanError(
                f"{where}.topk_group={self.topk_group} is invalid: {self.topk_group} groups of "
                f"{self.num_experts // self.n_group} experts cannot supply top_k={self.top_k}; raise topk_group."
            )
        if self.jitter_eps < 0:
            raise PlanError(f"{where}.jitter_eps={self.jitter_eps} is invalid: use a value >= 0.")
        if not math.isfinite(self.selection_scale) or self.selection_scale == 0:
            raise PlanError(f"{where}.selection_scale={self.selection_scale} is invalid: use a finite, non-zero "
                            f"constant (1.0: the module's weights as they are).")
        if self.bias_update_rate < 0:
            raise PlanError(f"{where}.bias_update_rate={self.bias_update_rate} is invalid: use a rate >= 0.")
        if self.bias_update_rate > 0 and self.selection_bias is None:
            raise PlanError(f"{where}.bias_update_rate={self.bias_update_rate} is invalid without a selection_bias: "
                            f"name the bias buffer it updates, or set the rate to 0.")


@dataclass(frozen=True)
class ExpertsSpec:
    """E routed experts, one FFN each: `down(act(gate(x)) [* up(x)])` with optional biases.

    Canonical layouts: gate/up `[E, F, D]`, down `[E, D, F]`, biases `[E, F]` / `[E, D]`. Experts that are
    not such an FFN run as they are (`kind="generic"`, below).

    Zero-compute experts (LongCat-Flash): the router may choose among O = E + len(identity_experts) +
    len(zero_experts) experts; the router ids listed return their input (identity) or zero, the others
    are the E FFN experts, in id order. `output_scale` ([O] or [O, 1], indexed by router id) multiplies
    each expert's output (the graph folds it into the combine weights).
    """

    num_experts: int
    hidden_dim: int  # D
    ffn_dim: int  # F
    activation: Activation = "swiglu"
    clamp_limit: float = 7.0  # clamped_swiglu only (GPT-OSS); softcapped_swiglu: the gate's softcap
    swiglu_alpha: float = 1.702  # clamped_swiglu only; softcapped_swiglu: the up projection's softcap
    w_gate: TensorSource = TensorSource.param("experts.w_gate")
    w_up: TensorSource | None = None  # gated activations only
    w_down: TensorSource = TensorSource.param("experts.w_down")
    b_gate: TensorSource | None = None
    b_up: TensorSource | None = None
    b_down: TensorSource | None = None
    container: str = "experts"  # module path of the experts (ModuleList or fused module)
    output_scale: TensorSource | None = None  # [O] or [O, 1]: expert r's output times output_scale[r]
    identity_experts: tuple[int, ...] = ()  # router ids of experts returning their input
    zero_experts: tuple[int, ...] = ()  # router ids of experts returning zero
    # "ffn": the FFN above (`moe.expert_ffn`); "generic": the per-expert function is not a known FFN, so the
    # graph runs one expert module as it is (`template`, whose class `template_class` names for reports) on
    # each expert's rows with that expert's tensors (`moepass.generic_experts`). `tensors` are its stacked
    # parameters and buffers: (name inside the expert, [E, ...] source); w_* / b_* and `activation` are
    # unused, and `ffn_dim` is the FFN width of the same parameter count (for the cost model).
    kind: str = "ffn"
    template: str | None = None
    template_class: str = ""
    tensors: tuple[tuple[str, TensorSource], ...] = ()
    # "bfloat16" / "float16": the block casts x and its weights to it around the GEMMs and y back (torchtitan's
    # GroupedExperts); `moe.expert_ffn` does the same (its `compute_dtype`). None: the input's dtype
    compute_dtype: str | None = None

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def routed_experts(self) -> int:
        """R: the experts the router chooses among (FFN, identity and zero experts)."""
        return self.num_experts + len(self.identity_experts) + len(self.zero_experts)

    @property
    def ffn_fraction(self) -> float:
        """E/R: the share of the routed assignments that reach FFN experts under uniform routing (the rest
        pick identity or zero experts, which are neither sent nor computed); 1 without zero-compute experts."""
        return self.num_experts / self.routed_experts

    @property
    def ffn_ids(self) -> tuple[int, ...]:
        """The router ids of the FFN experts, in FFN-expert order."""
        other = set(self.identity_experts) | set(self.zero_experts)
        return tuple(r for r in range(self.routed_experts) if r not in other)

    def sources(self) -> dict[str, TensorSource]:
        """The expert tensors the graph reads, by role: the FFN's weights (`FFN_ROLES` order) or a
        generic expert's tensors (keyed by their name inside the expert, dots made underscores)."""
        if self.kind == "generic":
            return {name.replace(".", "_"): source for name, source in self.tensors}
        return {role: getattr(self, role) for role in FFN_ROLES if getattr(self, role) is not None}

    def validate(self, where: str) -> None:
        _check_choice(f"{where}.kind", self.kind, EXPERT_KINDS)
        if self.kind == "generic":
            names = [name for name, _ in self.tensors]
            if self.template is None or not self.tensors or len(self.sources()) != len(names) or any(
                    not s.stacked or len(s.paths) != self.num_experts for _, s in self.tensors):
                raise PlanError(
                    f"{where}.kind='generic' is invalid with template={self.template!r}, tensors={names}: name one "
                    f"expert module as the template and each of its tensors once (distinct after dots become "
                    f"underscores), stacked over the num_experts={self.num_experts} experts.")
        _check_choice(f"{where}.activation", self.activation, ACTIVATIONS)
        if self.compute_dtype not in (None, "bfloat16", "float16") or (self.compute_dtype and self.kind != "ffn"):
            raise PlanError(f"{where}.compute_dtype={self.compute_dtype!r} is invalid: use None, or for FFN experts "
                            f"(kind='ffn') 'bfloat16' or 'float16'.")
        for name in ("num_experts", "hidden_dim", "ffn_dim"):
            if getattr(self, name) < 1:
                raise PlanError(f"{where}.{name}={getattr(self, name)} is invalid: use a positive size.")
        ids = [*self.identity_experts, *self.zero_experts]
        R = self.routed_experts
        bad = [r for r in ids if not 0 <= r < R]
        if bad or len(set(ids)) != len(ids):
            raise PlanError(
                f"{where}.identity_experts={list(self.identity_experts)}, zero_experts={list(self.zero_experts)} "
                f"are invalid: they must be distinct router ids in [0, {R}) (R = num_experts={self.num_experts} "
                f"FFN experts + the identity and zero experts); list each zero-compute expert once."
            )
        if self.kind == "ffn" and self.gated != (self.w_up is not None):
            raise PlanError(
                f"{where}.w_up={self.w_up!r} is invalid for activation={self.activation!r}: gated activations "
                f"{list(GATED_ACTIVATIONS)} need an up projection, the others must not have one."
            )


@dataclass(frozen=True)
class SharedExpertSpec:
    """Dense experts every token goes through, added to the routed output.

    `module_path` is called as a module (its own forward). With `gate_path`, its output is scaled
    by `sigmoid(gate(x))` (Qwen2-MoE). With `router_outputs`, it also takes outputs of the router module.
    """

    module_path: str
    gate_path: str | None = None
    # further arguments the block passes it, each an output of its router module: (keyword, index into what the
    # router module returns); keyword "" passes it by position. A shared-expert "sink" scored beside the routed
    # experts gets its weight this way (`shared(x, gammas=router(x)[3])`); needs a router called as a module.
    router_outputs: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class CapacitySpec:
    """Expert capacity: at most C (token, expert) assignments per expert and group; the rest drop.

    C = max(min_capacity, ceil(capacity_factor * group_tokens * top_k / E)) unless `fixed` is set (`floor`
    with rounding="floor": `int(...)`, as many code bases write it).
    Priority decides who is kept: "k_major" keeps every token's 1st choice before any 2nd choice
    (GShard), "token_major" goes token by token. A dropped assignment contributes zero ("zero") or,
    for top-1, passes the token's input through scaled by its weight ("identity", Switch).
    """

    capacity_factor: float | None = 1.0
    fixed: int | None = None
    min_capacity: int = 0
    scope: str = "batch"  # "batch": all T tokens form one group; "sequence": each sequence is a group
    priority: str = "k_major"
    drop_policy: str = "zero"
    rounding: str = "ceil"

    def capacity(self, group_tokens: int, top_k: int, num_experts: int) -> int:
        if self.fixed is not None:
            return self.fixed
        assert self.capacity_factor is not None
        count = self.capacity_factor * group_tokens * top_k / num_experts
        return max(self.min_capacity, math.ceil(count) if self.rounding == "ceil" else math.floor(count))

    def validate(self, where: str) -> None:
        _check_choice(f"{where}.scope", self.scope, CAPACITY_SCOPES)
        _check_choice(f"{where}.priority", self.priority, CAPACITY_PRIORITIES)
        _check_choice(f"{where}.drop_policy", self.drop_policy, DROP_POLICIES)
        _check_choice(f"{where}.rounding", self.rounding, CAPACITY_ROUNDINGS)
        if self.fixed is None and (self.capacity_factor is None or self.capacity_factor <= 0):
            raise PlanError(
                f"{where}.capacity_factor={self.capacity_factor!r} is invalid: use a float > 0, "
                f"or capacity=None for dropless routing."
            )
        if self.fixed is not None and self.fixed < 0:
            raise PlanError(f"{where}.fixed={self.fixed} is invalid: a capacity is a count >= 0.")


@dataclass(frozen=True)
class HeadsSpec:
    """Multi-Head LatentMoE (arXiv 2602.04870): the block routes H latent sub-tokens per token.

    x [T, D] -> z = x @ w_in.T [T, H*h] -> T*H sub-tokens of width h (token-major, head-minor); the
    sub-token of head j is routed among head j's own E experts (router weight [H, E, h], selection bias
    [H, E]) and computed by them; the outputs, back in [T, H*h], go through out = y @ w_out.T [T, D].
    With heads, `RouterSpec.num_experts` is E per head, `ExpertsSpec.num_experts` is H*E (flattened
    head-major: head j owns experts j*E .. j*E+E-1) and `ExpertsSpec.hidden_dim` is h.
    """

    num_heads: int  # H
    head_dim: int  # h
    model_dim: int  # D: the block's input and output width
    w_in: TensorSource = TensorSource.param("w_in.weight")  # [H*h, D] (nn.Linear layout)
    w_out: TensorSource = TensorSource.param("w_out.weight")  # [D, H*h]

    def validate(self, where: str) -> None:
        for name in ("num_heads", "head_dim", "model_dim"):
            if getattr(self, name) < 1:
                raise PlanError(f"{where}.{name}={getattr(self, name)} is invalid: use a positive size.")


@dataclass(frozen=True)
class MoESpec:
    """Everything moepass knows about one MoE block."""

    path: str  # module path in the model, "" for the root
    recogniser: str
    router: RouterSpec
    experts: ExpertsSpec
    shared: SharedExpertSpec | None = None
    capacity: CapacitySpec | None = None  # None: dropless
    input_names: tuple[str, ...] = ("hidden_states",)
    # block inputs (among input_names[1:]) the MoE computation does not read: masks, position tensors, flags the
    # model passes to the block; the graph takes them where the block does and ignores them
    unused_inputs: tuple[str, ...] = ()
    side_outputs: tuple[str, ...] = ()  # returned after the hidden states, in this order
    heads: HeadsSpec | None = None  # Multi-Head LatentMoE: routing over H latent sub-tokens per token
    # an [O] buffer the block adds each expert's load to in every train-mode forward (its own statistic, e.g.
    # the token counts a loop reads to balance the experts): the graph keeps doing it (`moe.count_load`)
    load_counter: TensorSource | None = None
    # a [D] tensor the block adds to the routed experts' combined output (a bias outside the experts)
    output_bias: TensorSource | None = None
    # a submodule of the block called last, on the output after the shared experts, as it is (a norm the block
    # applies to what it returns)
    output_module: str | None = None
    # a submodule of the block called first on the tokens the experts read (the router reads them as given): a
    # norm the block applies before its experts only (Gemma-4's layer: the router scores the residual, the experts
    # take it normalised)
    input_module: str | None = None
    # "output": the combine sums each chosen expert's output times its weight (the usual); "input": each expert
    # runs on its input times the weight and the combine sums the outputs (Llama-4: `experts(x * score)`)
    weights_on: str = "output"
    flat_output: bool = False  # the block returns its hidden states as [T, D] tokens, whatever the input's shape
    # under torch.autocast the block returns its hidden states in the autocast dtype (its experts' outputs summed
    # as they come), not in the fp32 of a buffer it accumulates into (the combine's dtype): detection observes it
    autocast_output: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = f"MoESpec[{self.path or '<root>'}]"
        self.router.validate(f"{where}.router")
        self.experts.validate(f"{where}.experts")
        if self.capacity is not None:
            self.capacity.validate(f"{where}.capacity")
            if self.capacity.drop_policy == "identity" and self.router.top_k != 1:
                raise PlanError(
                    f"{where}.capacity.drop_policy='identity' is invalid with top_k={self.router.top_k}: "
                    f"pass-through of dropped tokens is defined for top-1 routing only."
                )
        _check_choice(f"{where}.weights_on", self.weights_on, WEIGHTS_ON)
        if self.weights_on == "input" and (self.heads is not None
                                           or self.experts.routed_experts != self.experts.num_experts):
            raise PlanError(f"{where}.weights_on='input' is invalid with heads or identity / zero experts in this "
                            f"build: only FFN experts take their weighted input; use weights_on='output'.")
        if self.shared is not None and self.shared.router_outputs and self.router.logits_from not in (
                "module", "selection"):
            raise PlanError(f"{where}.shared.router_outputs={list(self.shared.router_outputs)} is invalid with "
                            f"router.logits_from={self.router.logits_from!r}: the shared expert reads outputs of the "
                            f"router module, so the router must be called as a module ('module' or 'selection').")
        if self.heads is not None:
            self._validate_heads(where, self.heads)
        elif self.router.num_experts != self.experts.routed_experts:
            zero_compute = len(self.experts.identity_experts) + len(self.experts.zero_experts)
            raise PlanError(
                f"{where}.router.num_experts={self.router.num_experts} is invalid: the experts container "
                f"holds {self.experts.num_experts}" + (f" FFN experts and {zero_compute} identity / zero experts"
                                                       if zero_compute else "") + "; they must agree."
            )
        if self.capacity is not None and self.experts.routed_experts != self.experts.num_experts:
            raise PlanError(
                f"{where}.capacity is not supported together with identity / zero experts in this build: "
                f"capacity counts FFN-expert assignments only; use capacity=None (dropless; under EP leave "
                f"Plan.capacity_factor unset)."
            )
        for name in self.side_outputs:
            if name.startswith(ROUTER_OUTPUT):
                if not name.removeprefix(ROUTER_OUTPUT).isdigit() or self.router.logits_from not in ("module",
                                                                                                       "selection"):
                    raise PlanError(f"{where}.side_outputs[{name!r}] is invalid: '{ROUTER_OUTPUT}<index>' names an "
                                    f"output of the router module, which must be called as a module "
                                    f"(router.logits_from 'module' or 'selection', here "
                                    f"{self.router.logits_from!r}).")
                continue
            if name.startswith(LOAD_OUTPUT):
                _check_choice(f"{where}.side_outputs[{name!r}] dtype", name.removeprefix(LOAD_OUTPUT), LOAD_DTYPES)
                continue
            _check_choice(f"{where}.side_outputs", name, SIDE_OUTPUTS)
        if "router_logits" in self.side_outputs and self.router.logits_from == "selection":
            raise PlanError(f"{where}.side_outputs={list(self.side_outputs)} is invalid with router.logits_from="
                            f"'selection': the router module returns weights and experts, not logits.")

    def _validate_heads(self, where: str, heads: HeadsSpec) -> None:
        heads.validate(f"{where}.heads")
        H, h, E = heads.num_heads, heads.head_dim, self.router.num_experts
        if self.experts.num_experts != H * E:
            raise PlanError(
                f"{where}.experts.num_experts={self.experts.num_experts} is invalid with heads: it counts every "
                f"head's experts, flattened head-major, so it must be heads.num_heads * router.num_experts = "
                f"{H} * {E} = {H * E} (router.num_experts is E per head)."
            )
        if self.experts.hidden_dim != h:
            raise PlanError(
                f"{where}.experts.hidden_dim={self.experts.hidden_dim} is invalid with heads: experts compute "
                f"on sub-tokens of width heads.head_dim={h}; set it to {h}."
            )
        unsupported = [name for name, present in (
            ("shared", self.shared is not None), ("capacity", self.capacity is not None),
            ("router.bias", self.router.bias is not None),
            ("router.logits_from='module'", self.router.logits_from == "module"),
            ("router.logits_from='traced'", self.router.logits_from == "traced"),
            ("experts.output_scale", self.experts.output_scale is not None),
            ("experts.identity_experts / zero_experts", self.experts.routed_experts != self.experts.num_experts),
            ("experts.kind='generic'", self.experts.kind == "generic"),
            ("input_module", self.input_module is not None))
            if present]
        if unsupported:
            raise PlanError(
                f"{where}.heads is not supported together with {', '.join(unsupported)} in this build: the "
                f"Multi-Head LatentMoE graph routes sub-tokens with the router weight [H, E, h] alone; "
                f"drop {unsupported[0]} or describe the block without heads."
            )

    @property
    def model_dim(self) -> int:
        """D: the width of the block's input and output (the experts' width, unless heads project it)."""
        return self.experts.hidden_dim if self.heads is None else self.heads.model_dim

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def replace(self, **changes: object) -> MoESpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def summary(self) -> str:
        r, x = self.router, self.experts
        if self.heads is None and x.kind == "generic":
            sizes = (f"E={x.num_experts} K={r.top_k} D={x.hidden_dim} generic experts (module {x.template_class} "
                     f"run as traced, {len(x.tensors)} tensors each)")
        elif self.heads is None:
            sizes = f"E={x.num_experts} K={r.top_k} D={x.hidden_dim} F={x.ffn_dim} {x.activation}"
        else:
            hd = self.heads
            sizes = (f"heads H={hd.num_heads} h={hd.head_dim} D={hd.model_dim}, E={r.num_experts}/head "
                     f"({x.num_experts} in all) K={r.top_k}/sub-token F={x.ffn_dim} {x.activation}")
        parts = [
            sizes,
            f"router={r.score_func}" + ("" if r.score_func != "softmax" else
                                        ("(before top-k)" if r.softmax_before_topk else "(after top-k)")),
        ]
        unknown = r.logits_from == "selection" and not r.known_kind
        if r.logits_from == "selection":  # the user's router module selects, as it is
            parts[1] = (f"router=module {r.module_path} (its own selection, "
                        + ("no known kind)" if unknown else f"matches {parts[1].removeprefix('router=')})"))
        if r.logits_from == "traced":  # the block's own logits code, then a known rule
            parts[1] = f"router=traced logits (reads {', '.join(map(str, r.module_args))}), then {parts[1].removeprefix('router=')}"
        parts += [text for on, text in (
            (r.renormalize and not unknown, "renormalised"),
            (r.selection_bias is not None,
             "selection-bias" + (f"(updated, rate {r.bias_update_rate:g})" if r.bias_update_rate else "")),
            (r.bias is not None, "router-bias"), (r.n_group > 1, f"groups={r.n_group}/keep {r.topk_group}"),
            (r.routed_scaling_factor != 1.0, f"scale={r.routed_scaling_factor:g}")) if on]
        zero_compute = [f"{kind} {list(ids)}" for kind, ids in (("identity", x.identity_experts),
                                                                 ("zero", x.zero_experts)) if ids]
        if zero_compute:
            parts.append(f"zero-compute experts: {', '.join(zero_compute)} (of {x.routed_experts} routed)")
        if x.output_scale is not None:
            parts.append("expert-output-scale")
        if self.shared is not None:
            parts.append("shared" + ("(gated)" if self.shared.gate_path else "")
                         + (f"(takes router outputs {[i for _, i in self.shared.router_outputs]})"
                            if self.shared.router_outputs else ""))
        if self.load_counter is not None:
            parts.append(f"counts load in {'.'.join(self.load_counter.paths)}")
        if self.output_bias is not None:
            parts.append(f"output bias {'.'.join(self.output_bias.paths)}")
        parts += [text for on, text in (
            (self.input_module is not None, f"experts read {self.input_module}(x)"),
            (self.output_module is not None, f"then {self.output_module}"),
            (self.weights_on == "input", "weights on the experts' input"), (self.flat_output, "returns [T, D]"),
            (self.autocast_output, "returns the autocast dtype under autocast"),
            (x.compute_dtype is not None, f"experts compute in {x.compute_dtype}")) if on]
        c = self.capacity
        parts.append("dropless" if c is None else
                     f"capacity={'C=' + str(c.fixed) if c.fixed is not None else f'cf {c.capacity_factor:g}'}"
                     f"{'' if c.fixed is not None or c.rounding == 'ceil' else ' rounded down'}"
                     f"/{c.scope}/{c.drop_policy}{'' if c.priority == 'k_major' else '/token-major'}")
        return ", ".join(parts)
