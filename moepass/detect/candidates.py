"""Structural candidates: modules that hold a router producing E scores and E experts, or that say
they are MoE blocks (a `moepass_spec(path)` method: `moepass.detect.self_described`).

Detection never edits the model. A candidate only says "this looks like an MoE block"; a
recogniser turns it into MoESpec hypotheses and the semantic check decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

# Linear names by role inside one expert MLP (first match wins).
GATE_NAMES = ("w1", "gate_proj", "wi_0", "fc1", "wi", "up_proj_gate", "linear_in")
UP_NAMES = ("w3", "up_proj", "wi_1")
DOWN_NAMES = ("w2", "down_proj", "wo", "fc2", "linear_out")
TOPK_ATTRS = ("top_k", "num_experts_per_tok", "k", "topk", "moe_k")
SPEC_METHOD = "moepass_spec"  # the self-description protocol: module.moepass_spec(path) -> MoESpec
SELF_DESCRIBED = "self-described"  # Candidate.experts_kind of a module implementing it


@dataclass
class Candidate:
    path: str
    module: nn.Module
    num_experts: int  # 0 for a self-described block (its spec says)
    router_path: str  # child holding the router weight [E, D]
    experts_path: str  # "" when the experts' 3-D weights live on the block itself
    experts_kind: str  # "modulelist", "moduledict", "fused" or SELF_DESCRIBED
    fused_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> shape, relative to block
    expert_names: tuple[str, ...] = ()  # keys of the experts container, in expert order (ModuleList/ModuleDict)

    @property
    def experts(self) -> nn.Module:
        return self.module.get_submodule(self.experts_path) if self.experts_path else self.module


def _is_router_weight(weight: object, num_experts: int) -> bool:
    return isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == num_experts


def _router_of(module: nn.Module, num_experts: int, exclude: str) -> str | None:
    """A child whose weight is [E, D] (an nn.Linear to E outputs or a router module), else a router
    module whose only [E, D] weight is one level down (SwitchTransformers: `router.classifier`)."""
    children = [(n, c) for n, c in module.named_children() if n != exclude]
    for name, child in children:
        if _is_router_weight(getattr(child, "weight", None), num_experts):
            return name
    for name, child in children:
        inner = [n for n, g in child.named_children() if _is_router_weight(getattr(g, "weight", None), num_experts)]
        if len(inner) == 1 and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            return f"{name}.{inner[0]}"
    return None


def _listed_experts(module: nn.Module) -> tuple[str, str, tuple[str, ...]] | None:
    """A ModuleList or ModuleDict child of >= 1 identical MLPs (>= 2 linears each): (name, kind, keys)."""
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 1:
            experts = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
            kinds = {type(m) for m in experts}
            linears = [m for m in experts[0].modules() if isinstance(m, nn.Linear)]
            if len(kinds) == 1 and len(linears) >= 2:
                if isinstance(child, nn.ModuleDict):
                    return name, "moduledict", tuple(child.keys())
                return name, "modulelist", tuple(str(i) for i in range(len(child)))
    return None


def _fused_experts(module: nn.Module) -> tuple[str, int, dict[str, tuple[int, ...]]] | None:
    """3-D parameters sharing a leading dim E, on the block itself or on one child."""
    places: list[tuple[str, nn.Module]] = [("", module)] + list(module.named_children())
    for prefix, owner in places:
        params3 = {n: tuple(p.shape) for n, p in owner.named_parameters(recurse=False) if p.dim() == 3}
        if len(params3) >= 2 and len({s[0] for s in params3.values()}) == 1:
            E = next(iter(params3.values()))[0]
            return prefix, E, params3
    return None


def find_candidates(model: nn.Module) -> list[Candidate]:
    """Every module that structurally looks like an MoE block (outermost first, not nested)."""
    found: list[Candidate] = []
    for path, module in model.named_modules():
        if any(path.startswith(c.path + ".") or c.path == "" for c in found if c.path != path):
            continue
        if callable(getattr(module, SPEC_METHOD, None)):  # it says what it is (checked like any other)
            found.append(Candidate(path, module, 0, router_path="", experts_path="", experts_kind=SELF_DESCRIBED))
            continue
        listed = _listed_experts(module)
        if listed is not None:
            name, kind, keys = listed
            router = _router_of(module, len(keys), exclude=name)
            if router is not None:
                found.append(Candidate(path, module, len(keys), router, name, kind, expert_names=keys))
                continue
        fused = _fused_experts(module)
        if fused is not None:
            prefix, E, params3 = fused
            router = _router_of(module, E, exclude=prefix)
            if router is not None:
                found.append(Candidate(path, module, E, router, prefix, "fused", params3))
    return found


def find_dense_mlps(model: nn.Module, moe_paths: list[str]) -> list[str]:
    """Modules shaped like a dense FFN (gate/up/down or fc1/fc2 linears) outside any MoE block."""
    dense = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") or p == "" for p in moe_paths):
            continue
        names = {n for n, c in module.named_children() if isinstance(c, nn.Linear)}
        has_gate = any(n in names for n in GATE_NAMES)
        has_down = any(n in names for n in DOWN_NAMES)
        if has_gate and has_down and not isinstance(module, nn.ModuleList):
            dense.append(path)
    return dense


def read_top_k(module: nn.Module) -> int | None:
    for owner in (module, *module.children()):
        for attr in TOPK_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
    return None


def first_child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Linear):
            return name
    return None


def activation_of(expert: nn.Module) -> str | None:
    """The activation of an expert MLP, from its activation module (nn.SiLU, nn.GELU, nn.ReLU, ...)."""
    for child in expert.modules():
        name = type(child).__name__.lower()
        if "silu" in name or "swish" in name:
            return "silu"
        if "gelu" in name:
            approximate = getattr(child, "approximate", "none")
            return "gelu_tanh" if approximate == "tanh" or "tanh" in name or "new" in name else "gelu"
        if "relu" in name:
            return "relu"
    return None


def shared_expert_of(module: nn.Module, exclude: tuple[str, ...]) -> tuple[str, str | None] | None:
    """(shared expert path, its sigmoid gate path or None) among the block's children, by name."""
    shared = gate = None
    for name, child in module.named_children():
        if name in exclude or "shared" not in name.lower():
            continue
        if "gate" in name.lower() and isinstance(child, nn.Linear) and child.out_features == 1:
            gate = name
        elif shared is None:
            shared = name
    return None if shared is None else (shared, gate)
