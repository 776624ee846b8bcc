"""`moepass.compile` copies the expert weights once (issue 17's compile time).

compile works on a deep copy unless inplace=True, and form="single" lays each role's per-expert parameters
(ModuleList experts) into one contiguous buffer (`canonical.relayout_stacked`). The copy builds those
buffers straight from the original parameters and hands them to `copy.deepcopy` through its memo, so the
expert weights are copied once, not cloned and then re-laid. These tests count the bytes every copying
aten op writes during compile (a TorchDispatchMode), and check that the result is exactly what the old
way (deep copy, then compile in place) made: names, values, requires_grad, hooks, outputs and gradients.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import moepass
from moepass import canonical
from samples.models import SampleConfig, TinyMoELM

COPY_OPS = {torch.ops.aten.clone.default, torch.ops.aten.cat.default, torch.ops.aten.stack.default,
            torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.cat.out,
            torch.ops.aten.stack.out}
E, LAYERS = 4, 2


class CopiedBytes(TorchDispatchMode):
    """Counts the bytes written by every aten op that copies real tensor data."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPY_OPS and not isinstance(out, FakeTensor):  # the verifier's fake runs copy no data
            self.ops.append(str(func))
            self.bytes += out.numel() * out.element_size()
        return out


def make_model() -> TinyMoELM:
    torch.manual_seed(0)
    return TinyMoELM(SampleConfig(style="loop", layers=LAYERS, num_experts=E))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_groups(model: torch.nn.Module, report: moepass.DetectionReport) -> list[list[torch.nn.Parameter]]:
    """Each block's stacked roles: E per-expert parameters each, taken from `model` by the report's paths."""
    return [group for spec in report.blocks
            for group in canonical.stacked_parameters(model.get_submodule(spec.path), spec)]


def storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def compile_counting(model, **kwargs):
    report = moepass.detect(model)
    with CopiedBytes() as counter:
        compiled = moepass.compile(model, moepass.Plan(form="single"), report=report, **kwargs)
    return compiled, report, counter


def test_expert_weights_copied_once_and_original_untouched():
    model = make_model()
    model.layers[0].mlp.experts[1].w3.weight.requires_grad_(False)  # kept as it is by the copy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    compiled, report, counter = compile_counting(model)

    # one copy of every tensor of the model: the expert weights into their buffers, the rest by deepcopy
    assert counter.bytes == nbytes(model.parameters()) + nbytes(model.buffers())
    groups = expert_groups(model, report)
    assert len(groups) == 3 * LAYERS and all(len(g) == E for g in groups)
    assert counter.ops.count(str(torch.ops.aten.stack.default)) == len(groups)  # one stack per role

    # the original: same objects at the same addresses, bitwise the same values, no MoEGraphModule
    assert {name: (p, p.data_ptr()) for name, p in model.named_parameters()} == params_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, moepass.MoEGraphModule) for m in model.modules())
    assert storages(compiled).isdisjoint(storages(model))  # nothing aliased

    # the compiled model: every role's E parameters are consecutive views of one buffer of exactly E of them
    for group in expert_groups(compiled, report):
        assert canonical.adjacent_view(group) is not None
        assert len({p.untyped_storage().data_ptr() for p in group}) == 1
        assert group[0].untyped_storage().nbytes() == nbytes(group)
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert all(torch.equal(v, before[k]) for k, v in compiled.state_dict().items())
    assert not compiled.layers[0].mlp.experts[1].w3.weight.requires_grad
    assert sum(p.requires_grad for p in compiled.parameters()) == sum(p.requires_grad for p in model.parameters())


