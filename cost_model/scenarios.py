"""Published set-ups (shared/scenarios/*.json) read into concrete cases: a model on a cluster.

`cases(scenario)` expands every EP-form model of a scenario file over its variants and cluster sizes
into `Case`s, with the hardware the scenario names (null figures filled from presets, each fill
reported) and the shapes it does not give filled with stated assumptions. Both the plan search
(`cost_model.search.search_scenario`) and the simulator (`cost_model.simulate`) read scenarios
through here; this module imports neither.
"""

from __future__ import annotations

import json
import re
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
# Adaptive input / softmax (Baevski & Auli 2019; Transformer-XL's WikiText-103 configuration) when a set-up names it
# without its sizes: the vocabulary split at these cutoffs, cluster i embedded at hidden / div_val^i and projected
# to hidden (input and output tied: counted once)
ADAPTIVE_CUTOFFS = (20000, 40000, 200000)
ADAPTIVE_DIV_VAL = 4

# Every field a scenario file may hold ("models[].id": the key of each entry of a list of objects; "model.*" is
# read as "models[].*"), and what reads it. `cases` states each present field of `NOT_MODELLED` (why it is not)
# and each field in neither table (unknown: not read) among its assumptions; nothing is silently ignored.
READ_FIELDS: dict[str, str] = {
    "name": "the report's title",
    "cluster.nodes": "the cluster size (nodes x devices_per_node), the spread placement's node count",
    "cluster.devices_per_node": "ranks per node: which links an exchange crosses",
    "cluster.device": "the preset that fills null figures and gives memory, efficiency, latency",
    "cluster.device_flops": "compute rate",
    "cluster.intra_node_bw": "intra-node link",
    "cluster.inter_node_bw": "inter-node link",
    "cluster.inter_node_bw_per": "'device' (the README's convention, default) or 'node': the figure shared by a "
                                 "node's devices",
    "cluster.link_names": "the inter-node link's named rate, compared with inter_node_bw (per device or per node)",
    "cluster.placement": "'packed' (fewest nodes, default) or 'spread' (over min(nodes, W) nodes) when devices_"
                         "equal_experts sizes the run below the cluster",
    "cluster.placement_note": "stated placement assumption (which nodes hold the small runs)",
    "cluster_sizes_devices": "one case per cluster size",
    "devices_equal_experts": "one case per expert count with W = E",
    "micro_op_bytes": "Lina's micro-op (the priority schedule's gradient piece)",
    "batch.global_batch_sequences": "tokens per device",
    "batch.sequence_length": "tokens per device",
    "batch.note": "parsed 'batch N at M devices' (global sequences, kept per device at other sizes), else quoted in "
                  "the default batch's assumption",
    "batch.dropless": "true: experts take every routed row (capacity none); false refused without a capacity",
    "routing.note": "parsed 'max/mean X': the Zipf skew fitted to it",
    "routing.zipf_s": "the Zipf skew", "routing.max_mean": "the Zipf skew fitted to it",
    "routing.trace": "recorded routed rows over steps", "routing.counts": "recorded routed rows (static)",
    "routing.drift.sigma": "AR(1) drift of the popularity", "routing.drift.rho": "AR(1) drift of the popularity",
    "models[].id": "the case label; the system note's per-model tags (TP 8 (e8k2))",
    "models[].form": "which models are EP cases (HP's own model read by the HP pricing)",
    "models[].layers": "MoE layers", "models[].moe_layers": "MoE layers",
    "models[].hidden": "D", "models[].ffn_hidden": "F", "models[].experts": "E",
    "models[].experts_per_layer": "one case per E", "models[].top_k": "K",
    "models[].heads": "EP: hidden = heads x 128 when hidden is null; HP: the Multi-Head LatentMoE's heads",
    "models[].head_dim": "HP: the head width",
    "models[].experts_per_head": "HP: null (the case's E per head); a figure is refused",
    "models[].activation": "gated (SwiGLU: 3 matmuls) or not",
    "models[].expert_parallel": "the case's EP degree: the routing skew's reference degree and the EP plans' (a "
                                "locality set-up's systems lay the experts over all W ranks: stated on loading)",
    "models[].expert_slots_per_device": "FSEP's C",
    "models[].vocab": "the embeddings in the dense gradients",
    "models[].vocab_note": "'adaptive softmax': the embedding sized by adaptive_softmax (or its published defaults)",
    "models[].adaptive_softmax.cutoffs": "the adaptive embedding's clusters",
    "models[].adaptive_softmax.div_val": "the adaptive embedding's width per cluster",
    "systems[].id": "the row's name; 'fsdp' in it: FSDP+EP",
    "systems[].form": "ep, fsep, hp, locality",
    "systems[].note": "parsed: 'TP n (tag)', 'EP n', 'prefetch depth n', 'replicat...'; the rest is prose (LAER's "
                      "'5-step history' is the history every planner here sees, cost_model.routing.HISTORY)",
    "systems[].routing": "locality set-ups: 'hash' or a learned router",
    "systems[].schedule": "Lina: partitioned / priority", "systems[].packing": "Lina's packing ('auto': searched)",
    "systems[].tp": "TP degree", "systems[].ep_size": "EP degree", "systems[].sharding": "'fsdp'",
    "systems[].replicas": "FlexMoE's extra expert slots per device beyond EP's E/ep", "systems[].prefetch_depth": "FSEP's restore depth",
    "systems[].locality_ratio": "LocMoE's locality ratio", "systems[].capacity_factor": "locality capacity",
    "systems[].delta": "LocMoE's capacity floor",
}
NOT_MODELLED: dict[str, str] = {
    "technique": "prose: the technique's name",
    "cluster.note": "prose (a null figure it speaks of is filled from a preset and reported as such)",
    "models[].note": "prose (the sizes it speaks of are read from the model's figures)",
    "models[].dense_params_note": "prose: says what the model already does (attention, embeddings and norms "
                                  "data-parallel, their gradients all-reduced)",
    "models[].model_parallel": "tensor parallelism inside the experts (each expert split over this many devices) "
                               "is not laid out: EP-form plans put whole experts on ranks and the locality layout "
                               "whole experts on a home node; tokens per device are the global batch over W either way",
}


