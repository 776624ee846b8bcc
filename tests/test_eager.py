"""The eager fast path (`moepass.eager`): a rewritten block run eagerly calls its ops' functions directly,
with the same results and gradients bit for bit as through the dispatcher, and every tracer still sees
the dialect ops.

Legend: B batch, S sequence, D width.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

import moepass
from moepass import dialect, eager
from samples.models import SampleConfig, make_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

STYLES = ("loop", "fused", "gshard")
CFG = SampleConfig(dim=16, ffn_dim=32, num_experts=8, top_k=2)


class Passthrough(TorchFunctionMode):
    """A mode that changes nothing: its presence makes the block run its graph's own code (the ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def compiled(style: str, form: str = "single", **plan) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moepass.compile(make_moe(style, CFG), moepass.Plan(form=form, **plan))


def step(block, x_BSD, mode=None, namespaces=("moe", "moe_lowered")):
    """Output, input gradient and every parameter gradient (a DTensor's local shard) of one forward+backward,
    and the custom ops of `namespaces` run."""
    block.zero_grad()
    x_BSD = x_BSD.detach().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        if mode is None:
            y = block(x_BSD)
        else:
            with mode:
                y = block(x_BSD)
        (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
    ops = Counter(e.name for e in prof.events() if e.name.split("::")[0] in namespaces)
    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in block.parameters()
             if p.grad is not None]
    return [y.detach(), x_BSD.grad, *grads], ops


@pytest.mark.parametrize("style", STYLES)
def test_eager_equals_the_ops_bit_for_bit_and_dispatches_none(style):
    block = compiled(style)
    x = torch.randn(2, 4, CFG.dim)
    fast, fast_ops = step(block, x)
    slow, slow_ops = step(block, x, Passthrough())
    assert len(fast) == len(slow) > 3
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert fast_ops == {}  # eagerly no custom op goes through the dispatcher
    expected = {"moe::route", "moe::permute", "moe::expert_ffn", "moe::unpermute", "moe::combine"}
    assert expected <= set(slow_ops)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run interpreted on CPU")
@pytest.mark.parametrize("style", STYLES)
def test_eager_equals_the_lowered_ops_bit_for_bit(style):
    block = compiled(style, lowering="triton")
    x = torch.randn(2, 4, CFG.dim)
    fast, fast_ops = step(block, x)
    slow, slow_ops = step(block, x, Passthrough())
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert fast_ops == {}
    assert {"moe_lowered::route", "moe_lowered::permute", "moe_lowered::expert_ffn",
            "moe_lowered::unpermute_combine"} <= set(slow_ops)


def test_tracers_and_autocast_see_the_ops():
    block = compiled("fused")
    x = torch.randn(2, 4, CFG.dim)
    traced = make_fx(block)(x)  # a dispatch mode: the graph's own code runs
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    # what the ops' dispatcher path records (the expert FFN's autograd kernel calls its forward op)
    assert {dialect.ROUTE, dialect.PERMUTE, torch.ops.moe.expert_ffn_forward.default, dialect.COMBINE} <= targets
    symbolic = torch.fx.symbolic_trace(torch.nn.Sequential(block))  # proxies: the ops are recorded
    assert dialect.EXPERT_FFN in {n.target for n in symbolic.graph.nodes if n.op == "call_function"}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the ops' autocast policies apply
        _, ops = step(block, x)
    assert "moe::expert_ffn" in ops


def test_subclass_arguments_go_through_the_op():
    """A tensor subclass (here a FakeTensor) sends the call to the op, whose fake implementation runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x_TD = mode.from_tensor(torch.randn(8, 16))
        experts_TK = mode.from_tensor(torch.randint(0, 4, (8, 2)))
    x_ND, counts_E, order_N = eager.EAGER[dialect.PERMUTE](x_TD, experts_TK, 4)
    assert type(x_ND) is type(x_TD) and x_ND.shape == (16, 16) and counts_E.shape == (4,)


def test_the_eager_code_is_rebuilt_after_a_recompile():
    block = compiled("loop")
    gm = next(iter(block.moepass_info.rewritten.values()))
    x = torch.randn(2, 4, CFG.dim)
    before = gm(x)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.mul, (output.args[0], 2.0))
    output.args = (doubled,)
    gm.recompile()
    torch.testing.assert_close(gm(x), 2 * before, rtol=0, atol=0)
    assert copy.deepcopy(gm)(x).equal(gm(x))


CUSTOM_NAMESPACES = ("moe", "moe_lowered", "moe_comm", "moe_sched", "moe_ep")


def case_ep_eager(rank, world, style):
    """EP at W ranks: the eager step equals the ops' step bit for bit (outputs, every gradient), and eagerly no
    custom op of moepass (the exchange, the schedule marks, the local expert ids included) is dispatched."""
    block = compiled(style, form="ep")
    x = torch.randn(2, 4, CFG.dim, generator=torch.Generator().manual_seed(rank))
    (fast, fast_ops), (slow, slow_ops) = [step(block, x, mode, CUSTOM_NAMESPACES) for mode in (None, Passthrough())]
    assert len(fast) == len(slow) > 3
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert fast_ops == {}, fast_ops
    assert {"moe_comm::all_to_all", "moe_comm::exchange_counts", "moe_comm::host_splits"} <= set(slow_ops)
    return dict(slow_ops)


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["loop", "fused"])
def test_ep_eager_equals_the_ops_and_dispatches_none(style):
    reports = pool(2).run(case_ep_eager, style)
    assert len(reports) == 2
