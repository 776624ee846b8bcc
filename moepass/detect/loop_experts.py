"""Recogniser: a ModuleList of expert MLPs called in a Python loop (Mixtral reference style)."""

from __future__ import annotations

from moepass.detect.candidates import (
    DOWN_NAMES,
    GATE_NAMES,
    UP_NAMES,
    Candidate,
    activation_of,
    first_child,
    read_top_k,
)
from moepass.detect.router import router_hypotheses
from moepass.spec import ExpertsSpec, MoESpec, TensorSource

NAME = "modulelist-loop"
GATED = {"silu": "swiglu", "gelu": "geglu"}
PLAIN = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "relu": "relu"}


def stacked_experts_spec(c: Candidate, keys: list[str]) -> ExpertsSpec | str:
    """Experts held as one MLP module each (ModuleList / ModuleDict entries `keys`), stacked per expert."""
    expert = c.experts.get_submodule(keys[0])
    gate, up, down = first_child(expert, GATE_NAMES), first_child(expert, UP_NAMES), first_child(expert, DOWN_NAMES)
    if gate is None or down is None:
        return f"expert {type(expert).__name__} has no recognisable gate/down linears (looked for {GATE_NAMES}, {DOWN_NAMES})"
    act = activation_of(expert)
    activation = (GATED if up else PLAIN).get(act or "")
    if activation is None:
        return f"expert activation {act!r} with{'' if up else 'out'} an up projection is not supported"
    linear = getattr(expert, gate)

    def stacked(name: str | None, kind: str) -> TensorSource | None:
        if name is None or (kind == "bias" and getattr(expert, name).bias is None):
            return None
        return TensorSource.stack([f"{c.experts_path}.{key}.{name}.{kind}" for key in keys])

    w_gate, w_down = stacked(gate, "weight"), stacked(down, "weight")
    assert w_gate is not None and w_down is not None
    return ExpertsSpec(
        num_experts=c.num_experts, hidden_dim=linear.in_features, ffn_dim=linear.out_features,
        activation=activation,  # type: ignore[arg-type]
        w_gate=w_gate, w_up=stacked(up, "weight"), w_down=w_down,
        b_gate=stacked(gate, "bias"), b_up=stacked(up, "bias"), b_down=stacked(down, "bias"),
        container=c.experts_path,
    )


def recognise(c: Candidate) -> list[MoESpec] | str:
    if c.experts_kind != "modulelist":
        return "experts are not a ModuleList"
    experts = stacked_experts_spec(c, [str(i) for i in range(c.num_experts)])
    if isinstance(experts, str):
        return experts
    top_k = read_top_k(c.module)
    top_ks = [top_k] if top_k is not None else [1, 2]
    return [
        MoESpec(path=c.path, recogniser=NAME, router=router, experts=experts)
        for k in top_ks
        for router in router_hypotheses(c.module, c.router_path, c.num_experts, min(k, c.num_experts))
    ]
