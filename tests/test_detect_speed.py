"""Detection's work on large models, counted (never timed): copies of the expert weights, walks of the
module tree, garbage collections; and that the shortcuts read exactly what torch's own walks read."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import moepass
from moepass import canonical
from moepass.detect.candidates import SELF_DESCRIBED, ModuleTree, capture_candidate, find_candidates
from moepass.detect.check import probe_copy, semantic_check
from moepass.detect.loop_experts import recognise
from samples.models import LoopMoE, SampleConfig, TinyMoELM

E = 4


def _count_stacks(monkeypatch) -> list[tuple[int, ...]]:
    """Patch torch.stack to record the shape of each list of E expert weights it stacks."""
    calls: list[tuple[int, ...]] = []
    stack = torch.stack

    def counting(tensors, *args, **kwargs):
        if isinstance(tensors, (list, tuple)) and len(tensors) == E and all(t.dim() == 2 for t in tensors):
            calls.append(tuple(tensors[0].shape))
        return stack(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "stack", counting)
    return calls


def test_the_check_lays_out_each_expert_role_once(monkeypatch):
    """The probe copy holds each role's E weights in one buffer: the canonical graph reads them as views in
    every run (3 probes, the train-mode run), where stacking them per run made 4 copies of each role."""
    block, hypotheses = _loop_block()
    stacks = _count_stacks(monkeypatch)
    winner, tried = semantic_check(block, hypotheses)
    assert winner is not None and winner.contract_checked and winner.compared_tokens > 0
    assert stacks == [(32, 16), (32, 16), (16, 32)]  # w1, w3, w2: laid out once each, never stacked again


def _loop_block(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    block = LoopMoE(16, 32, E, 2).to(dtype)
    (c,) = find_candidates(block)
    assert capture_candidate(c) is None
    hypotheses = recognise(c)
    assert not isinstance(hypotheses, str)
    return block, hypotheses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_laid_out_probe_holds_what_a_plain_probe_holds(dtype):
    """Same values (the all-zero tensors randomised alike), the stacked roles adjacent in one buffer each (in
    bf16 laid out again after `.float()`), and the user's block untouched."""
    block, hypotheses = _loop_block(dtype)
    block.experts[1].w2.weight.data.zero_()  # randomised on both probes, from the same generator
    before = {k: v.clone() for k, v in block.state_dict().items()}
    plain, laid_out = probe_copy(block, 0), probe_copy(block, 0, spec=hypotheses[0])
    assert plain.state_dict().keys() == laid_out.state_dict().keys()
    assert all(torch.equal(v, laid_out.state_dict()[k]) for k, v in plain.state_dict().items())
    assert plain.experts[1].w2.weight.any() and laid_out.gate.weight.dtype == torch.float32
    groups = canonical.stacked_parameters(laid_out, hypotheses[0])
    assert len(groups) == 3 and all(canonical.adjacent_view(g) is not None for g in groups)
    assert all(canonical.adjacent_view(g) is None for g in canonical.stacked_parameters(plain, hypotheses[0]))
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def _count_walks(monkeypatch) -> dict[str, int]:
    """Count the top-level calls of nn.Module.named_modules / named_parameters (not their recursion)."""
    counts = {"named_modules": 0, "named_parameters": 0}
    named_modules, named_parameters = nn.Module.named_modules, nn.Module.named_parameters

    def walk_modules(self, memo=None, prefix="", remove_duplicate=True):
        counts["named_modules"] += memo is None
        return named_modules(self, memo, prefix, remove_duplicate)

    def walk_parameters(self, *args, **kwargs):
        counts["named_parameters"] += 1
        return named_parameters(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", walk_modules)
    monkeypatch.setattr(nn.Module, "named_parameters", walk_parameters)
    return counts


def test_candidates_read_the_module_tree_once(monkeypatch):
    torch.manual_seed(0)
    model = TinyMoELM(SampleConfig(dim=32, ffn_dim=64, num_experts=E, top_k=2, layers=4, style="loop"))
    counts = _count_walks(monkeypatch)
    tree = ModuleTree(model)
    assert counts == {"named_modules": 1, "named_parameters": 0} and tree.plain
    candidates = find_candidates(model, tree)
    assert [c.path for c in candidates] == [f"layers.{i}.mlp" for i in range(4)]
    # no parameter walk at all; named_modules only for `modules()` of the first entry of each ModuleList (the
    # decoder layers and the four expert lists: its linears) and of each group's first expert (its widths)
    assert counts == {"named_modules": 1 + 5 + 4, "named_parameters": 0}


class _Shared(nn.Module):
    """Modules and parameters reachable twice (not a tree): the table must fall back to torch's walks."""

    def __init__(self, kind: str):
        super().__init__()
        self.moe = LoopMoE(16, 32, E, 2)
        if kind == "module":
            self.moe.experts[2] = self.moe.experts[1]
        elif kind == "parameter":
            self.moe.experts[3].w1.weight = self.moe.experts[0].w1.weight
        elif kind == "activation":
            act = nn.SiLU()
            for expert in self.moe.experts:
                expert.act = act
        elif kind == "router":
            self.alias = self.moe.gate
        elif kind == "alias":  # one parameter under two names of one module
            self.moe.gate.register_parameter("alias", self.moe.gate.weight)


@pytest.mark.parametrize("kind", ["tree", "module", "parameter", "activation", "router", "alias"])
def test_module_tree_reads_what_torch_walks_read(kind):
    torch.manual_seed(0)
    model = _Shared(kind) if kind != "tree" else TinyMoELM(SampleConfig(dim=16, ffn_dim=32, num_experts=E, layers=2))
    tree = ModuleTree(model)
    assert tree.modules == dict(model.named_modules())
    assert tree.plain == (kind in ("tree", "alias"))  # an alias inside one module: its table keeps the first name
    holders = [p for p, m in tree.modules.items() if isinstance(m, nn.ModuleList)]
    ids = {id(tree.modules[p]) for p in holders}
    holds = tree.holds(holders)
    for path, module in tree.modules.items():
        ours = [(name, id(p)) for name, p in tree.named_parameters(path)]
        assert ours == [(name, id(p)) for name, p in module.named_parameters(prefix=path)], path
        assert holds(path, module) == any(id(m) in ids for m in module.modules()), path


def test_self_description_is_read_as_getattr_reads_it():
    class Described(nn.Module):
        def moepass_spec(self, path):
            raise NotImplementedError

    class Dynamic(nn.Module):
        def __getattr__(self, name):
            return (lambda path: None) if name == "moepass_spec" else super().__getattr__(name)

    model = nn.Module()
    model.plain = nn.Linear(2, 2)
    model.described = Described()
    model.named_like_it = nn.Module()
    model.named_like_it.moepass_spec = nn.Linear(2, 2)  # a child module: callable, so it says it is a block
    model.assigned = nn.Module()
    model.assigned.__dict__["moepass_spec"] = lambda path: None
    model.dynamic = Dynamic()
    found = [c.path for c in find_candidates(model) if c.experts_kind == SELF_DESCRIBED]
    expected = [p for p, m in model.named_modules() if callable(getattr(m, "moepass_spec", None))]
    assert found == expected == ["described", "named_like_it", "assigned", "dynamic"]


def test_detection_pauses_the_garbage_collector(monkeypatch):
    """The module walks allocate enough containers to trigger collections (a full one traverses every object
    of the process); inside `detect` none runs, and the collector is enabled again after it."""
    import importlib

    detect_package = importlib.import_module("moepass.detect")  # `moepass.detect` is also the function
    torch.manual_seed(0)
    model = TinyMoELM(SampleConfig(dim=32, ffn_dim=64, num_experts=E, top_k=2, layers=4, style="mixed"))
    collections: list[int] = []
    during: list[int] = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def walked(model, tree=None, blocks=None):  # the collections its walk of the module tree triggers
        before = len(collections)
        found = find_candidates(model, tree, blocks)
        during.append(len(collections) - before)
        return found

    thresholds = gc.get_threshold()
    gc.set_threshold(10)  # a generation-0 collection every 10 net allocations: the walk is sure to trigger some
    gc.callbacks.append(seen)
    try:
        assert gc.isenabled()
        walked(model)
        assert during[0] > 0  # outside detection the same walk collects
        monkeypatch.setattr(detect_package, "find_candidates", walked)
        report = moepass.detect(model)
        assert during[1:] == [0] and gc.isenabled() and len(report.blocks) == 4
        gc.disable()
        moepass.detect(model)
        assert not gc.isenabled()  # a collector the caller paused stays paused
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(seen)