def test_same_model_as_deepcopy_then_inplace():
    """The copy-once path makes what `compile(copy.deepcopy(model), inplace=True)` makes: parameter names,
    types, values, requires_grad, the modules' hooks, outputs and every gradient of a training step."""
    model = make_model()
    calls: list[str] = []
    model.norm.register_forward_hook(lambda m, args, out: calls.append("norm"))
    model.layers[0].mlp.experts[2].register_forward_pre_hook(lambda m, args: None)
    compiled = moepass.compile(model, moepass.Plan(form="single"))
    reference = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single"), inplace=True)

    ours, theirs = dict(compiled.named_parameters()), dict(reference.named_parameters())
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert type(ours[name]) is type(p) and ours[name].requires_grad == p.requires_grad, name
        assert torch.equal(ours[name], p), name
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in reference.named_modules()}
    assert {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in compiled.named_modules()} == hooks
    assert hooks["layers.0.mlp.experts.2"] == (0, 1)

    tokens = torch.randint(0, 256, (2, 9))
    calls.clear()
    loss, loss_ref = compiled.loss(tokens), model.loss(tokens)
    assert calls == ["norm", "norm"]  # the copy keeps the hook (and the original its own)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    grads = dict(compiled.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_inplace_copies_experts_once_or_not_at_all():
    """inplace=True: the one relayout (each role's expert weights stacked once), then nothing when the
    parameters already lie one after another in one buffer."""
    model = make_model()
    report = moepass.detect(model)
    expert_bytes = nbytes(p for group in expert_groups(model, report) for p in group)
    compiled, _, counter = compile_counting(model, inplace=True)
    assert compiled is model and counter.bytes == expert_bytes

    adjacent = make_model()
    for spec in moepass.detect(adjacent).blocks:  # the layout compile makes, made beforehand
        canonical.relayout_stacked(adjacent.get_submodule(spec.path), spec)
    _, _, counter = compile_counting(adjacent, inplace=True)
    assert counter.bytes == 0


def test_blocks_left_alone_are_deep_copied():
    """A block that Plan.blocks leaves alone keeps its per-expert tensors apart (deepcopy's own clones);
    a tied expert weight is copied once and stays tied."""
    model = make_model()
    experts = model.layers[1].mlp.experts
    experts[1].w2.weight = experts[0].w2.weight  # tied: stacked_copies leaves this role to deepcopy
    report = moepass.detect(model)
    plan = moepass.Plan(form="single", blocks={"layers.0.mlp": None})
    compiled = moepass.compile(model, plan, report=report)
    assert "layers.0.mlp" in compiled.moepass_info.skipped
    left = compiled.layers[0].mlp.experts
    assert len({e.w1.weight.untyped_storage().data_ptr() for e in left}) == E
    copied = compiled.layers[1].mlp.experts
    assert copied[1].w2.weight is copied[0].w2.weight and copied[0].w2.weight is not experts[0].w2.weight
    assert storages(compiled).isdisjoint(storages(model))


