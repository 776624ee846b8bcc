"""Generic experts: experts that are not a known FFN run as they are (`moepass.generic_experts`).

The op against a per-expert reference (outputs and every gradient, experts without rows included), the
rewritten blocks against the originals under form="single" and EP / FSEP at W=2 on gloo (the zoo holds
two such blocks too, `tests/test_detect_zoo.py`), the one [E, ...] gradient per tensor (profiler), the
spec and explain text, and the PlanErrors of what is not built (expert buffers under EP / FSEP).

Shape legend: N rows, D model width, F expert width, E experts, K top-k.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import sys

import pytest
import torch
from torch import nn

import moepass
from moepass import canonical
from moepass.detect.experts import read_generic_expert
from moepass.errors import PlanError
from moepass.generic_experts import run_experts, stateless_template
from moepass.spec import FFN_ROLES, ExpertsSpec
from moepass.verify import verify

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402
from test_expert_compute import OpLog  # noqa: E402
from zoo_blocks import FF, D, E, loop_combine  # noqa: E402
from zoo_cases import NormExpert, NormExperts, ResidualGluDict, assert_exact  # noqa: E402


class TanhScaled(nn.Module):
    """Not a known FFN (tanh), with a per-expert buffer: down(tanh(up(x))) * scale."""

    def __init__(self, e: int):
        super().__init__()
        self.up = nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)
        self.register_buffer("scale", torch.full((D,), 0.5 + 0.25 * e))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))) * self.scale


class BufferExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(TanhScaled(e) for e in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = self.router(x).topk(2, dim=-1)
        return loop_combine(x, w.softmax(-1), idx, list(self.experts)).view_as(h)


class NormAndIdentityExperts(NormExperts):
    """E - 2 generic experts and 2 zero-compute experts that return their input (router ids E-2, E-1)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(NormExpert() for _ in range(E - 2))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        return loop_combine(x, w, idx, [*self.experts, lambda t: t, lambda t: t]).view_as(h)


class OddNorm(nn.Module):
    """A generic expert with an odd width inside (5): FSEP cannot split it over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 5)
        self.norm = nn.LayerNorm(5)
        self.down = nn.Linear(5, D)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


class OddExperts(NormExperts):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(OddNorm() for _ in range(E))


class TupleExpert(NormExpert):
    def forward(self, x):
        return super().forward(x), x.sum()


class TupleExperts(NormExperts):
    """Experts returning (rows, aux): neither a known FFN nor a generic expert."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(TupleExpert() for _ in range(E))

    def forward(self, h):
        x = h.reshape(-1, D)
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        return loop_combine(x, w, idx, [lambda t, m=m: m(t)[0] for m in self.experts]).view_as(h)


