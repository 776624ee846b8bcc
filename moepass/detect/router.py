"""Router hypotheses: the selection rules a hand-written router may implement.

A block's code is not read; its attributes order the hypotheses (e.g. `renormalize=False` puts the
un-normalised rule first) and the semantic check keeps the first one that reproduces the block.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moepass.spec import RouterSpec, TensorSource

RENORM_ATTRS = ("renormalize", "norm_topk_prob", "normalize_expert_weights", "normalize")

# (label, RouterSpec fields), in default prior order
_RULES: list[tuple[str, dict[str, Any]]] = [
    ("softmax, top-k, renormalise", dict(score_func="softmax", softmax_before_topk=True, renormalize=True)),
    ("softmax, top-k", dict(score_func="softmax", softmax_before_topk=True, renormalize=False)),
    ("top-k logits, softmax", dict(score_func="softmax", softmax_before_topk=False, renormalize=False)),
    ("sigmoid, top-k, renormalise", dict(score_func="sigmoid", renormalize=True)),
    ("sigmoid, top-k", dict(score_func="sigmoid", renormalize=False)),
]


def read_flag(module: nn.Module, names: tuple[str, ...]) -> bool | None:
    for owner in (module, *module.children()):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, bool):
                return value
    return None


def router_hypotheses(block: nn.Module, router_path: str, num_experts: int, top_k: int) -> list[RouterSpec]:
    """RouterSpecs to try for a block whose router is the child `router_path`, best guess first."""
    router = block.get_submodule(router_path)
    bias = getattr(router, "bias", None)
    common = dict(
        num_experts=num_experts,
        top_k=top_k,
        weight=TensorSource.param(f"{router_path}.weight"),
        bias=TensorSource.param(f"{router_path}.bias") if isinstance(bias, nn.Parameter) else None,
        module_path=router_path,
    )
    renorm = read_flag(block, RENORM_ATTRS)
    rules = list(_RULES)
    if renorm is False:
        rules.sort(key=lambda rule: rule[1].get("renormalize", False))
    return [RouterSpec(**common, **fields) for _label, fields in rules]  # type: ignore[arg-type]
