"""Blocks that drop tokens over an expert capacity, written the ways code bases write them: the factor under any
attribute name, rounded up or down, counted per batch or per sequence, with loop or einsum experts. Detection
must describe the capacity (or reject the block), never accept it as dropless: the compiled block then matches
the original on crowded batches, where the drops happen."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.spec import CapacitySpec

pytestmark = pytest.mark.unit

D, FF, E = 32, 64, 4


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class LoopCapacityMoE(nn.Module):
    """Top-1 over ModuleList experts; assignments past the capacity are dropped (zero). The factor is held as
    `self.cf`; `floor`: the capacity is int(...); `per_sequence`: each sequence is a capacity group;
    `fixed`: a count that does not depend on the tokens. The selection is written `probs.max(-1)`."""

    def __init__(self, cf: float = 2.0, floor: bool = False, per_sequence: bool = False, fixed: int | None = None):
        super().__init__()
        self.cf, self.floor, self.per_sequence, self.fixed = cf, floor, per_sequence, fixed
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])

    def forward(self, x):
        groups = x.reshape(-1, x.shape[-2], D) if self.per_sequence else x.reshape(1, -1, D)  # [G, S, D]
        count = self.cf * groups.shape[1] / E
        cap = self.fixed if self.fixed is not None else int(count) if self.floor else math.ceil(count)
        gate, idx = self.router(groups).softmax(-1).max(-1)  # [G, S]
        onehot = F.one_hot(idx, E)
        keep = (((onehot.cumsum(1) - 1) * onehot).sum(-1) < cap).reshape(-1)  # first come, first served
        tokens, idx, gate = groups.reshape(-1, D), idx.reshape(-1), gate.reshape(-1)
        out = torch.zeros_like(tokens)
        for e in range(E):
            sel = ((idx == e) & keep).nonzero(as_tuple=True)[0]
            out.index_add_(0, sel, self.experts[e](tokens[sel]) * gate[sel, None])
        return out.reshape(x.shape)


def crowded(shape: tuple[int, ...]) -> torch.Tensor:
    """Every token the same: all choose one expert, which overflows any capacity below the token count."""
    return torch.randn(D).expand(*shape, D).contiguous()


def compiled(model: nn.Module, x: torch.Tensor) -> tuple[moepass.DetectionReport, nn.Module]:
    report = moepass.detect(model, example_inputs=(x,))
    return report, moepass.compile(model, moepass.Plan(form="single", keep_original_if_slower=False), report=report)


@pytest.mark.parametrize("floor,per_sequence", [(False, False), (True, False), (False, True), (True, True)])
def test_capacity_under_any_name_rounding_and_group_is_described_and_reproduced(floor, per_sequence):
    torch.manual_seed(0)
    model = LoopCapacityMoE(cf=2.0, floor=floor, per_sequence=per_sequence)
    report, cm = compiled(model, torch.randn(2, 8, D))
    (spec,) = report.blocks
    assert spec.capacity == CapacitySpec(capacity_factor=2.0, rounding="floor" if floor else "ceil",
                                         scope="sequence" if per_sequence else "batch"), report.summary()
    assert report.details[0].check.compared_tokens > 0  # a selection written max(-1) is compared too
    for shape in [(2, 8), (3, 5), (1, 7), (2, 9)]:  # integer and fractional capacities
        for x in (torch.randn(*shape, D), crowded(shape)):
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
    x = crowded((2, 9))
    assert int((model(x).abs().sum(-1) == 0).sum()) > 0  # the crowded batch does drop tokens


def test_a_capacity_no_attribute_gives_is_rejected_with_the_reason():
    torch.manual_seed(0)
    model = LoopCapacityMoE(fixed=12)  # 12 slots per expert: random probes stay below, crowded ones do not
    report = moepass.detect(model, example_inputs=(torch.randn(2, 8, D),))
    assert report.blocks == []
    (path, reason), = report.rejected
    assert "until many tokens choose the same experts" in reason and "capacity" in reason, reason
    assert "[2.0]" in reason  # the float attributes tried
    cm = moepass.compile(model, moepass.Plan(form="single"))
    x = crowded((2, 8))
    torch.testing.assert_close(cm(x), model(x))  # left as it is


def test_dropless_blocks_stay_dropless():
    from samples.models import LoopMoE

    torch.manual_seed(0)
    block = LoopMoE(D, FF, E, 2)
    block.cf = 1.0  # a float attribute that is no capacity factor: the dropless hypothesis holds on crowded probes
    report = moepass.detect(block, example_inputs=(torch.randn(2, 8, D),))
    (spec,) = report.blocks
    assert spec.capacity is None, report.summary()
