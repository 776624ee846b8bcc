"""Recognisers for Hugging Face transformers 5.x MoE blocks, one per router family.

A transformers 5.x MoE block holds a router *module* beside its experts. The model records the
router's logits with an output hook on that module (`_can_record_outputs = {"router_logits":
OutputRecorder(<Router>, index=i)}`) for its auxiliary and z losses, so every spec made here calls
the router module (`RouterSpec.logits_from="module"`) and the hook still fires after the rewrite.
Experts are fused 3-D weights (`@use_experts_implementation`: gate_up_proj [E, 2F, D], down_proj
[E, D, F], with `is_transposed` / `is_concatenated` / `has_bias` flags) or, for SwitchTransformers,
a ModuleDict of expert MLPs.

The recognisers key on what the router module holds and does, never on class names alone:

    softmax_topk   weight [E, D], top_k [, norm_topk_prob]      Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...
    group_limited  + a selection bias [E] (e_score_correction_bias), n_group, topk_group,
                     routed_scaling_factor, norm_topk_prob       DeepSeek-V3 and look-alikes
    top1_capacity  a classifier Linear to E, expert_capacity      SwitchTransformers

Which output of the router is the logits, and whether the logits are computed in fp32 or in the
input dtype, are observed by calling a copy of the router (fp32 and bf16), not assumed. Each
recogniser returns a few MoESpec hypotheses, best first (the semantic check decides), or declines
with the reason.

Shape legend: T tokens, D model width, E experts, F expert hidden width.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moepass.detect.candidates import (
    Candidate,
    activation_of,
    shared_expert_of,
)
from moepass.detect.fused_experts import expert_layouts
from moepass.detect.loop_experts import GATED, PLAIN, stacked_experts_spec
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource

SELECTION_BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "selection_bias")
N_GROUP_NAMES = ("n_group", "num_group", "num_expert_group")
TOPK_GROUP_NAMES = ("topk_group", "num_limited_groups")
SCALING_NAMES = ("routed_scaling_factor",)
RENORM_NAMES = ("norm_topk_prob",)
JITTER_NAMES = ("jitter_noise", "router_jitter_noise")
CAPACITY_NAMES = ("expert_capacity",)


def _attr(module: nn.Module, names: tuple[str, ...], kind: type | tuple[type, ...]) -> Any:
    """The first of `names` on `module` that is an instance of `kind` (a bool counts only as bool)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
    return None


