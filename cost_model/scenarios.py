"""Published set-ups (shared/scenarios/*.json) read into concrete cases: a model on a cluster.

`cases(scenario)` expands every EP-form model of a scenario file over its variants and cluster sizes
into `Case`s, with the hardware the scenario names (null figures filled from presets, each fill
reported) and the shapes it does not give filled with stated assumptions. Both the plan search
(`cost_model.search.search_scenario`) and the simulator (`cost_model.simulate`) read scenarios
through here; this module imports neither.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_model.presets import H100, Hardware, for_device

DEFAULT_TOKENS = (8, 1024)  # per device, when a set-up gives no machine-readable batch (stated as an assumption)
GATED_FAMILIES = ("mixtral", "qwen", "deepseek", "llama")
# For set-ups that give no sizes: the Mixtral-8x7B layer of USERS.md's proxy shapes (D 4096, F 14336, E 8,
# K 2, SwiGLU; 32 layers), swept over top-k at equal active and total parameters (fine-grained experts:
# granularity g = K/2 splits every expert in g, so E = 8g, F = 14336/g and K*F stays 28672).
PROXY_WIDTH = 4096
PROXY_ACTIVE_FFN = 2 * 14336  # K * F kept constant across the top-k / granularity sweep
PROXY_EXPERTS_PER_K = 4  # E = 4K: 8 experts at K = 2
PROXY_TOP_K = (2, 4, 8)  # granularity x1, x2, x4
# 16 of the Mixtral's 32 layers: the 32-layer stack holds ~47 B parameters, ~750 GB of Adam state, more than one
# node of 8 devices holds; 16 layers fit 80 GB per rank with EP over the 8 (stated with the assumption)
PROXY_LAYERS = 16


@dataclass(frozen=True)
class Case:
    """One model variant of a scenario on one cluster size (nodes x per_node devices)."""

    label: str
    layers: int
    D: int
    F: int
    E: int
    K: int
    gated: bool
    nodes: int
    per_node: int
    tokens: int  # per device
    seq: int | None
    ep: int
    embedding_params: int = 0  # vocab x D over every vocabulary the set-up lists (0: none given)
    dense: float | None = None  # dense parameters per layer when known exactly (a detected model's), else below
    # the share of the T*K routed assignments that reach FFN experts (zero-compute experts: identity / zero)
    ffn_fraction: float = 1.0
    capacity: float | None = None  # the block's own capacity factor (None: dropless)

    @property
    def dense_params(self) -> float:
        """Dense parameters per layer, all-reduced over every rank: `dense` when given, else the attention
        projections (4 D^2; norms ignored) and an even share of the embeddings (DDP all-reduces them in the same
        stream of buckets)."""
        if self.dense is not None:
            return self.dense
        return 4 * self.D**2 + self.embedding_params / self.layers


def load(scenario: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(scenario, dict):
        return scenario
    return json.loads(Path(scenario).read_text())


def _hardware(cluster: dict[str, Any], filled: dict[str, str]) -> Hardware:
    base = for_device(cluster.get("device"))
    if base is None:
        base = H100
        filled["device"] = f"not given: preset {H100.name} ({H100.device})"
    keys = {"device_flops": "flops", "intra_node_bw": "intra_bw", "inter_node_bw": "inter_bw"}
    hw = base.with_figures("scenario file", **{f: cluster.get(k) for k, f in keys.items()})
    for key, f in keys.items():
        if cluster.get(key) is None:
            filled[key] = f"preset {base.name}: {getattr(base, f).value:.4g} ({getattr(base, f).source})"
    for f in ("efficiency", "alpha"):
        filled[f] = f"preset {base.name}: {getattr(base, f).value:.4g} ({getattr(base, f).source})"
    return hw


def _cluster_sizes(cluster: dict[str, Any], scenario: dict[str, Any], experts: int) -> list[tuple[int, int]]:
    per_node = int(cluster["devices_per_node"])
    if scenario.get("devices_equal_experts"):
        W = experts
        return [(max(1, W // per_node), min(W, per_node))]
    if "cluster_sizes_devices" in scenario:
        return [(W // per_node, per_node) for W in scenario["cluster_sizes_devices"]]
    return [(int(cluster.get("nodes") or 1), per_node)]


def _model_variants(model: dict[str, Any], assumptions: list[str]) -> list[dict[str, Any]]:
    """Concrete shapes for one model entry (lists expand; nulls filled with stated assumptions)."""
    mid = model.get("id", "model")
    if model.get("hidden") is None and model.get("heads") and model.get("top_k"):
        model = {**model, "hidden": model["heads"] * 128}
        assumptions.append(f"{mid}: hidden = heads x 128 = {model['hidden']} (head width 128 assumed)")
    if model.get("hidden") is None:
        assumptions.append(
            f"{mid}: sizes not given: Mixtral-8x7B-like layer (USERS.md proxy shapes: D {PROXY_WIDTH}, SwiGLU; "
            f"{PROXY_LAYERS} layers: the Mixtral's 32 need ~750 GB of Adam state, more than one node) at top-k {', '.join(map(str, PROXY_TOP_K))} with fine-grained experts: "
            f"E = {PROXY_EXPERTS_PER_K}K, F = {PROXY_ACTIVE_FFN}/K (equal active and total parameters)"
        )
        return [
            {
                "id": f"{mid}[K={k},E={PROXY_EXPERTS_PER_K * k}]",
                "hidden": PROXY_WIDTH,
                "ffn_hidden": PROXY_ACTIVE_FFN // k,
                "experts": PROXY_EXPERTS_PER_K * k,
                "top_k": k,
                "layers": PROXY_LAYERS,
                "activation": "swiglu",
            }
            for k in PROXY_TOP_K
        ]
    if model.get("ffn_hidden") is None:
        model = {**model, "ffn_hidden": 4 * model["hidden"]}
        assumptions.append(f"{mid}: ffn_hidden = 4 x hidden (assumed)")
    experts = model.get("experts_per_layer") or [model.get("experts")]
    return [{**model, "experts": e, "id": mid if len(experts) == 1 else f"{mid}[E={e}]"} for e in experts]


def _tokens(scenario: dict[str, Any], W: int, assumptions: list[str]) -> tuple[int, int | None]:
    batch = scenario.get("batch") or {}
    if batch.get("global_batch_sequences") and batch.get("sequence_length"):
        seq = int(batch["sequence_length"])
        return int(batch["global_batch_sequences"]) * seq // W, seq
    note = f" (set-up says: {batch['note']!r})" if batch.get("note") else ""
    text = f"batch per device {DEFAULT_TOKENS[0]} x {DEFAULT_TOKENS[1]} tokens{note}"
    if text not in assumptions:
        assumptions.append(text)
    return DEFAULT_TOKENS[0] * DEFAULT_TOKENS[1], DEFAULT_TOKENS[1]


def _ep_degree(model: dict[str, Any], E: int, W: int) -> int:
    if model.get("expert_parallel"):
        return int(model["expert_parallel"])
    return max(d for d in range(1, W + 1) if W % d == 0 and (E % d == 0))


def _embedding_params(model: dict[str, Any], name: str, assumptions: list[str]) -> int:
    """vocab x hidden summed over the model's vocabularies (a list: encoder and decoder), 0 if none given;
    `name`: the set-up's model id, for the stated assumption."""
    vocab = model.get("vocab")
    if vocab is None:
        return 0
    sizes = vocab if isinstance(vocab, list) else [vocab]
    text = (f"{name}: dense gradients per layer = 4 x hidden^2 (attention) + 1/layers of the "
            f"embeddings (vocab {' + '.join(map(str, sizes))} x hidden, an untied output layer not counted again), "
            f"all-reduced over every rank after each layer's backward")
    if text not in assumptions:
        assumptions.append(text)
    return sum(int(v) for v in sizes) * int(model["hidden"])


