"""Every scenario field read or refused (issue 31, item 5).

Each key of the four published set-ups (tests/data/scenarios, copies of ../shared/scenarios) is either read by the
cost model (`cost_model.scenarios.READ_FIELDS`, with what reads it) or listed in `NOT_MODELLED` with its reason
and stated when the file is loaded. The fields the model once left unread each move the figure the way the physics
says: LocMoE's batch (tokens per device), Lina's placement (the small runs spread over nodes cross the slow link),
Transformer-XL's adaptive softmax (a smaller embedding: fewer dense gradient bytes), the inter-node link figure
per node (a slower per-device link).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cost_model import scenarios, systems
from cost_model.scenarios import NOT_MODELLED, READ_FIELDS, cases, field_paths
from cost_model.system_plans import system_plans

SCENARIOS = sorted((Path(__file__).parent / "data" / "scenarios").glob("*.json"))


def _load(name: str) -> dict:
    return json.loads(next(p for p in SCENARIOS if p.stem == name).read_text())


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_field_is_read_or_stated_not_modelled(path):
    sc = json.loads(path.read_text())
    fields = field_paths(sc)
    unknown = [f for f in fields if f not in READ_FIELDS and f not in NOT_MODELLED]
    assert not unknown, f"{path.name}: fields neither read nor listed as not modelled: {unknown}"
    assert all(NOT_MODELLED[f] for f in fields if f in NOT_MODELLED)
    stated = "\n".join(cases(sc).assumptions)
    for system in sc.get("systems") or []:
        if system.get("note") and not scenarios.NOTE_FIGURES.search(system["note"]):
            assert f"systems[{system['id']!r}].note: prose, nothing in it read" in stated
    for f in fields:
        if f in NOT_MODELLED:
            assert f"field {f} not modelled: {NOT_MODELLED[f]}" in stated


def test_field_paths_walk_nested_lists_and_model_alias():
    sc = {"name": "x", "cluster": {"nodes": 1}, "model": {"id": "m"}, "systems": [{"id": "a"}, {"id": "b", "tp": 2}],
          "routing": {"trace": [[[1.0, 2.0]]], "drift": {"sigma": 0.1}}}
    assert field_paths(sc) == ["name", "cluster.nodes", "models[].id", "systems[].id", "systems[].tp", "routing.trace",
                               "routing.drift.sigma"]


def test_an_unknown_field_is_stated_not_silently_ignored():
    sc = _load("mh_latentmoe_hp")
    sc["cluster"]["nvlink_gen"] = 4
    assert any(a.startswith("field cluster.nvlink_gen not modelled: unknown field") for a in cases(sc).assumptions)


def _ctx(sc: dict, index: int = 0) -> systems.CaseContext:
    read = cases(sc)
    return systems.CaseContext(read.cases[index], read.hardware, read.scenario, read.assumptions)


def _system_step(sc: dict, system_id: str, index: int = 0) -> systems.Priced:
    ctx = _ctx(sc, index)
    system = next(s for s in sc["systems"] if s["id"] == system_id)
    return min((systems.price(p, ctx) for p in system_plans(system, ctx)), key=lambda p: p.step_s)


def test_locmoe_batch_note_sets_tokens_per_device():
    sc = _load("locmoe_locality")
    read = cases(sc)
    assert [c.tokens for c in read.cases] == [32 * 1024 // 128] * 3  # weak scaling: the same per device
    assert any("batch 32 at 128 devices" in a and "256 tokens per device" in a for a in read.assumptions)
    bigger = copy.deepcopy(sc)
    bigger["batch"]["note"] = "batch 64 at 128 devices"
    assert cases(bigger).cases[0].tokens == 2 * read.cases[0].tokens
    # twice the tokens: twice the expert compute and the all-to-all bytes; the step longer (at 256 tokens per device
    # it is mostly the dense gradients' all-reduce, which the batch does not change)
    slow, fast = _system_step(bigger, "locmoe"), _system_step(sc, "locmoe")
    assert slow.breakdown["expert_compute"] / fast.breakdown["expert_compute"] == pytest.approx(2.0, rel=0.05)
    assert slow.breakdown["token_a2a_bytes"] / fast.breakdown["token_a2a_bytes"] == pytest.approx(2.0, rel=0.05)
    assert slow.step_s > fast.step_s


def test_locmoe_model_parallel_is_stated_not_modelled():
    stated = "\n".join(cases(_load("locmoe_locality")).assumptions)
    assert "field models[].model_parallel not modelled: tensor parallelism inside the experts" in stated


def test_lina_placement_spread_crosses_nodes_and_slows_the_exchange():
    sc = _load("lina_priority")
    packed = cases(sc)
    assert [(c.nodes, c.per_node) for c in packed.cases[:4]] == [(1, 2), (1, 4), (2, 4), (4, 4)]
    assert any(a.startswith("cluster.placement_note ") for a in packed.assumptions)
    spread = copy.deepcopy(sc)
    spread["cluster"]["placement"] = "spread"
    assert [(c.nodes, c.per_node) for c in cases(spread).cases[:4]] == [(2, 1), (4, 1), (4, 2), (4, 4)]
    # E=4: one node (NVLink preset) vs four nodes over the 12.5 GB/s InfiniBand: the exchange slows, the step too
    a, b = _system_step(sc, "deepspeed-moe", 1), _system_step(spread, "deepspeed-moe", 1)
    assert b.step_s > a.step_s and b.breakdown["exposed_a2a"] > a.breakdown["exposed_a2a"]
    bad = copy.deepcopy(spread)
    bad["cluster"]["nodes"] = 3
    with pytest.raises(ValueError, match="placement='spread': 2 devices do not spread evenly over 2|3 nodes"):
        cases(bad)


def test_adaptive_softmax_shrinks_the_dense_gradients():
    sc = _load("lina_priority")
    xl = cases(sc).cases[0]
    D = 1024
    # Transformer-XL's WikiText-103 adaptive embedding: clusters of 20000, 20000, 160000, 67735 tokens at widths
    # D, D/4, D/16, D/64, each but the first projected to D
    expected = 20000 * D + 20000 * 256 + 160000 * 64 + 67735 * 16 + D * (256 + 64 + 16)
    assert xl.embedding_params == expected and expected < 267735 * D / 7
    full = copy.deepcopy(sc)
    del full["models"][0]["vocab_note"]
    full_case = cases(full).cases[0]
    assert full_case.embedding_params == 267735 * D
    # the smaller embedding: fewer gradient bytes all-reduced (W=16, four nodes over InfiniBand): less other comm
    a, b = _system_step(sc, "deepspeed-moe", 3), _system_step(full, "deepspeed-moe", 3)
    assert a.breakdown["exposed_other"] < b.breakdown["exposed_other"] and a.step_s < b.step_s
    given = copy.deepcopy(sc)
    given["models"][0]["adaptive_softmax"] = {"cutoffs": [20000], "div_val": 2}
    assert cases(given).cases[0].embedding_params == 20000 * D + 247735 * 512 + D * 512
    given["models"][0]["adaptive_softmax"] = {"cutoffs": [300000]}
    with pytest.raises(ValueError, match="adaptive_softmax.cutoffs=\\[300000\\]"):
        cases(given)


def test_inter_node_link_per_node_divides_the_figure_and_slows_the_step():
    sc = _load("laer_moe_fsep")
    read = cases(sc)
    assert float(read.hardware.inter_bw) == 88.95e9
    assert any("88.95 GB/s is 89% of the named inter-node link" in a for a in read.assumptions)
    per_node = copy.deepcopy(sc)
    per_node["cluster"]["inter_node_bw_per"] = "node"
    node = cases(per_node)
    assert float(node.hardware.inter_bw) == pytest.approx(88.95e9 / 8)
    assert not any("of the named inter-node link" in a for a in node.assumptions)
    a, b = _system_step(sc, "laer-moe"), _system_step(per_node, "laer-moe")
    assert b.step_s > a.step_s
    per_node["cluster"]["inter_node_bw_per"] = "rack"
    with pytest.raises(ValueError, match="cluster.inter_node_bw_per='rack'"):
        cases(per_node)


def test_refused_fields_name_themselves():
    sc = _load("mh_latentmoe_hp")
    sc["models"][1]["experts_per_head"] = 4
    with pytest.raises(ValueError, match="experts_per_head=4"):
        cases(sc)
    sc = _load("laer_moe_fsep")
    sc["batch"]["dropless"] = False
    with pytest.raises(ValueError, match="batch.dropless=false"):
        cases(sc)


def test_read_fields_are_documented():
    assert all(isinstance(v, str) and v for v in READ_FIELDS.values())
    assert not set(READ_FIELDS) & set(NOT_MODELLED)
    assert scenarios.ADAPTIVE_CUTOFFS == (20000, 40000, 200000)


def _mutated(value):
    """A different value of the same kind: a flipped flag, a doubled number, an emptied text or list, a shorter
    list."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2
    if isinstance(value, str):
        return ""
    if isinstance(value, list):
        return value[:-1]
    raise TypeError(value)


