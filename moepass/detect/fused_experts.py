"""Recogniser: fused 3-D expert weights used with batched / grouped matmul.

Reads the weight layout from shapes: with D from the router's [E, D] weight, a 3-D parameter
[E, D, X] is input-major (x @ W) and [E, X, D] output-major (W @ x, nn.Linear's layout). A gate/up
parameter with X = 2F holds gate and up halves. The activation is functional code, so the gated
and plain activations are hypotheses for the semantic check.
"""

from __future__ import annotations

from itertools import permutations, product

from moepass.detect.candidates import Candidate, read_top_k, shared_expert_of
from moepass.detect.router import router_hypotheses
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, SharedExpertSpec, TensorSource

NAME = "fused-3d"
GATED_ACTS = ("swiglu", "geglu")
PLAIN_ACTS = ("gelu", "relu", "gelu_tanh")
BIAS_NAMES = {"gate": ("b_gate_up", "gate_up_proj_bias", "bi", "b1"), "down": ("down_proj_bias", "bo", "b2", "b_down")}


def expert_layouts(c: Candidate, D: int) -> list[dict]:
    """Possible (w_gate, w_up, w_down, F) readings of two fused parameters.

    Input-major ("x @ W"): gate/up [E, D, X], down [E, F, D]. Output-major (nn.Linear's [out, in]):
    gate/up [E, X, D], down [E, D, F]. X = 2F holds gate and up halves (either order); X = F is a
    plain FFN. Canonical layouts are gate/up [E, F, D] and down [E, D, F].
    """
    prefix = f"{c.experts_path}." if c.experts_path else ""
    if len(c.fused_params) != 2:
        return []
    layouts = []
    for (up_name, su), (down_name, sd) in permutations(c.fused_params.items(), 2):
        for input_major in (True, False):
            if input_major and su[1] == D and sd[2] == D:
                X, F, chunk_dim = su[2], sd[1], 2
            elif not input_major and su[2] == D and sd[1] == D:
                X, F, chunk_dim = su[1], sd[2], 1
            else:
                continue
            down = TensorSource.param(prefix + down_name, transpose=input_major)
            if X == 2 * F:
                for gate_half in (0, 1):
                    half = dict(transpose=input_major, chunk_dim=chunk_dim)
                    layouts.append(dict(
                        F=F, gated=True, w_down=down,
                        w_gate=TensorSource.param(prefix + up_name, chunk=(gate_half, 2), **half),
                        w_up=TensorSource.param(prefix + up_name, chunk=(1 - gate_half, 2), **half)))
            elif X == F:
                layouts.append(dict(F=F, gated=False, w_down=down, w_up=None,
                                    w_gate=TensorSource.param(prefix + up_name, transpose=input_major)))
    return layouts


def _bias(c: Candidate, role: str, shape: tuple[int, int]) -> TensorSource | None:
    owner = c.experts
    prefix = f"{c.experts_path}." if c.experts_path else ""
    for name in BIAS_NAMES[role]:
        p = getattr(owner, name, None)
        if p is not None and tuple(p.shape) == shape:
            return TensorSource.param(prefix + name)
    return None


def recognise(c: Candidate, capacity: CapacitySpec | None = None, name: str = NAME) -> list[MoESpec] | str:
    if c.experts_kind != "fused":
        return "experts are not fused 3-D weights"
    D = int(c.module.get_submodule(c.router_path).weight.shape[1])  # type: ignore[index]
    layouts = expert_layouts(c, D)
    if not layouts:
        return f"3-D parameters {c.fused_params} do not read as gate/up [E, D, F|2F] and down [E, F, D] with D={D}"
    shared = shared_expert_of(c.module, exclude=(c.router_path, c.experts_path))
    shared_spec = None if shared is None else SharedExpertSpec(module_path=shared[0], gate_path=shared[1])
    top_k = read_top_k(c.module)
    specs = []
    for layout, k in product(layouts, [top_k] if top_k else [1, 2]):
        F = layout["F"]
        for act in GATED_ACTS if layout["gated"] else PLAIN_ACTS:
            b_gate = _bias(c, "gate", (c.num_experts, 2 * F if layout["gated"] else F))
            if layout["gated"] and b_gate is not None:
                continue  # fused gate/up bias halves: not read by this recogniser
            experts = ExpertsSpec(
                num_experts=c.num_experts, hidden_dim=D, ffn_dim=F, activation=act,  # type: ignore[arg-type]
                w_gate=layout["w_gate"], w_up=layout["w_up"], w_down=layout["w_down"],
                b_gate=b_gate, b_down=_bias(c, "down", (c.num_experts, D)), container=c.experts_path,
            )
            for router in router_hypotheses(c.module, c.router_path, c.num_experts, min(k, c.num_experts)):
                specs.append(MoESpec(path=c.path, recogniser=name, router=router, experts=experts,
                                     shared=shared_spec, capacity=capacity))
    return specs
