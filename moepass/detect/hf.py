"""Recognisers for blocks whose router is a *module* returning logits (transformers 5.x style).

Such a block holds a router module beside its experts. The model records the router's logits with
an output hook on that module (transformers: `_can_record_outputs = {"router_logits":
OutputRecorder(<Router>, index=i)}`) for its auxiliary and z losses, so every spec made here calls
the router module (`RouterSpec.logits_from="module"`) and the hook still fires after the rewrite.
Experts are fused 3-D weights (`@use_experts_implementation`: gate_up_proj [E, 2F, D], down_proj
[E, D, F], with `is_transposed` / `is_concatenated` / `has_bias` flags) or a ModuleDict / ModuleList of
expert modules.

What the router does comes from the block's captured graph (`moepass.detect.router`): k from the
selection, the selection-only bias, groups (a top-k over group scores), renormalisation (a sum over
the K weights) and the routed scaling (a constant the weights are multiplied by):

    softmax_topk   softmax over E, top-k [, renormalise]; or top-k logits, softmax over the K
    group_limited  + a selection bias [E] and / or a group-limited top-k, scaling, renormalisation
    top1_capacity  softmax, top-1 with a fixed `expert_capacity` counted per sequence

Which output of the router is the logits, and whether the logits are computed in fp32 or in the
input dtype, are observed by calling a copy of the router (fp32 and bf16), not assumed. Each
recogniser returns a few MoESpec hypotheses, best first (the semantic check decides), or declines
with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moepass.detect.candidates import Candidate, shared_expert
from moepass.detect.capture import downstream
from moepass.detect.fused_experts import expert_layouts, layout_experts
from moepass.detect.loop_experts import stacked_experts_spec
from moepass.detect.router import SIGMOID, RouterFacts, module_call
from moepass.spec import CapacitySpec, Constant, ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource

JITTER_NAMES = ("jitter_noise", "router_jitter_noise")  # train-mode only: not in the (eval) graph
CAPACITY_NAMES = ("expert_capacity",)  # a Python int the block compares counts with: not a graph tensor


def block_tensor(module: nn.Module, path: str) -> torch.Tensor:
    """The parameter or buffer at dotted `path` below `module` (a selection bias is often a buffer: updated
    by the training loop, not by the optimizer)."""
    prefix, _, name = path.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    found: torch.Tensor | None = owner._parameters.get(name)
    if found is None:
        found = owner._buffers.get(name)
    if found is None:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer {path!r}: the captured graph read it, "
                         f"so the block's tensors changed after the capture; detect the model again")
    return found


def _attr(module: nn.Module, names: tuple[str, ...], kind: type | tuple[type, ...]) -> Any:
    """The first of `names` on `module` that is an instance of `kind` (a bool counts only as bool)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
    return None