def _set(sc: dict, path: str, change) -> dict:
    """`sc` with the field at `path` ("models[].id") changed by `change` in every entry that holds it."""
    out = copy.deepcopy(sc)
    parts = path.replace("[]", "").split(".")
    if parts[0] == "models" and "models" not in out:
        parts[0] = "model"

    def visit(node, keys):
        if isinstance(node, list):
            for item in node:
                visit(item, keys)
            return
        if len(keys) == 1:
            if keys[0] in node:
                node[keys[0]] = change(node[keys[0]])
            return
        if keys[0] in node:
            visit(node[keys[0]], keys[1:])

    visit(out, parts)
    return out


def _fingerprint(sc: dict):
    """What the model reads from a set-up before pricing: its cases, hardware, fills and statements, every system's
    plans on every case, the routing over steps each router sees; or the error it refuses the set-up with."""
    try:
        read = cases(sc)
        out = [repr(read.cases), repr(read.hardware), read.filled]
        for case in read.cases:
            ctx = systems.CaseContext(case, read.hardware, read.scenario, read.assumptions)
            out.append([repr(system_plans(s, ctx)) for s in sc.get("systems") or [] if s.get("form") != "hp"])
            out.append([ctx.trace(r).steps_aWE.round(6).tolist() for r in ("learned", "switch", "hash")])
        out.append(read.assumptions)
        return out
    except (KeyError, ValueError, TypeError) as err:
        return f"refused: {type(err).__name__} {err}"


