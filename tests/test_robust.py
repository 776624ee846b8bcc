"""Models detection and compile must survive (issues 27 and 29): a block holding a process group (copies
share it), recognisers and searches that raise (a rejection reason, never an exception), meta-device models
(detected on a materialised probe; compiled, then `to_empty` + the model's own init), and blocks a
distributed plan leaves un-rewritten (a warning naming each; `Plan(strict=True)`: an error).

The process group is the in-process "fake" one (no communication, no spawned ranks)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import moepass
from moepass import Plan, PlanError
from moepass.canonical import adjacent_view
from moepass.detect.check import probe_copy
from samples.models import LoopMoE, tiny_mixtral

RTOL, ATOL = 1e-5, 1e-6  # the fp32 parity tolerances (tests/test_compile_parity.py)
SMALL = dict(dim=32, ffn_dim=32, vocab_size=32, num_experts=4, heads=2)
detection = importlib.import_module("moepass.detect")  # the package (`moepass.detect` is also the function)


@contextlib.contextmanager
def fake_world(size: int = 2):
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class SquashedMoE(LoopMoE):
    """A near-miss of LoopMoE (its output squashed by tanh): MoE-like, rejected by the semantic check."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(hidden_states))


def with_rejected_block() -> torch.nn.Module:
    """A two-layer sample LM whose second MoE block detection rejects (layers.1.mlp)."""
    torch.manual_seed(0)
    model = tiny_mixtral(**SMALL)
    model.layers[1].mlp = SquashedMoE(SMALL["dim"], SMALL["ffn_dim"], SMALL["num_experts"], 2)
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same_training(a: torch.nn.Module, b: torch.nn.Module, tokens: torch.Tensor, exact: bool = False) -> None:
    """Same outputs, loss and every gradient (parameter by parameter name): bitwise with `exact`, else within
    the fp32 parity tolerances."""
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(a(tokens[:, :-1]), b(tokens[:, :-1]), **tol)
    la, lb = a.loss(tokens), b.loss(tokens)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, **tol)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, pb[name].grad, **tol, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------------------------
# Process groups: shared, never copied.
# ----------------------------------------------------------------------------------------------


def test_block_holding_a_process_group_is_detected_and_compiled_exactly():
    """The group held by the model, its layers and its MoE blocks: both blocks are accepted, the probe and the
    compiled copy hold the very group object, and the single form trains as the original (outputs, loss,
    every gradient)."""
    with fake_world(2) as group:
        torch.manual_seed(0)
        model = tiny_mixtral(**SMALL)
        model.group = group
        for layer in model.layers:
            layer.group = layer.mlp.group = group
        report = moepass.detect(model)
        assert [d.accepted for d in report.details] == [True, True], report.summary()
        assert probe_copy(model.layers[0].mlp).group is group
        cm = moepass.compile(model, Plan(form="single"))
        assert sorted(cm.moepass_info.rewritten) == ["layers.0.mlp", "layers.1.mlp"]
        assert cm.group is group and all(layer.group is group for layer in cm.layers)
        assert cm.layers[0] is not model.layers[0]
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
        assert_same_training(cm, model, tokens)


# ----------------------------------------------------------------------------------------------
# Never raise: a failing recogniser, candidate search, dense search or structural key.
# ----------------------------------------------------------------------------------------------


def test_a_raising_recogniser_becomes_its_rejection_reason(monkeypatch):
    def boom(candidate):
        raise RuntimeError("boom in the rule")

    monkeypatch.setattr(detection, "RECOGNISERS", [("raising-rule", boom), *detection.RECOGNISERS])
    model = with_rejected_block()
    report = moepass.detect(model)
    first, second = report.details
    assert first.accepted  # the rules after the raising one still run
    assert not second.accepted
    assert "raising-rule: the recogniser raised RuntimeError: boom in the rule" in second.reason
    assert "raising-rule" in moepass.explain(model, Plan(), graphs=False)


@pytest.mark.parametrize("target,note", [("find_candidates", "the module tree could not be read for candidates"),
                                         ("find_dense_mlps", "the dense-FFN search failed"),
                                         ("structural_key", None)])
def test_a_failing_search_never_propagates(monkeypatch, target, note):
    def fails(*args, **kwargs):
        raise TypeError(f"{target} failed here")

    monkeypatch.setattr(detection, target, fails)
    model = tiny_mixtral(**SMALL)
    report = moepass.detect(model)
    if note is None:  # no key: every block is checked on its own
        assert [d.same_as for d in report.details] == [None, None] and len(report) == 2
    else:
        assert any(n.startswith(note) and f"TypeError: {target} failed here" in n for n in report.notes)
        assert f"note: {note}" in report.summary()
    assert "detection failed" not in moepass.explain(model, Plan(), graphs=False)