def field_paths(scenario: dict[str, Any]) -> list[str]:
    """Every field of a scenario file as a path ("cluster.nodes", "models[].id"), in file order, each once."""
    out: dict[str, None] = {}

    def walk(value: Any, prefix: str) -> None:
        for key, item in value.items():
            path = f"{prefix}{key}"
            if path.startswith("model."):
                path = "models[]." + path[len("model."):]
            if isinstance(item, dict) and key not in ("trace", "counts"):
                walk(item, path + ".")
            elif isinstance(item, list) and item and all(isinstance(x, dict) for x in item):
                for x in item:
                    walk(x, path + "[].")
            else:
                out[path] = None

    walk(scenario, "")
    return list(out)


# what `cost_model.system_plans` reads in a system's note (its TP and EP degrees, FSEP's prefetch depth, replication)
NOTE_FIGURES = re.compile(r"\bTP\s*[0-9]+|\bEP\s*[0-9]+|prefetch depth\s*[0-9]+|replicat", re.IGNORECASE)


def _report_fields(sc: dict[str, Any], assumptions: list[str]) -> None:
    """States each field of the file the model does not read, with why (`NOT_MODELLED`), or as unknown, and each
    system note in which nothing is read."""
    for path in field_paths(sc):
        if path in READ_FIELDS:
            continue
        why = NOT_MODELLED.get(path, "unknown field: not read by the cost model (a typo, or a figure it lacks)")
        assumptions.append(f"field {path} not modelled: {why}")
    for system in sc.get("systems") or []:
        if system.get("note") and not NOTE_FIGURES.search(str(system["note"])):
            assumptions.append(f"systems[{system.get('id')!r}].note: prose, nothing in it read (no TP / EP degree, "
                               f"prefetch depth or replication): the system runs as its form and fields say")


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


