"""The one pipeline (moepass/pipeline.py): model stages and block stages, each recorded with its time."""

from __future__ import annotations

import torch

import moepass
from moepass import Plan
from moepass.canonical import CANONICAL_PASS
from moepass.passes import Effects, apply_effects


def _model() -> torch.nn.Module:
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    return tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32, style="loop")


def test_compile_records_every_model_stage_in_order_with_its_time():
    cm = moepass.compile(_model(), Plan(form="single", deterministic=True))
    stages = cm.moepass_info.stages
    assert [s["pass"] for s in stages] == ["copy", "blocks", "finalize", "grad_sync", "optimizer", "determinism"]
    assert all(s["seconds"] >= 0 for s in stages)
    assert stages[1]["stats"] == {"rewritten": 2, "skipped": 0}
    assert [s["stats"]["installed"] for s in stages[3:]] == [False, False, True]  # one process, plain tensors


def test_every_block_stage_has_its_measured_time():
    cm = moepass.compile(_model(), Plan(form="single"))
    for gm in cm.moepass_info.rewritten.values():
        names = [record["pass"] for record in gm.history]
        assert names[0] == CANONICAL_PASS and "rewrite:single" in names
        assert all(record["seconds"] > 0 for record in gm.history)  # none written by hand as 0 s


def test_relaid_parameters_keep_their_object_name_and_value():
    """form='single' re-lays per-expert (ModuleList) weights into one buffer per role as a declared effect
    (`Effects.relaid`): the same Parameter objects, names and values, in the new storage."""
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.experts = torch.nn.ModuleList(torch.nn.Linear(4, 3, bias=False) for _ in range(2))
    params = [e.weight for e in gm.experts]
    buffer = torch.stack([p.detach() for p in params])  # one [E, 3, 4] buffer
    assert not Effects() and Effects(relaid={"experts.0.weight": buffer[0]})
    apply_effects(gm, Effects(relaid={f"experts.{e}.weight": buffer[e] for e in range(2)}))
    for e, p in enumerate(params):
        assert gm.get_parameter(f"experts.{e}.weight") is p
        assert p.data_ptr() == buffer[e].data_ptr() and torch.equal(p, buffer[e])


def test_ep_like_forms_declare_form_and_layout_as_effects():
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.form, gm.layout = "single", None
    apply_effects(gm, Effects(form="ep", layout="a layout"))
    assert (gm.form, gm.layout) == ("ep", "a layout")