class HFBlock:
    """What the recognisers share about one candidate block: its router module and experts."""

    def __init__(self, c: Candidate, facts: RouterFacts):
        self.c = c
        self.router_name = c.router_path.split(".")[0]  # the block's child: the module whose hooks record logits
        self.router: nn.Module = c.module.get_submodule(self.router_name)
        self.weight_name = facts.weight or ""
        self.weight = block_tensor(c.module, self.weight_name)
        self.bias_name = facts.bias
        self.bias = None if facts.bias is None else block_tensor(c.module, facts.bias)
        self.call = module_call(c.graph, self.router_name) if c.graph is not None else "no graph"
        self.E, self.D = self.weight.shape
        self._dtype: str | None = None

    def logits_index(self) -> int | None | str:
        """Which output of the router module is `x @ W.T (+ b)`: an index, None (a plain tensor), or why not."""
        router = copy.deepcopy(self.router).to("cpu", torch.float32).eval()  # probes run on CPU
        x = torch.randn(2, 3, self.D, generator=torch.Generator().manual_seed(0))
        expected = F.linear(x.reshape(-1, self.D), self.weight.detach().cpu().float(),
                            None if self.bias is None else self.bias.detach().cpu().float())
        try:
            with torch.no_grad():
                out = router(*self.call_args(x, torch.float32))
        except Exception as err:
            return f"router {self.router_name} ({type(self.router).__name__}) fails on a [2, 3, D={self.D}] probe: {err}"
        outputs = out if isinstance(out, tuple) else (out,)
        for i, value in enumerate(outputs):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == expected.numel() \
                    and torch.allclose(value.reshape(expected.shape).float(), expected, atol=1e-5, rtol=1e-4):
                return i if isinstance(out, tuple) else None
        return (f"no output of router {self.router_name} ({type(self.router).__name__}) equals its logits "
                f"x @ {self.weight_name}.T")

    def call_args(self, x: torch.Tensor, dtype: torch.dtype) -> list[Any]:
        """The router module's arguments as the block passes them, for a [2, 3, D] probe `x`."""
        assert not isinstance(self.call, str)
        module_input, module_args = self.call
        first = x if module_input == "hidden" else x.reshape(-1, self.D)
        extra = [p.value if isinstance(p, Constant) else block_tensor(self.c.module, p) for p in module_args]
        return [first] + [t.detach().to("cpu", dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                          else t.to("cpu") if isinstance(t, torch.Tensor) else t for t in extra]

    def logits_dtype(self, index: int | None) -> str:
        """'float32' if the router computes fp32 logits for a bf16 input and bf16 weights, else 'input'."""
        if self._dtype is None:
            router = copy.deepcopy(self.router).to("cpu", torch.bfloat16).eval()
            x = torch.randn(2, 3, self.D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            try:
                with torch.no_grad():
                    out = router(*self.call_args(x, torch.bfloat16))
                logits = out if index is None else out[index]
                self._dtype = "float32" if logits.dtype == torch.float32 else "input"
            except Exception:
                self._dtype = "input"
        return self._dtype

    def router_spec(self, index: int | None, **fields: object) -> RouterSpec:
        assert self.c.graph is not None and not isinstance(self.call, str)
        module_input, module_args = self.call
        return RouterSpec(
            module_input=module_input, module_args=module_args,
            num_experts=self.E, weight=TensorSource.param(self.weight_name),
            bias=None if self.bias_name is None else TensorSource.param(self.bias_name),
            logits_from="module", module_path=self.router_name, module_output_index=index,
            dtype=self.logits_dtype(index), **fields,  # type: ignore[arg-type]
        )

    def experts(self) -> list[ExpertsSpec] | str:
        if self.c.experts_kind == "fused":
            return fused_experts_specs(self.c, self.D)
        if self.c.experts_kind in ("moduledict", "modulelist"):
            found = dict_experts_spec(self.c)
            return found if isinstance(found, str) else [found]
        return f"experts are a {self.c.experts_kind}, not fused 3-D weights or a container of expert modules"

    def shared(self) -> SharedExpertSpec | None:
        """`candidates.shared_expert` over the calls of submodules that hold parameters: a parameter-free module
        called on the tokens (an `nn.Identity` standing in for an optional projection) computes no expert."""
        c = self.c
        if c.graph is None:
            return None
        calls = [call for call in c.graph.calls
                 if call.path == "" or next(c.module.get_submodule(call.path).parameters(), None) is not None]
        return shared_expert(dataclasses.replace(c, graph=dataclasses.replace(c.graph, calls=calls)))

    def block_jitter(self) -> float:
        """Input jitter the block applies itself; jitter inside the router module runs with it."""
        value = _attr(self.c.module, JITTER_NAMES, (float, int))
        return float(value) if value else 0.0

    def specs(self, name: str, routers: list[RouterSpec], capacities: Sequence[CapacitySpec | None] = (None,),
              notes: tuple[str, ...] = ()) -> list[MoESpec] | str:
        experts = self.experts()
        if isinstance(experts, str):
            return experts
        # transformers 5.x blocks return the hidden states; 4.x-style blocks also return the router logits
        side: tuple[str, ...] = ("router_logits",) if self.c.outputs == 2 else ()
        return [MoESpec(path=self.c.path, recogniser=name, router=r, experts=x, shared=self.shared(),
                        capacity=cap, side_outputs=side, notes=notes)
                for x, r, cap in product(experts, routers, capacities)]


def fused_experts_specs(c: Candidate, D: int) -> list[ExpertsSpec] | str:
    """transformers' fused experts: the layouts their flags declare (every reading where a flag is not
    declared: gated or not, either orientation, gate / up halves or interleaved rows), with their biases when
    `has_bias`; the activations the graph calls first. An overridden `_apply_gate` is functional code like any
    other: every activation is a hypothesis, the semantic check decides."""
    x = c.experts
    flags = {f: getattr(x, f, None) for f in ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                                              "has_post_expert_norm")}
    if flags["has_post_expert_norm"]:
        return f"experts {c.experts_path} declare has_post_expert_norm: post-expert norms are not read"

    def declared(lay: dict) -> bool:
        if flags["has_gate"] is not None and lay["gated"] != bool(flags["has_gate"]):
            return False
        if flags["is_transposed"] is not None and lay["w_down"].transpose != bool(flags["is_transposed"]):
            return False
        if not lay["gated"]:
            return True
        if lay["w_gate"].paths != lay["w_up"].paths:  # gate and up in tensors of their own: nothing concatenated
            return flags["is_concatenated"] is not True
        halves, rows = lay["w_gate"].chunk == (0, 2), lay["w_gate"].interleave == (0, 2)  # gate first
        concatenated = flags["is_concatenated"]
        return halves if concatenated else rows if concatenated is False else halves or rows

    layouts = [lay for lay in expert_layouts(c, D) if declared(lay)]
    if not layouts:
        return (f"3-D parameters {c.fused_params} do not read as the declared layout (has_gate={flags['has_gate']}, "
                f"is_transposed={flags['is_transposed']}, is_concatenated={flags['is_concatenated']}, D={D})")
    return [experts for lay in layouts for experts in layout_experts(c, lay, D, biases=flags["has_bias"] is not False)]


def dict_experts_spec(c: Candidate) -> ExpertsSpec | str:
    """A ModuleDict of expert MLPs (wi/wo or gate/up/down linears), stacked per expert."""
    expert = c.experts.get_submodule(c.expert_names[0])
    dropout = [m.p for m in expert.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        return (f"experts of {c.path or '<root>'} apply dropout p={dropout[0]} in train mode, which the canonical "
                f"graph does not reproduce; set the config's dropout_rate=0 to rewrite this block")
    return stacked_experts_spec(c, list(c.expert_names))


def _router_block(c: Candidate) -> tuple[HFBlock, int | None, RouterFacts] | str:
    """The shared preamble: a router *module* whose output holds the logits: not a bare Linear (a subclass
    of nn.Linear with its own forward is a router module, called as it is)."""
    if c.experts_kind not in ("fused", "moduledict", "modulelist") or c.router is None:
        return "experts are not fused 3-D weights or a container of expert modules"
    if not c.router_path or c.router.weight is None:
        return "the router weight is not held by a router module of the block"
    block = HFBlock(c, c.router)
    if isinstance(block.call, str):
        return block.call
    if isinstance(block.router, nn.Linear) and type(block.router).forward is nn.Linear.forward:
        return f"router {block.router_name} is a plain nn.Linear: no router module to keep calling"
    index = block.logits_index()
    if isinstance(index, str):
        return index
    return block, index, c.router


def _renorms(facts: RouterFacts) -> list[bool]:
    """Renormalised or not: what the graph shows (a sum over the K weights) first."""
    return [facts.renormalized, not facts.renormalized]


def softmax_topk(c: Candidate) -> list[MoESpec] | str:
    """softmax over E → top-k → renormalise or not, or top-k logits → softmax over the K (the graph orders
    the hypotheses); sigmoid scores first when the graph shows a sigmoid on the scores or the selected logits."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index, facts = found
    if facts.groups is not None or facts.selection_bias is not None:
        return f"router {block.router_name} has groups or a selection bias: a group_limited router"
    # softmax over E then top-k, or over the top-k logits (a softmax of the top-k values in the graph: first)
    orders = [not facts.softmax_after, facts.softmax_after]
    routers = [block.router_spec(index, top_k=facts.top_k, score_func="softmax", renormalize=r,
                                 softmax_before_topk=before, jitter_eps=block.block_jitter())
               for before in orders for r in (_renorms(facts) if before else [False])]
    if facts.sigmoid or _sigmoid_after(facts):  # sigmoid scores (monotone: top-k of the logits = of the scores)
        routers = [block.router_spec(index, top_k=facts.top_k, score_func="sigmoid", renormalize=r,
                                     jitter_eps=block.block_jitter()) for r in _renorms(facts)] + routers
    return block.specs("hf-softmax-topk", routers)


def _sigmoid_after(facts: RouterFacts) -> bool:
    """Whether a sigmoid runs on the selected values (top-k logits, then their sigmoid)."""
    sel = facts.selection
    return sel is not None and sel.values is not None and any(
        n.op == "call_function" and n.target in SIGMOID for n in downstream(sel.values))


def group_limited(c: Candidate) -> list[MoESpec] | str:
    """Group-limited: sigmoid (or softmax) scores (+ selection-only bias) → group-limited top-k → weights from the
    unbiased scores, renormalised or not, times the routed scaling factor (a constant in the graph)."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index, facts = found
    n_group, topk_group = facts.groups or (1, 1)
    if facts.selection_bias is None and n_group == 1:
        return f"router {block.router_name}: the graph shows neither a selection bias nor a group-limited top-k"
    common = dict(top_k=facts.top_k, n_group=n_group, topk_group=topk_group,
                  selection_bias=None if facts.selection_bias is None else TensorSource.param(facts.selection_bias),
                  jitter_eps=block.block_jitter())
    scalings = list(dict.fromkeys([*facts.scales, 1.0]))  # the graph's constants first
    routers = [block.router_spec(index, score_func=score, renormalize=rn, group_score=gs,
                                 routed_scaling_factor=float(scale), **common)
               for scale in scalings
               for score, gs, rn in product(("sigmoid", "softmax"), ("top2_sum", "max"), _renorms(facts))]
    return block.specs("hf-group-limited", routers)


def top1_capacity(c: Candidate) -> list[MoESpec] | str:
    """Top-1 with capacity: softmax → top-1 (argmax) with a fixed expert capacity counted per sequence;
    an overflowing token's expert output is dropped (its weight is the unrenormalised probability)."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index, facts = found
    capacity = _attr(block.router, CAPACITY_NAMES, int)
    if capacity is None:
        return f"router {block.router_name} has no int {CAPACITY_NAMES[0]} attribute"
    notes: tuple[str, ...] = ()
    if _attr(block.router, JITTER_NAMES, (float, int)):
        notes = (f"router jitter runs inside {block.router_name} (called by the graph)",)
    router = block.router_spec(index, top_k=facts.top_k, score_func="softmax", renormalize=False, jitter_eps=block.block_jitter())
    capacities = [CapacitySpec(capacity_factor=None, fixed=capacity, scope=scope, priority="token_major",
                               drop_policy=drop)
                  for scope, drop in product(("sequence", "batch"), ("zero", "identity"))]
    return block.specs("hf-top1-capacity", [router], capacities, notes=notes)


RECOGNISERS: list[tuple[str, Callable[[Candidate], list[MoESpec] | str]]] = [
    ("hf-group-limited", group_limited),
    ("hf-top1-capacity", top1_capacity),
    ("hf-softmax-topk", softmax_topk),
]