class HFBlock:
    """What the recognisers share about one candidate block: its router module and experts."""

    def __init__(self, c: Candidate):
        self.c = c
        self.router_name = c.router_path.split(".")[0]  # the block's child: the module whose hooks record logits
        self.router: nn.Module = c.module.get_submodule(self.router_name)
        self.linear_path = c.router_path  # holds the [E, D] router weight (itself, or e.g. router.classifier)
        linear = c.module.get_submodule(self.linear_path)
        self.weight = linear.get_parameter("weight")
        bias = getattr(linear, "bias", None)
        self.bias = bias if isinstance(bias, nn.Parameter) else None
        self.E, self.D = self.weight.shape
        self._dtype: str | None = None

    def logits_index(self) -> int | None | str:
        """Which output of the router module is `x @ W.T (+ b)`: an index, None (a plain tensor), or why not."""
        router = copy.deepcopy(self.router).float().eval()
        x = torch.randn(2, 3, self.D, generator=torch.Generator().manual_seed(0))
        expected = F.linear(x.reshape(-1, self.D), self.weight.detach().float(),
                            None if self.bias is None else self.bias.detach().float())
        try:
            with torch.no_grad():
                out = router(x)
        except Exception as err:
            return f"router {self.router_name} ({type(self.router).__name__}) fails on a [2, 3, D={self.D}] probe: {err}"
        outputs = out if isinstance(out, tuple) else (out,)
        for i, value in enumerate(outputs):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == expected.numel() \
                    and torch.allclose(value.reshape(expected.shape).float(), expected, atol=1e-5, rtol=1e-4):
                return i if isinstance(out, tuple) else None
        return (f"no output of router {self.router_name} ({type(self.router).__name__}) equals its logits "
                f"x @ {self.linear_path}.weight.T")

    def logits_dtype(self, index: int | None) -> str:
        """'float32' if the router computes fp32 logits for a bf16 input and bf16 weights, else 'input'."""
        if self._dtype is None:
            router = copy.deepcopy(self.router).to(torch.bfloat16).eval()
            x = torch.randn(2, 3, self.D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            try:
                with torch.no_grad():
                    out = router(x)
                logits = out if index is None else out[index]
                self._dtype = "float32" if logits.dtype == torch.float32 else "input"
            except Exception:
                self._dtype = "input"
        return self._dtype

    def router_spec(self, index: int | None, **fields: object) -> RouterSpec:
        return RouterSpec(
            num_experts=self.E, weight=TensorSource.param(f"{self.linear_path}.weight"),
            bias=None if self.bias is None else TensorSource.param(f"{self.linear_path}.bias"),
            logits_from="module", module_path=self.router_name, module_output_index=index,
            dtype=self.logits_dtype(index), **fields,  # type: ignore[arg-type]
        )

    def experts(self) -> ExpertsSpec | str:
        if self.c.experts_kind == "fused":
            return fused_experts_spec(self.c, self.D)
        if self.c.experts_kind == "moduledict":
            return dict_experts_spec(self.c)
        return f"experts are a {self.c.experts_kind}, not fused 3-D weights or a dict of expert MLPs"

    def shared(self) -> SharedExpertSpec | None:
        found = shared_expert_of(self.c.module, exclude=(self.router_name, self.c.experts_path))
        return None if found is None else SharedExpertSpec(module_path=found[0], gate_path=found[1])

    def block_jitter(self) -> float:
        """Input jitter the block applies itself (Mixtral); jitter inside the router module runs with it."""
        value = _attr(self.c.module, JITTER_NAMES, (float, int))
        return float(value) if value else 0.0

    def specs(self, name: str, routers: list[RouterSpec], capacities: Sequence[CapacitySpec | None] = (None,),
              notes: tuple[str, ...] = ()) -> list[MoESpec] | str:
        experts = self.experts()
        if isinstance(experts, str):
            return experts
        # transformers 5.x blocks return the hidden states; 4.x-style blocks also return the router logits
        return [MoESpec(path=self.c.path, recogniser=name, router=r, experts=experts, shared=self.shared(),
                        capacity=cap, side_outputs=side, notes=notes)
                for r, cap, side in product(routers, capacities, ((), ("router_logits",)))]


def fused_experts_spec(c: Candidate, D: int) -> ExpertsSpec | str:
    """transformers' fused experts: the layout from its declared flags, the activation from `act_fn`."""
    x = c.experts
    flags = {f: getattr(x, f, None) for f in ("has_gate", "has_bias", "is_transposed", "is_concatenated",
                                              "has_post_expert_norm")}
    if flags["has_bias"] or flags["has_post_expert_norm"] or flags["is_concatenated"] is False:
        return (f"experts {c.experts_path} declare {flags}: expert biases, post-expert norms and interleaved "
                f"gate/up are not read by this recogniser")
    apply_gate = getattr(type(x), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"experts {c.experts_path} ({type(x).__name__}) override _apply_gate: a custom gated activation"
    transposed, gated = bool(flags["is_transposed"]), flags["has_gate"] is not False
    layouts = [lay for lay in expert_layouts(c, D)
               if lay["gated"] == gated and lay["w_down"].transpose == transposed
               and (not gated or lay["w_gate"].chunk == (0, 2))]
    if not layouts:
        return f"3-D parameters {c.fused_params} do not read as the declared layout (is_transposed={transposed}, D={D})"
    act = activation_of(x)
    activation = (GATED if gated else PLAIN).get(act or "")
    if activation is None:
        return f"expert activation {act!r} ({'gated' if gated else 'plain'}) of {c.experts_path} is not supported"
    lay = layouts[0]
    return ExpertsSpec(num_experts=c.num_experts, hidden_dim=D, ffn_dim=lay["F"], activation=activation,  # type: ignore[arg-type]
                       w_gate=lay["w_gate"], w_up=lay["w_up"], w_down=lay["w_down"], container=c.experts_path)


def dict_experts_spec(c: Candidate) -> ExpertsSpec | str:
    """A ModuleDict of expert MLPs (wi/wo or gate/up/down linears), stacked per expert."""
    expert = c.experts.get_submodule(c.expert_names[0])
    dropout = [m.p for m in expert.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        return (f"experts of {c.path or '<root>'} apply dropout p={dropout[0]} in train mode, which the canonical "
                f"graph does not reproduce; set the config's dropout_rate=0 to rewrite this block")
    return stacked_experts_spec(c, list(c.expert_names))


def _router_block(c: Candidate) -> tuple[HFBlock, int | None] | str:
    """The shared preamble: a router *module* (not a bare Linear) whose output holds the logits."""
    if c.experts_kind not in ("fused", "moduledict"):
        return "experts are not fused 3-D weights or a dict of expert MLPs"
    block = HFBlock(c)
    if isinstance(block.router, nn.Linear):
        return f"router {block.router_name} is a plain nn.Linear: no router module to keep calling"
    index = block.logits_index()
    if isinstance(index, str):
        return index
    return block, index


def softmax_topk(c: Candidate) -> list[MoESpec] | str:
    """softmax over E → top-k → renormalise if `norm_topk_prob` (Mixtral always does)."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index = found
    top_k = _attr(block.router, ("top_k",), int)
    if top_k is None:
        return f"router {block.router_name} has no int top_k attribute"
    if _attr(block.router, N_GROUP_NAMES, int) or _selection_bias(block) is not None:
        return f"router {block.router_name} has groups or a selection bias: a group_limited router"
    renorm = _attr(block.router, RENORM_NAMES, bool)
    routers = [block.router_spec(index, top_k=top_k, score_func="softmax", renormalize=r, jitter_eps=block.block_jitter())
               for r in ([renorm] if renorm is not None else [True, False])]
    return block.specs("hf-softmax-topk", routers)


def _selection_bias(block: HFBlock) -> str | None:
    for name in SELECTION_BIAS_NAMES:
        value = getattr(block.router, name, None)
        if isinstance(value, torch.Tensor) and value.shape == (block.E,):
            return f"{block.router_name}.{name}"
    return None


def group_limited(c: Candidate) -> list[MoESpec] | str:
    """DeepSeek-V3: sigmoid scores (+ selection-only bias) → group-limited top-k → weights from the
    unbiased scores, renormalised if `norm_topk_prob`, times `routed_scaling_factor`."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index = found
    r = block.router
    top_k = _attr(r, ("top_k",), int)
    bias = _selection_bias(block)
    n_group = _attr(r, N_GROUP_NAMES, int) or 1
    if top_k is None or (bias is None and n_group == 1):
        return f"router {block.router_name} has no top_k, or neither a selection bias {SELECTION_BIAS_NAMES} nor groups"
    if _attr(r, ("topk_method",), str) == "greedy":  # DeepSeek-V2: groups configured but not used
        n_group = 1
    topk_group = min(_attr(r, TOPK_GROUP_NAMES, int) or n_group, n_group)
    scaling = _attr(r, SCALING_NAMES, (float, int)) or 1.0
    renorm = _attr(r, RENORM_NAMES, bool)
    common = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(scaling),
                  selection_bias=None if bias is None else TensorSource.param(bias), jitter_eps=block.block_jitter())
    routers = [block.router_spec(index, score_func=score, renormalize=rn, group_score=gs, **common)
               for score, gs, rn in product(("sigmoid", "softmax"), ("top2_sum", "max"),
                                            [renorm] if renorm is not None else [True, False])]
    return block.specs("hf-group-limited", routers)


def top1_capacity(c: Candidate) -> list[MoESpec] | str:
    """SwitchTransformers: softmax → top-1 (argmax) with a fixed expert capacity counted per sequence;
    an overflowing token's expert output is dropped (its weight is the unrenormalised probability)."""
    found = _router_block(c)
    if isinstance(found, str):
        return found
    block, index = found
    capacity = _attr(block.router, CAPACITY_NAMES, int)
    if capacity is None:
        return f"router {block.router_name} has no int {CAPACITY_NAMES[0]} attribute"
    notes: tuple[str, ...] = ()
    if _attr(block.router, JITTER_NAMES, (float, int)):
        notes = (f"router jitter runs inside {block.router_name} (called by the graph)",)
    router = block.router_spec(index, top_k=1, score_func="softmax", renormalize=False, jitter_eps=block.block_jitter())
    capacities = [CapacitySpec(capacity_factor=None, fixed=capacity, scope=scope, priority="token_major",
                               drop_policy=drop)
                  for scope, drop in product(("sequence", "batch"), ("zero", "identity"))]
    return block.specs("hf-top1-capacity", [router], capacities, notes=notes)


RECOGNISERS: list[tuple[str, Callable[[Candidate], list[MoESpec] | str]]] = [
    ("hf-group-limited", group_limited),
    ("hf-top1-capacity", top1_capacity),
    ("hf-softmax-topk", softmax_topk),
]