def test_ep_copies_only_the_local_shard():
    """Under EP the copy adopts aliases of the expert weights (the rewrite keeps only this rank's shard, which
    it copies): compile writes the non-expert tensors once and the local experts once, not all E experts and
    then the shard again; the result shares no memory with the original (fake process group, W=2, rank 1)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import reset_groups

    model = make_model()
    report = moepass.detect(model)
    expert_params = [p for group in expert_groups(model, report) for p in group]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        with CopiedBytes() as counter:
            compiled = moepass.compile(model, moepass.Plan(form="ep"), report=report)
        others = nbytes(model.parameters()) + nbytes(model.buffers()) - nbytes(expert_params)
        assert counter.bytes == others + nbytes(expert_params) // 2
        assert counter.ops.count(str(torch.ops.aten.stack.default)) == len(expert_groups(model, report))
        local = [p.to_local() for p in compiled.parameters() if isinstance(p, DTensor)]
        assert nbytes(local) == nbytes(expert_params) // 2
        plain = {p.untyped_storage().data_ptr() for p in compiled.parameters() if not isinstance(p, DTensor)}
        assert plain.isdisjoint(storages(model)) and {t.untyped_storage().data_ptr() for t in local}.isdisjoint(
            storages(model))
        w1 = compiled.layers[0].mlp.ep_w_gate  # experts 2 and 3 of the first block's w1 (rank 1 of 2)
        experts = model.layers[0].mlp.experts
        assert torch.equal(w1.to_local(), torch.stack([experts[2].w1.weight, experts[3].w1.weight]))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()
        reset_groups()


def test_aliases_the_rewrite_keeps_are_unshared():
    """`alias_in_memo` aliases only a plain Parameter alone in its whole storage; `unshare` gives the copy its
    own storage for every alias it still holds, keeping the Parameter object and the values."""
    from moepass.module_copy import alias_in_memo, deepcopy_module, storage_counts, unshare

    model = make_model()
    experts = model.layers[0].mlp.experts
    experts[1].w2.weight = experts[0].w2.weight  # tied: two entries, one storage
    view_base = torch.randn(2, *experts[2].w3.weight.shape)
    experts[2].w3.weight = torch.nn.Parameter(view_base[0])  # half of its storage
    candidates = [experts[0].w1.weight, experts[1].w1.weight, experts[0].w2.weight, experts[2].w3.weight]
    memo: dict = {}
    assert alias_in_memo(candidates, memo, storage_counts(model)) == 2  # the two w1, not tied w2 nor w3 view
    copied = deepcopy_module(model, memo)
    aliased = copied.layers[0].mlp.experts[0].w1.weight
    assert aliased.data_ptr() == experts[0].w1.weight.data_ptr() and aliased is not experts[0].w1.weight
    assert unshare(copied, model) == 2
    assert storages(copied).isdisjoint(storages(model))
    assert copied.layers[0].mlp.experts[0].w1.weight is aliased and torch.equal(aliased, experts[0].w1.weight)
    assert unshare(copied, model) == 0


def test_torch_save_and_load_round_trip_every_sample_style():
    """A saved compiled model loads back (unpickling re-traces each graph's code: the helpers with Python control
    flow on sizes, `moepass.operands.graph_leaf`, stay one call each) and computes what it computed."""
    import io

    for style in ("gshard", "fused", "loop", "mixed"):
        torch.manual_seed(0)
        model = TinyMoELM(SampleConfig(style=style, layers=2))
        cm = moepass.compile(model, moepass.Plan(form="single", keep_original_if_slower=False))
        buffer = io.BytesIO()
        torch.save(cm, buffer)
        buffer.seek(0)
        again = torch.load(buffer, weights_only=False)
        tokens = torch.randint(0, 32, (2, 9))
        torch.testing.assert_close(again(tokens), cm(tokens), rtol=0, atol=0, msg=lambda m, s=style: f"{s}: {m}")
        assert list(again.moepass_info.rewritten) == list(cm.moepass_info.rewritten), style
        if style == "gshard":  # the capacity is still computed per call from the sizes, not a traced constant
            graph = again.get_submodule("layers.0.mlp").graph
            assert sum(n.target is canonical.capacity_of for n in graph.nodes) == 1


def test_load_logical_state_dict_names_unexpected_and_missing_keys():
    """strict: keys the model lacks are an error as missing ones are, named; strict=False loads what both have
    and warns about the rest; a wrong shape names its key."""
    import pytest

    model = TinyMoELM(SampleConfig(style="fused", layers=2))
    cm = moepass.compile(model, moepass.Plan(form="single"))
    state = {**model.state_dict(), "layers.0.mlp.router": torch.zeros(3)}
    missing = "layers.1.mlp.w_down"
    del state[missing]
    with pytest.raises(KeyError, match=rf"missing keys \['{missing}'\]; unexpected keys \['layers.0.mlp.router'\]: "
                                       r"a checkpoint of another model or plan"):
        moepass.load_logical_state_dict(cm, state)
    state["layers.0.mlp.w_gate_up"] = state["layers.0.mlp.w_gate_up"] + 1.0
    with pytest.warns(UserWarning, match=r"strict=False\) did not load everything: missing keys \['layers.1.mlp."
                                         r"w_down'\]; unexpected keys \['layers.0.mlp.router'\]"):
        moepass.load_logical_state_dict(cm, state, strict=False)
    torch.testing.assert_close(cm.state_dict()["layers.0.mlp.w_gate_up"], state["layers.0.mlp.w_gate_up"])
    with pytest.raises(ValueError, match=r"'layers.0.mlp.w_gate_up' has shape \(1, 2\), expected"):
        moepass.load_logical_state_dict(cm, {**model.state_dict(), "layers.0.mlp.w_gate_up": torch.zeros(1, 2)})
