"""`module_copy.deepcopy_module` gives what `copy.deepcopy` gives: the same classes, state, hooks and sharing,
memo adoption included, with the original untouched; classes that customise copying go through deepcopy."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from moepass.module_copy import copies_plainly, deepcopy_module


class CustomCopy(nn.Module):
    """Customises its deep copy: counted, and the copy is marked."""

    copies = 0

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def __deepcopy__(self, memo):
        CustomCopy.copies += 1
        new = CustomCopy.__new__(CustomCopy)
        nn.Module.__init__(new)
        new.w = nn.Parameter(self.w.detach().clone())
        new.marked = True
        return new.train(self.training)


def record(module, args, output):
    return output


class Zoo(nn.Module):
    """Everything a module tree can hold that copying must get right."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.a = shared
        self.b = nn.Sequential(nn.Linear(4, 4), shared)  # one module reached twice
        self.tied = nn.Linear(4, 4, bias=False)
        self.tied2 = nn.Linear(4, 4, bias=False)
        self.tied2.weight = self.tied.weight  # one parameter twice
        self.experts = nn.ModuleList(nn.Linear(4, 8) for _ in range(3))
        self.table = nn.ModuleDict({"x": nn.Identity(), "y": nn.LayerNorm(4)})
        self.custom = CustomCopy()
        self.register_buffer("steps", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        self.register_module("missing", None)
        self.plain = [torch.arange(3.0), self.a]  # a plain attribute holding a tensor and a submodule
        self.config = {"k": 2, "names": ["w1", "w2"]}
        self.a.register_forward_hook(record)

    def forward(self, x):
        return self.b(self.a(x)) + self.tied2(self.tied(x))


def shape_of(model: nn.Module) -> list:
    """Classes, names, values and the sharing pattern (which entries are one object) of a module tree."""
    first: dict[int, int] = {}

    def ref(obj):
        return first.setdefault(id(obj), len(first))

    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        out.append(("module", name, type(m).__name__, ref(m), m.training, dict(m._forward_hooks).__len__()))
    for name, p in model.named_parameters(remove_duplicate=False):
        out.append(("param", name, type(p).__name__, ref(p), p.requires_grad, p.detach().tolist()))
    for name, b in model.named_buffers(remove_duplicate=False):
        out.append(("buffer", name, ref(b), b.tolist()))
    return out


def test_same_result_as_deepcopy():
    torch.manual_seed(0)
    model = Zoo()
    model.experts[1].requires_grad_(False)
    model.eval()
    before = shape_of(model)
    expected, got = copy.deepcopy(model), deepcopy_module(model)
    assert shape_of(got) == shape_of(expected) == before
    assert got.state_dict().keys() == model.state_dict().keys()
    assert got.scratch.tolist() == [1.0, 1.0, 1.0] and "scratch" not in got.state_dict()
    assert got.plain[1] is got.a and got.b[1] is got.a and got.tied2.weight is got.tied.weight
    assert got.config == model.config and got.config is not model.config
    assert got.table.y.normalized_shape == (4,) and got.missing is None
    assert list(got.a._forward_hooks.values()) == [record]
    assert type(got.a._forward_hooks) is OrderedDict
    x = torch.randn(2, 4)
    torch.testing.assert_close(got(x), model(x), rtol=0, atol=0)


def test_copy_shares_nothing_with_the_original():
    model = Zoo()
    got = deepcopy_module(model)
    originals = {id(t) for t in [*model.parameters(), *model.buffers(), *model.modules()]}
    assert originals.isdisjoint(id(t) for t in [*got.parameters(), *got.buffers(), *got.modules()])
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert ptrs.isdisjoint(p.data_ptr() for p in got.parameters())
    got.a._forward_hooks.clear()
    got.tied.weight.data.zero_()
    assert len(model.a._forward_hooks) == 1 and model.tied.weight.abs().sum() > 0


def test_memo_entries_are_adopted():
    model = Zoo()
    adopted = nn.Parameter(torch.full((8, 4), 7.0))
    got = deepcopy_module(model, {id(model.experts[0].weight): adopted})
    assert got.experts[0].weight is adopted
    assert got.experts[1].weight is not model.experts[1].weight


def test_customised_classes_copy_as_they_say():
    model = Zoo()
    CustomCopy.copies = 0
    got = deepcopy_module(model)
    assert CustomCopy.copies == 1 and got.custom.marked
    assert not copies_plainly(CustomCopy) and copies_plainly(Zoo) and copies_plainly(nn.Linear)


@pytest.mark.parametrize("style", ["loop", "fused", "gshard"])
def test_sample_models(style):
    from samples.models import SampleConfig, TinyMoELM

    torch.manual_seed(0)
    model = TinyMoELM(SampleConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, layers=2, style=style, heads=2))
    got = deepcopy_module(model)
    assert shape_of(got) == shape_of(copy.deepcopy(model))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 8))
    torch.testing.assert_close(got(tokens), model(tokens), rtol=0, atol=0)


def test_gc_paused_restores_the_collector_as_it_was():
    import gc

    from moepass.module_copy import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector the caller had paused stays paused
    finally:
        gc.enable()


class Holder:
    """A plain object holding a lock: not plain data, and its copy raises."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.n = 3


class CustomHoldingGroup(nn.Module):
    """Customises its copy through `copy.deepcopy` of its own state, which holds a process group."""

    def __deepcopy__(self, memo):
        new = CustomHoldingGroup.__new__(CustomHoldingGroup)
        nn.Module.__init__(new)
        new.group = copy.deepcopy(self.group, memo)
        new.marked = True
        return new


def test_what_cannot_be_copied_is_shared():
    """Process groups, a DeviceMesh, stores, streams and events, locks, conditions, file handles, generators
    and objects holding them: the copy holds the same object (in a container too); tensors, modules and
    containers are still copied."""
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = FakeStore()
    dist.init_process_group("fake", rank=0, world_size=2, store=store)
    try:
        model = Zoo()
        shared = {"group": dist.group.WORLD, "mesh": init_device_mesh("cpu", (2,)), "store": store,
                  "stream": torch.Stream("cpu"), "event": torch.Event("cpu"), "lock": threading.Lock(),
                  "cond": threading.Condition(), "flag": threading.Event(), "file": open(__file__),
                  "gen": (i for i in range(3)), "holder": Holder()}
        for name, value in shared.items():
            setattr(model, name, value)
        model.mixed = [torch.ones(2), dist.group.WORLD, {"lock": shared["lock"]}]
        model.custom = CustomHoldingGroup()
        model.custom.group = dist.group.WORLD
        got = deepcopy_module(model)
        for name, value in shared.items():
            assert getattr(got, name) is value, name
        assert got.mixed is not model.mixed and got.mixed[1] is dist.group.WORLD
        assert got.mixed[2]["lock"] is shared["lock"] and got.mixed[0] is not model.mixed[0]
        assert got.custom.group is dist.group.WORLD and got.custom.marked
        assert shape_of(got) == shape_of(model)
        shared["file"].close()
    finally:
        dist.destroy_process_group()


class RefusesCopy(nn.Module):
    def __deepcopy__(self, memo):
        raise RuntimeError("this module cannot be copied")


def test_a_module_whose_copy_raises_is_never_shared():
    """A module (or tensor, or container) is never shared: its copy's error is raised, naming it and the fix."""
    model = Zoo()
    model.table.z = RefusesCopy()
    with pytest.raises(TypeError, match=r"deep-copying a RefusesCopy module failed: RuntimeError: this module cannot "
                                        r"be copied. Give its class a __deepcopy__"):
        deepcopy_module(model)