def _block(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


# ----------------------------------------------------------------------------------------------
# The op.
# ----------------------------------------------------------------------------------------------


def _stacked(experts: list[nn.Module]) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    names = tuple(n for n, _ in experts[0].named_parameters())
    return names, [torch.stack([dict(m.named_parameters())[n].detach() for m in experts]).requires_grad_()
                   for n in names]


def test_the_op_equals_each_expert_on_its_rows_with_every_gradient():
    torch.manual_seed(0)
    experts = [NormExpert() for _ in range(E)]
    counts_E = torch.tensor([3, 0, 5, 1, 0, 4])  # experts without rows: zero gradients, never called
    x_ND = torch.randn(int(counts_E.sum()), D, requires_grad=True)
    names, stacked_E = _stacked(experts)
    probe_ND = torch.randn(x_ND.shape)
    y_ND = run_experts(x_ND, counts_E, stateless_template(experts[0]), names, *stacked_E)
    got = torch.autograd.grad((y_ND * probe_ND).sum(), [x_ND, *stacked_E])

    ref_names, ref_E = _stacked(experts)  # the reference: plain autograd through slices of the stacks
    rows = x_ND.detach().clone().requires_grad_()
    ref_ND = torch.cat([torch.func.functional_call(experts[0], {n: t[e] for n, t in zip(ref_names, ref_E)}, (part,))
                        for e, part in enumerate(rows.split(counts_E.tolist()))])
    want = torch.autograd.grad((ref_ND * probe_ND).sum(), [rows, *ref_E])
    torch.testing.assert_close(y_ND, ref_ND, rtol=0, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not got[1][1].any() and not got[1][4].any()  # experts 1 and 4 had no rows


def test_a_second_backward_through_one_forward_raises():
    experts = [NormExpert() for _ in range(2)]
    names, stacked_E = _stacked(experts)
    y_ND = run_experts(torch.randn(3, D), torch.tensor([1, 2]), stateless_template(experts[0]), names, *stacked_E)
    y_ND.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="generic experts: backward through the same forward twice"):
        y_ND.sum().backward()


def test_the_template_holds_no_state_and_the_user_module_is_untouched():
    expert = NormExpert()
    before = {n: t.clone() for n, t in expert.state_dict().items()}
    template = stateless_template(expert)
    assert list(template.parameters()) == [] and list(template.buffers()) == [] and template.state_dict() == {}
    assert expert.state_dict().keys() == before.keys()
    assert all(torch.equal(expert.state_dict()[n], t) for n, t in before.items())


def test_one_backward_allocates_each_stacked_gradient_once_and_fills_none():
    """Slicing stacked[e] under autograd would allocate and zero-fill a full [E, ...] gradient per expert
    (E of them per tensor and step); the op writes one per tensor."""
    torch.manual_seed(0)
    experts = [NormExpert() for _ in range(E)]
    names, stacked_E = _stacked(experts)
    counts_E = torch.tensor([2, 0, 3, 1, 2, 2])
    x_ND = torch.randn(int(counts_E.sum()), D, requires_grad=True)
    y_ND = run_experts(x_ND, counts_E, stateless_template(experts[0]), names, *stacked_E)
    with OpLog() as log:
        y_ND.sum().backward()
    full = E * FF * D * 4  # bytes of one [E, F, D] fp32 weight (up.weight and down.weight have that size)
    big = [(e.name, e.input_shapes) for e in log.events if e.self_cpu_memory_usage >= full]
    assert len(big) == 2, big  # up.weight's and down.weight's gradient, once each
    fills = [(e.name, e.input_shapes) for e in log.events if e.name in ("aten::fill_", "aten::zero_")
             and e.input_shapes and math.prod(e.input_shapes[0]) >= E * FF * D // 4]
    assert not fills, fills  # no [E, ...] zero fill: only the empty expert's own slices are zeroed
    zeroed = [tuple(e.input_shapes[0]) for e in log.events if e.name == "aten::zero_"]
    assert (FF, D) in zeroed and (D, FF) in zeroed, zeroed  # expert 1's up.weight and down.weight gradients


# ----------------------------------------------------------------------------------------------
# Detection, the single form, the text.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [NormExperts, ResidualGluDict, BufferExperts, NormAndIdentityExperts])
def test_detected_as_generic_and_exact_under_single(cls):
    block = _block(cls)
    report = moepass.detect(block)
    (spec,) = report.blocks
    assert spec.experts.kind == "generic" and spec.recogniser == "modulelist-loop"
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"), report=report)
    assert sum(n.target is run_experts for n in compiled.graph.nodes) == 1
    assert not [n for n in compiled.graph.nodes if "expert_ffn" in str(n.target)]
    verify(compiled, after="generic")  # shapes propagate through the op under fake tensors
    # compile laid each stacked parameter's E copies out adjacently: the op reads views, no stack per step
    from moepass.canonical import adjacent_view, stacked_parameters

    groups = stacked_parameters(compiled, spec)
    params = [n for n, s in spec.experts.tensors if all(p in dict(block.named_parameters()) for p in s.paths)]
    assert len(groups) == len(params) > 0 and all(adjacent_view(g) is not None for g in groups)
    assert_exact(block, compiled)
    assert_exact(block, compiled)  # a second step: nothing kept from the first


def test_lowered_pickled_and_copied_blocks_stay_exact():
    """Around the op, the Triton lowering (interpreted here) runs route, permute and combine; the op itself
    stays as it is. A pickled and a deep-copied compiled block re-trace / copy it as one node."""
    block = _block(NormExperts)
    lowered = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single", lowering="triton"))
    kernels = {n.target for n in lowered.graph.nodes if getattr(n.target, "namespace", None) == "moe_lowered"}
    assert len(kernels) == 3 and sum(n.target is run_experts for n in lowered.graph.nodes) == 1, kernels
    assert_exact(block, lowered)
    compiled = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"))
    for again in (pickle.loads(pickle.dumps(compiled)), copy.deepcopy(compiled)):
        assert sum(n.target is run_experts for n in again.graph.nodes) == 1
        assert_exact(block, again)


def test_identity_experts_beside_generic_ones():
    (spec,) = moepass.detect(_block(NormAndIdentityExperts)).blocks
    assert spec.experts.kind == "generic" and spec.experts.identity_experts == (E - 2, E - 1)
    assert spec.experts.num_experts == E - 2 and all(len(s.paths) == E - 2 for _, s in spec.experts.tensors)


def test_a_buffer_is_stacked_like_a_parameter():
    (spec,) = moepass.detect(_block(BufferExperts)).blocks
    assert [n for n, _ in spec.experts.tensors] == ["up.weight", "down.weight", "scale"]
    assert spec.experts.tensors[2][1].paths == tuple(f"experts.{e}.scale" for e in range(E))


def test_known_ffns_keep_the_expert_ffn():
    from zoo_cases import CASES

    (spec,) = moepass.detect(_block(CASES["squared-ReLU experts"].block)).blocks
    assert spec.experts.kind == "ffn" and spec.experts.tensors == () and spec.experts.activation == "relu2"
    assert tuple(spec.experts.sources()) == ("w_gate", "w_down") and canonical.ROLES == FFN_ROLES


def test_summary_and_explain_say_generic():
    block = _block(NormExperts)
    (spec,) = moepass.detect(block).blocks
    assert spec.summary() == ("E=6 K=2 D=16 generic experts (module NormExpert run as traced, 6 tensors each), "
                              "router=softmax(before top-k), renormalised, dropless")
    assert "generic experts (module NormExpert run as traced, 6 tensors each)" in moepass.explain(block)


def test_experts_that_are_neither_say_both_reasons():
    report = moepass.detect(_block(TupleExperts))
    (detail,) = report.details
    assert not detail.accepted
    assert ("an expert returns tuple of shape None, not [T, D=16]; nor can they run as generic experts: an expert "
            "returns tuple of shape None, not [T, D=16]") in detail.reason, detail.reason


def test_a_block_attribute_named_like_the_template_is_reported():
    block = _block(NormExperts)
    block.expert_template = nn.Identity()
    (detail,) = moepass.detect(block).details
    assert not detail.accepted and ("block '<root>' has an attribute 'expert_template', the name its rewritten form "
                                    "gives the generic experts' template; rename it") in detail.reason, detail.reason


def test_experts_of_different_shapes_do_not_stack():
    wide = NormExpert()
    wide.up, wide.norm, wide.down = nn.Linear(D, 2 * FF), nn.LayerNorm(2 * FF), nn.Linear(2 * FF, D)
    assert read_generic_expert([NormExpert(), wide], D) == (
        "the experts differ in their classes or their tensors' names, shapes or dtypes, so they do not stack")
    generic = read_generic_expert([NormExpert(), NormExpert()], D)
    assert not isinstance(generic, str)
    params = D * FF + FF + 2 * FF + FF * D + D
    assert generic.class_name == "NormExpert" and generic.ffn_dim == params // (2 * D)


def test_a_generic_spec_without_a_template_is_refused():
    with pytest.raises(PlanError, match=r"experts.kind='generic' is invalid with template=None, tensors=\[\]: name "
                                        r"one expert module as the template"):
        ExpertsSpec(num_experts=E, hidden_dim=D, ffn_dim=FF, kind="generic").validate("MoESpec[b].experts")
    with pytest.raises(PlanError, match=r"experts.kind='fused' is invalid: use one of \['ffn', 'generic'\]"):
        ExpertsSpec(num_experts=E, hidden_dim=D, ffn_dim=FF, kind="fused").validate("MoESpec[b].experts")


# ----------------------------------------------------------------------------------------------
# EP at W=2 (gloo).
# ----------------------------------------------------------------------------------------------


def case_generic_ep(rank, world, cls, form):
    """A generic block under EP or FSEP: outputs and every logical gradient vs the original on the full batch, and the
    logical state dict under the original names. Returns the EP parameters and the compared gradients."""
    from moepass.runtime.grads import all_reduce_replicated_grads

    block = _block(cls)
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(form=form, topology=moepass.Topology(1, world)))
    x = torch.randn(2 * world, 5, D, generator=torch.Generator().manual_seed(5))
    mine = slice(2 * rank, 2 * rank + 2)
    (block(x) * x).sum().div(world).backward()  # EP's convention: the mean of the ranks' own losses
    out = cm(x[mine])
    (out * x[mine]).sum().backward()
    torch.testing.assert_close(out, block(x)[mine], rtol=1e-5, atol=1e-6)
    all_reduce_replicated_grads(cm)
    ref_grads = {n: p.grad for n, p in block.named_parameters()}
    for n, (g, rows) in moepass.logical_grads(cm).items():
        torch.testing.assert_close(g, ref_grads[n] if rows is None else ref_grads[n][rows], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")
    state = moepass.logical_state_dict(cm, full=True)
    assert state.keys() == block.state_dict().keys()
    assert all(torch.equal(state[n], t) for n, t in block.state_dict().items())
    params = sorted(n for n, _ in cm.named_parameters() if n.startswith(f"{form}_"))
    return params, sorted(moepass.logical_grads(cm))


def case_refused(rank, world):
    """What distributed forms refuse: generic experts holding buffers (EP, FSEP), a tensor FSEP cannot split."""
    errors = []
    for cls, form in ((BufferExperts, "ep"), (BufferExperts, "fsep"), (OddExperts, "fsep")):
        try:
            moepass.compile(_block(cls), moepass.Plan(form=form, topology=moepass.Topology(1, world)))
            errors.append("compiled")
        except PlanError as err:
            errors.append(str(err))
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("cls, form", [(NormExperts, "ep"), (NormAndIdentityExperts, "ep"), (NormExperts, "fsep")])
def test_generic_experts_under_ep_and_fsep_w2(cls, form):
    results = pool(2).run(case_generic_ep, cls, form)
    names = {n for n, p in _block(cls).named_parameters()}
    assert set(results[0][1]) | set(results[1][1]) == names  # every gradient compared on some rank
    assert results[0][0] == [f"{form}_{n}" for n in ("down_bias", "down_weight", "norm_bias", "norm_weight",
                                                      "up_bias", "up_weight")]


@pytest.mark.distributed
def test_expert_buffers_and_unsplittable_tensors_are_refused():
    for ep, fsep, odd in pool(2).run(case_refused):
        for form, text in (("ep", ep), ("fsep", fsep)):
            assert text == (f"Plan.form={form!r} cannot rewrite block <root>: its generic experts (module TanhScaled "
                            f"run as traced) hold buffers ['experts.0.scale'], which distributed forms do not shard in "
                            f"this build; use form='single', or leave this block alone with Plan(blocks={{'': None}}).")
        assert odd == ("Plan.form='fsep' cannot shard block <root>: expert weight 'experts.0.up.weight' (stacked) has "
                       "shape (6, 5, 16); dim 1 (5) must split evenly over the 2 ranks of the group. Use an ep_size "
                       "dividing 5, or leave this block alone with Plan(blocks={'': None}).")