def _hardware(cluster: dict[str, Any], filled: dict[str, str], assumptions: list[str]) -> Hardware:
    base = for_device(cluster.get("device"))
    if base is None:
        base = H100
        filled["device"] = f"not given: preset {H100.name} ({H100.device})"
    keys = {"device_flops": "flops", "intra_node_bw": "intra_bw", "inter_node_bw": "inter_bw"}
    given = {f: cluster.get(k) for k, f in keys.items()}
    given["inter_bw"] = _inter_node_bw(cluster, assumptions)
    hw = base.with_figures("scenario file", **given)
    for key, f in keys.items():
        if cluster.get(key) is None:
            filled[key] = f"preset {base.name}: {getattr(base, f).value:.4g} ({getattr(base, f).source})"
    for f in ("efficiency", "alpha"):
        filled[f] = f"preset {base.name}: {getattr(base, f).value:.4g} ({getattr(base, f).source})"
    return hw


LINK_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([GT])b(?:it)?/s", re.IGNORECASE)


def _inter_node_bw(cluster: dict[str, Any], assumptions: list[str]) -> float | None:
    """The inter-node figure per device: `inter_node_bw`, divided by devices_per_node when
    `inter_node_bw_per` is "node"; when the named inter-node link (`link_names`' last) gives a rate the figure
    is at least half of, both readings are stated (a figure near one link's rate is per device only if every
    device has such a link)."""
    bw = cluster.get("inter_node_bw")
    names = cluster.get("link_names") or []
    found = LINK_RATE.search(str(names[-1])) if names else None
    if names and (bw is None or found is None):
        assumptions.append(f"cluster.link_names {names}: no inter-node figure and named rate to compare; the links' "
                           f"structure (groups within a node, switch tiers) is not laid out: one intra-node and one "
                           f"inter-node link per device")
    if bw is None:
        return None
    per = cluster.get("inter_node_bw_per", "device")
    if per not in ("device", "node"):
        raise ValueError(f"cluster.inter_node_bw_per={per!r}: use 'device' (a figure per device) or 'node' "
                         f"(shared by the node's {cluster['devices_per_node']} devices)")
    G = int(cluster["devices_per_node"])
    if found and "inter_node_bw_per" not in cluster:
        rate = float(found.group(1)) * (1e9 if found.group(2).upper() == "G" else 1e12) / 8  # bytes/s
        if float(bw) >= 0.5 * rate:
            assumptions.append(
                f"cluster.inter_node_bw {float(bw) / 1e9:.4g} GB/s is {float(bw) / rate:.0%} of the named inter-node "
                f"link ({names[-1]}: {rate / 1e9:.4g} GB/s): read per device, as the scenario README states (each "
                f"device its own such link); if the node's {G} devices share it, set cluster.inter_node_bw_per = "
                f"'node' (per device {float(bw) / G / 1e9:.4g} GB/s)")
    return float(bw) / G if per == "node" else float(bw)