# (set-up, field): a field the model reads only in some configurations, and when
CONDITIONAL = {
    ("lina_priority", "cluster.nodes"): "devices_equal_experts sizes each run: nodes is read with cluster.placement "
                                        "= 'spread' (test_lina_placement_spread_crosses_nodes_and_slows_the_exchange)",
    ("lina_priority", "systems[].note"): "DeepSpeed-MoE's note describes the default schedule (fair share, DDP "
                                         "buckets): no figure in it, stated on loading",
    ("locmoe_locality", "models[].expert_parallel"): "16 is also the degree the model picks unasked (the largest "
                                                     "divisor of W and E): the changed figure must divide E",
}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_read_field_moves_what_the_model_reads(path):
    """Each field READ_FIELDS claims, changed in the file, changes what the model reads (or is refused with a
    message): none is listed as read and then ignored. Null figures are filled and reported (`filled`,
    assumptions), `name` is only the report's title."""
    sc = json.loads(path.read_text())
    base = _fingerprint(sc)
    ignored = []
    for field in field_paths(sc):
        if field not in READ_FIELDS or field == "name" or (path.stem, field) in CONDITIONAL:
            continue
        values = []
        _set(sc, field, lambda v: values.append(v) or v)
        if all(v is None for v in values):
            continue
        if _fingerprint(_set(sc, field, lambda v: v if v is None else _mutated(v))) == base:
            ignored.append(field)
    assert not ignored, f"{path.name}: fields READ_FIELDS lists that change nothing when changed: {ignored}"