def _is_gated(model: dict[str, Any]) -> bool:
    if "activation" in model:
        return model["activation"] in ("swiglu", "geglu", "clamped_swiglu", "softcapped_swiglu")
    return any(f in str(model.get("id", "")).lower() for f in GATED_FAMILIES)


@dataclass
class ScenarioCases:
    """A scenario file read into concrete cases, with the figures presets filled and what was assumed."""

    scenario: dict[str, Any]
    hardware: Hardware
    cases: list[Case]
    filled: dict[str, str]
    assumptions: list[str]


def cases(scenario: str | Path | dict[str, Any]) -> ScenarioCases:
    """Every (model variant, cluster size) of a scenario as a `Case` (EP-form models only)."""
    sc = load(scenario)
    filled: dict[str, str] = {}
    assumptions: list[str] = []
    cluster = sc["cluster"]
    hw = _hardware(cluster, filled)
    found: list[Case] = []
    for model in sc.get("models") or [sc["model"]]:
        if model.get("form") not in (None, "ep"):
            continue  # a model of another form (e.g. HP's own architecture): its system is listed separately
        for variant in _model_variants(model, assumptions):
            for nodes, per_node in _cluster_sizes(cluster, sc, int(variant["experts"])):
                W = nodes * per_node
                tokens, seq = _tokens(sc, W, assumptions)
                found.append(Case(
                    label=f"{variant['id']} W={W}",
                    layers=int(variant.get("layers") or variant["moe_layers"]),
                    D=int(variant["hidden"]),
                    F=int(variant["ffn_hidden"]),
                    E=int(variant["experts"]),
                    K=int(variant["top_k"]),
                    gated=_is_gated(variant),
                    nodes=nodes,
                    per_node=per_node,
                    tokens=tokens,
                    seq=seq,
                    ep=_ep_degree(variant, int(variant["experts"]), W),
                    embedding_params=_embedding_params(variant, str(model.get("id", "model")), assumptions),
                ))
    return ScenarioCases(sc, hw, found, filled, assumptions)