def _cluster_sizes(cluster: dict[str, Any], scenario: dict[str, Any], experts: int) -> list[tuple[int, int]]:
    per_node = int(cluster["devices_per_node"])
    if scenario.get("devices_equal_experts"):
        W = experts
        if cluster.get("placement", "packed") == "spread":
            nodes = min(int(cluster.get("nodes") or 1), W)
            if W % nodes:
                raise ValueError(f"cluster.placement='spread': {W} devices do not spread evenly over {nodes} nodes")
            return [(nodes, W // nodes)]
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


BATCH_AT = re.compile(r"batch\s+([0-9]+)\s+at\s+([0-9]+)\s+devices", re.IGNORECASE)


def _tokens(scenario: dict[str, Any], W: int, assumptions: list[str]) -> tuple[int, int | None]:
    batch = scenario.get("batch") or {}
    if batch.get("dropless") is False:
        raise ValueError("batch.dropless=false: the set-up drops tokens, but gives no capacity factor to price; give "
                         "the systems' capacity_factor or drop the field (dropless)")
    if batch.get("global_batch_sequences") and batch.get("sequence_length"):
        seq = int(batch["sequence_length"])
        return int(batch["global_batch_sequences"]) * seq // W, seq
    found = BATCH_AT.search(str(batch.get("note", "")))
    if found:
        sequences, at = int(found.group(1)), int(found.group(2))
        seq = int(batch.get("sequence_length") or DEFAULT_TOKENS[1])
        tokens = max(1, sequences * seq // at)
        text = (f"batch.note {batch['note']!r}: {sequences} sequences over {at} devices, kept per device at every "
                f"cluster size (weak scaling): {sequences}/{at} x {seq} = {tokens} tokens per device"
                + ("" if batch.get("sequence_length") else f" (sequence length not given: {seq} assumed)"))
        if text not in assumptions:
            assumptions.append(text)
        return tokens, seq
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
    D = int(model["hidden"])
    adaptive = model.get("adaptive_softmax")
    if adaptive is None and "adaptive softmax" in str(model.get("vocab_note", "")).lower():
        adaptive = {}
    if adaptive is not None:
        if len(sizes) != 1:
            raise ValueError(f"{name}: adaptive_softmax with {len(sizes)} vocabularies: give one vocab")
        cutoffs = [int(c) for c in adaptive.get("cutoffs", ADAPTIVE_CUTOFFS)]
        div = int(adaptive.get("div_val", ADAPTIVE_DIV_VAL))
        V = int(sizes[0])
        if cutoffs != sorted(cutoffs) or not 0 < cutoffs[0] or cutoffs[-1] >= V:
            raise ValueError(f"{name}: adaptive_softmax.cutoffs={cutoffs}: give increasing cutoffs below vocab {V}")
        edges = [0, *cutoffs, V]
        params = 0
        for i in range(len(edges) - 1):
            width = max(1, D // div**i)
            params += (edges[i + 1] - edges[i]) * width + (D * width if i else 0)  # cluster i and its projection
        source = "the set-up's" if model.get("adaptive_softmax") else (
            f"vocab_note names it, sizes not given: Transformer-XL's WikiText-103 cutoffs {list(ADAPTIVE_CUTOFFS)}, "
            f"div_val {ADAPTIVE_DIV_VAL} assumed")
        text = (f"{name}: adaptive input/softmax ({source}): embedding {params / 1e6:.4g} M parameters (clusters at "
                f"{cutoffs}, width hidden / {div}^i, tied input and output) in place of vocab x hidden "
                f"{V * D / 1e6:.4g} M; dense gradients per layer = 4 x hidden^2 + 1/layers of it")
        if text not in assumptions:
            assumptions.append(text)
        return params
    text = (f"{name}: dense gradients per layer = 4 x hidden^2 (attention) + 1/layers of the "
            f"embeddings (vocab {' + '.join(map(str, sizes))} x hidden, an untied output layer not counted again), "
            f"all-reduced over every rank after each layer's backward")
    if text not in assumptions:
        assumptions.append(text)
    return sum(int(v) for v in sizes) * D


def _is_gated(model: dict[str, Any]) -> bool:
    if "activation" in model:
        return model["activation"] in ("swiglu", "geglu", "geglu_tanh", "clamped_swiglu", "softcapped_swiglu")
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
    _report_fields(sc, assumptions)
    hw = _hardware(cluster, filled, assumptions)
    if cluster.get("placement_note") and sc.get("devices_equal_experts") and "placement" not in cluster:
        assumptions.append(f"cluster.placement_note {cluster['placement_note']!r}: each run packed on the fewest "
                           f"nodes (W <= {cluster['devices_per_node']} devices: one node, no inter-node link); set "
                           f"cluster.placement = 'spread' to put W devices over min(nodes, W) nodes")
    found: list[Case] = []
    for model in sc.get("models") or [sc["model"]]:
        if model.get("form") == "hp":
            for key in ("experts_per_head", "top_k"):
                if model.get(key) is not None:
                    raise ValueError(f"{model.get('id', 'hp')}: {key}={model[key]!r}: the HP pricing converts each "
                                     f"EP case at equal active parameters (the case's E per head and its top-k); "
                                     f"set it null, or give heads / head_dim")
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