def test_a_block_whose_detection_fails_is_rejected_with_the_exception(monkeypatch):
    def fails(candidate, seed=0):
        raise KeyError("no such node")

    monkeypatch.setattr(detection, "capture_candidate", fails)
    report = moepass.detect(tiny_mixtral(**SMALL))
    assert len(report) == 0 and len(report.rejected) == 2
    assert all(reason == "detection failed on this block: KeyError: 'no such node'" for _, reason in report.rejected)


# ----------------------------------------------------------------------------------------------
# Meta-device models.
# ----------------------------------------------------------------------------------------------


def init_weights(model: torch.nn.Module) -> None:
    """The sample model's own initialisation, as after `to_empty`: every module's `reset_parameters`."""
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def test_meta_model_is_detected_and_explained_without_touching_it():
    with torch.device("meta"):
        model = tiny_mixtral(**SMALL)
    params = dict(model.named_parameters())
    report = moepass.detect(model)
    assert [d.accepted for d in report.details] == [True, True], report.summary()
    assert report.details[0].spec == moepass.detect(tiny_mixtral(**SMALL)).details[0].spec
    text = moepass.explain(model, Plan(), graphs=False)
    assert "== layers.0.mlp (LoopMoE) ==" in text and "fail" not in text
    assert dict(model.named_parameters()) == params and all(p.is_meta for p in model.parameters())


def test_meta_model_compiled_then_materialised_trains_as_a_materialised_model_compiled():
    """compile on meta, `to_empty(device="cpu")`, the model's own init == the same init on a CPU model,
    compiled: same loss and every gradient, bitwise; the experts laid out in one buffer per role again."""
    with torch.device("meta"):
        meta = tiny_mixtral(**SMALL)
    cm = moepass.compile(meta, Plan(form="single")).to_empty(device="cpu")
    init_weights(cm)
    real = tiny_mixtral(**SMALL).to_empty(device="cpu")
    init_weights(real)
    cr = moepass.compile(real, Plan(form="single"))
    experts = cm.layers[0].mlp.experts
    assert adjacent_view([e.w1.weight for e in experts]) is not None  # one [E, F, D] view, no stack per step
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    assert_same_training(cm, cr, tokens, exact=True)


def test_meta_model_under_a_distributed_form_is_refused_naming_the_fix():
    """EP replaces the experts by its own stacked tensors: a meta model's init would not reach them after
    to_empty, so compile refuses (before copying anything) and says what to do."""
    with torch.device("meta"):
        meta = tiny_mixtral(**SMALL)
    with fake_world(2), pytest.raises(PlanError, match=r"Plan\(form='ep'\) for block 'layers.0.mlp': the block is "
                                                       r"on the meta device .* Materialise the model first .*"
                                                       r"form='single' compiles a meta model"):
        moepass.compile(meta, Plan(form="ep"))


# ----------------------------------------------------------------------------------------------
# Nothing silent: blocks a distributed plan leaves as they are.
# ----------------------------------------------------------------------------------------------


def test_rejected_block_under_ep_warns_naming_it_and_logs_the_counts(caplog):
    model = with_rejected_block()
    with fake_world(2), caplog.at_level(logging.INFO, logger="moepass"):
        with pytest.warns(UserWarning, match=r"left 1 MoE-like block\(s\) un-rewritten, rejected by detection: "
                                             r"'layers.1.mlp' \(form='ep'\): .*no hypothesis reproduces the block.*"
                                             r"Plan\(strict=True\)"):
            cm = moepass.compile(model, Plan(form="ep"))
        explained = moepass.explain(model, Plan(form="ep"), graphs=False)
    assert "compile would warn: moepass.compile left 1 MoE-like block(s) un-rewritten" in explained
    assert list(cm.moepass_info.rewritten) == ["layers.0.mlp"]
    assert "form=ep: 1 MoE block(s) rewritten, 1 rejected by detection (not rewritten), 0 left alone" in caplog.text


def test_strict_raises_naming_the_block_its_reason_and_the_way_out():
    model = with_rejected_block()
    before = state(model)
    with fake_world(2), pytest.raises(PlanError, match=r"'layers.1.mlp' \(form='ep'\): .*no hypothesis reproduces "
                                                       r".*Plan\(blocks=\{'layers.1.mlp': None\}\), or pass "
                                                       r"strict=False"):
        moepass.compile(model, Plan(form="ep", strict=True))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "compile would raise PlanError (Plan.strict=True)" in moepass.explain(model, Plan(strict=True),
                                                                                  graphs=False)


def test_a_block_left_alone_on_purpose_and_the_single_form_are_quiet():
    """Plan.blocks={path: None} leaves a block alone on purpose: no warning, and strict accepts it. Under
    form="single" an un-rewritten block trains as it is on one device (its own code, nothing sharded): no
    warning (the INFO line and `explain` say it); strict still refuses it."""
    model = with_rejected_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fake_world(2):
            moepass.compile(model, Plan(form="ep", strict=True, blocks={"layers.1.mlp": None}))
        moepass.compile(model, Plan(form="single"))
    with pytest.raises(PlanError, match="'layers.1.mlp' \\(form='single'\\)"):
        moepass.compile(model, Plan(form="single", strict=True))
