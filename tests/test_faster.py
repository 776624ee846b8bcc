"""form="single" keeps the faster of its rewritten graph and the user's block (`moepass.runtime.faster`).

The test suite sets MOEPASS_ALWAYS_REWRITE=1 (no timing decides what its other tests run); these tests unset it.
What they prove: the timing picks the faster side; a block that keeps its original runs the user's code on the
compiled model's own parameters (outputs, gradients and optimizer steps bit-equal to the untouched model; `.to()`
reaches it; state_dict unchanged); the timing leaves no trace (random state, buffers, `.grad`, the input a block
writes into); identical blocks are timed once; tracers and the plan's exclusions get the graph without a timing.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import moepass
from moepass.errors import PlanError
from moepass.runtime import faster
from samples.models import SampleConfig, TinyMoELM, make_moe

CFG = SampleConfig(dim=16, ffn_dim=32, num_experts=4, top_k=2, layers=3)


@pytest.fixture(autouse=True)
def timing_on(monkeypatch):
    monkeypatch.setenv("MOEPASS_ALWAYS_REWRITE", "0")


@pytest.fixture
def choose(monkeypatch):
    """Replace the timing by a fixed choice; returns the list of the calls it answered."""
    calls = []

    def set_choice(original: bool):
        def fake(original_fn, rewritten_fn, module, args, kwargs):
            calls.append(module)
            return faster.Choice(original=original, ratio=2.0 if original else 0.5, ratios=(1.0,), steps=1)

        monkeypatch.setattr(faster, "measure", fake)
        return calls

    return set_choice


def blocks(cm):
    return list(cm.moepass_info.rewritten.values())


def tokens(step=0):
    return torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("original", [True, False])
def test_either_choice_trains_like_the_untouched_model(choose, original):
    calls = choose(original)
    torch.manual_seed(0)
    ref = TinyMoELM(CFG)
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, cm)]
    for step in range(2):
        losses = []
        for model, opt in zip((ref, cm), opts):
            opt.zero_grad()
            loss = model.loss(tokens(step))
            loss.backward()
            losses.append(loss.detach())
        grads = [{n: p.grad for n, p in m.named_parameters()} for m in (ref, cm)]
        assert grads[0].keys() == grads[1].keys()
        if original:  # the user's own code on the compiled model's parameters: the same bits
            assert torch.equal(losses[0], losses[1])
            for name in grads[0]:
                assert torch.equal(grads[0][name], grads[1][name]), name
        else:
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            for name in grads[0]:
                torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
    assert len(calls) == 1  # three identical blocks, one input signature: timed once
    for gm in blocks(cm):
        (choice,) = faster.choices(gm).values()
        assert choice.original is original
    assert list(cm.state_dict()) == list(ref.state_dict())


def test_the_original_follows_the_compiled_parameters(choose):
    """`.to()` on the compiled model reaches the block it may run: one table of parameters for both."""
    choose(True)
    torch.manual_seed(0)
    ref = make_moe("loop", CFG)
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    ref, cm = ref.double(), cm.double()
    x = torch.randn(2, 5, CFG.dim, dtype=torch.float64)
    assert torch.equal(cm(x), ref(x))
    with torch.no_grad():
        for (name, p), q in zip(cm.named_parameters(), ref.parameters()):
            assert p.dtype == torch.float64, name
            p.mul_(1.5)
            q.mul_(1.5)
    assert torch.equal(cm(x), ref(x))
    (choice,) = faster.choices(blocks(cm)[0]).values()
    assert choice.original


def test_timing_leaves_no_trace():
    """Real timing on torchtitan's MoE (its per-expert token counter, a buffer each train-mode forward adds the load
    to): afterwards the random state, the counter and the gradients are what one untimed step leaves."""
    TT = pytest.importorskip("samples.torchtitan_models")
    if not TT.AVAILABLE:
        pytest.skip(TT.WHY_NOT)
    v = TT.VARIANTS["expert_bias"]
    ref = TT.moe_block(v)
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    x = torch.randn(2, 6, v.dim)
    x_before, rng = x.clone(), torch.get_rng_state()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = []
    for model, xi in zip((cm, ref), xs):
        out = model(xi)
        out.sum().backward()
        outs.append(out.detach())
    (choice,) = faster.choices(blocks(cm)[0]).values()
    assert choice.ratios and choice.ratio == choice.ratio  # timed (not NaN)
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(x, x_before)
    for name, buffer in ref.named_buffers():
        assert torch.equal(cm.get_buffer(name), buffer), name  # the timing's calls were undone
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(cm.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-5)


def test_measure_keeps_the_faster_side():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def slow(t):
        time.sleep(0.004)
        return lin(t)

    assert faster.measure(slow, lin, lin, (x,), {}).original is False
    assert faster.measure(lin, slow, lin, (x,), {}).original is True
    choice = faster.measure(slow, lin, lin, (x,), {})
    assert choice.ratio < 0.5 and "rewritten graph" in str(choice)
    assert lin.weight.grad is None and x.grad is None  # gradients returned, never accumulated


def test_sides_that_disagree_keep_the_block_whatever_the_times():
    """A rewritten side computing something else for this input (beyond rounding) is never chosen, however
    fast: the block runs and the choice says why; sides that agree are timed as before."""
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def other(t):
        return lin(t) * 1.5

    choice = faster.measure(lin, other, lin, (x,), {})
    assert choice.original and choice.reason.startswith("its rewritten graph does not reproduce it for this input")
    assert str(choice).startswith("original block (its rewritten graph does not reproduce it")
    noisy = faster.measure(lin, lambda t: lin(t) + 1e-5 * lin(t).abs().max(), lin, (x,), {})
    assert not noisy.reason and noisy.ratios  # within fp32's share: timed


def test_hf_deepseek_under_autocast_runs_as_written():
    """Hugging Face's DeepSeek-V3 router scores in bf16 under autocast (its sigmoid runs in the logits' dtype),
    where moe.route scores in fp32: some tokens pick other experts. The keeper sees it on the first input and
    runs the block itself, so the compiled model under autocast computes exactly what the model does."""
    pytest.importorskip("transformers")
    from samples import hf_models

    model, batch = hf_models.build("deepseek_v3")
    cm = moepass.compile(model, moepass.Plan(form="single"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, out = model(**batch).logits, cm(**batch).logits
    assert torch.equal(out, ref)
    for path, gm in cm.moepass_info.rewritten.items():
        (choice,) = faster.choices(gm).values()
        assert choice.original and "does not reproduce it" in choice.reason and "autocast" in choice.reason, path


def test_the_callers_saved_tensor_hooks_and_checkpointing_see_no_timing():
    """The first call (which times both sides) packs what any later call packs, through the caller's
    saved-tensor hooks; inside a non-reentrant activation checkpoint the first call trains as the block does."""
    from torch.utils.checkpoint import checkpoint

    block = make_moe("fused", CFG)
    cm = moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"))
    x = torch.randn(2, 5, CFG.dim)
    packed = []
    for _ in range(2):
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cm(x.clone().requires_grad_()).sum().backward()
        packed.append(count[0])
    assert packed[0] == packed[1] > 0 and len(faster.choices(blocks(cm)[0])) == 1

    ref, fresh = copy.deepcopy(block), moepass.compile(copy.deepcopy(block), moepass.Plan(form="single"))
    for model in (ref, fresh):
        checkpoint(model, x, use_reentrant=False).square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_traced_calls_run_the_graph_untimed(choose):
    calls = choose(True)
    cm = moepass.compile(make_moe("fused", CFG), moepass.Plan(form="single"))
    x = torch.randn(2, 5, CFG.dim)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:  # a dispatch mode: it must see the graph's ops
        cm(x)
    assert counter.get_total_flops() > 0
    assert not calls and faster.choices(blocks(cm)[0]) == {}


@pytest.mark.parametrize("plan", [
    moepass.Plan(form="single", keep_original_if_slower=False),
    moepass.Plan(form="single", deterministic=True),
    moepass.Plan(form="single", expert_recompute=True),
], ids=["off", "deterministic", "expert_recompute"])
def test_plans_that_always_run_the_graph(choose, plan):
    calls = choose(True)
    cm = moepass.compile(make_moe("loop", CFG), plan)
    cm(torch.randn(2, 5, CFG.dim))
    assert not calls and faster.choices(blocks(cm)[0]) == {}


def test_explain_says_when_the_users_block_may_run():
    model = make_moe("loop", CFG)
    line = "at run time: the first call per input signature times this graph against the block's own code"
    assert line in moepass.explain(model, moepass.Plan(form="single"), graphs=False)
    assert line not in moepass.explain(model, moepass.Plan(form="single", keep_original_if_slower=False), graphs=False)


def test_the_field_acts_only_under_single():
    with pytest.raises(PlanError, match="keep_original_if_slower"):
        moepass.Plan(form="ep", keep_original_if_slower=False)
    with pytest.raises(PlanError, match="keep_original_if_slower"):
        moepass.Plan(form="single", keep_original_if_slower="no")


def test_a_choice_holds_for_one_input_signature():
    x = torch.randn(2, 3)
    key = faster.input_key(True, (x,), {})
    assert key == faster.input_key(True, (x, None), {})[:3]  # the one-tensor fast path makes the general key
    assert key == faster.input_key(True, (torch.zeros(2, 3),), {})  # values do not matter
    others = [faster.input_key(False, (x,), {}), faster.input_key(True, (x.double(),), {}),
              faster.input_key(True, (torch.randn(3, 3),), {}), faster.input_key(True, (x.requires_grad_(),), {})]
    with torch.no_grad():
        others.append(faster.input_key(True, (x,), {}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        others.append(faster.input_key(True, (x,), {}))
    assert len({key, *others}) == 1 + len(others)
    assert faster.input_key(True, (x,), {"mask": object()}) is None  # not a plain value: the graph runs


def test_torch_compile_over_a_kept_block_traces_the_graph(choose):
    """Dynamo over the compiled model traces through the keeper to the graph (no timing inside a trace)."""
    calls = choose(True)
    torch.manual_seed(0)
    ref = make_moe("loop", CFG)
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    x = torch.randn(2, 5, CFG.dim)
    y = torch.compile(cm, backend="eager", fullgraph=False)(x)
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-6)
    assert not calls and faster.choices(blocks(cm)[0]) == {}
    cm(x)  # eagerly, the first call is timed
    assert len(calls) == 1


def test_a_block_writing_into_its_input_is_timed_on_copies():
    """Switch Transformers' router jitter multiplies the block's input in place: the timing runs on a copy made by
    an op (a leaf could not be written), the caller's tensor sees only the real call's write."""
    pytest.importorskip("transformers")
    from samples import hf_hub

    family = next(f for f in hf_hub.moe_families() if f.model_type == "switch_transformers")
    model, batch = hf_hub.build(family)
    report = moepass.detect(model, example_inputs=batch)
    spec = next(s for s in report.blocks if s.path not in report.outlines)
    ref = model.get_submodule(spec.path).train()
    cm = moepass.compile(copy.deepcopy(ref), moepass.Plan(form="single"))
    x = torch.randn(2, 8, spec.experts.hidden_dim)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ins, outs = [], []
    for block, xi in zip((ref, cm), xs):
        h = xi * 1.0  # a block's input in training: made by an op, writable in place
        torch.manual_seed(3)
        y = hf_hub.output_of(block(h))
        y.sum().backward()
        ins.append(h.detach())
        outs.append(y.detach())
    (choice,) = faster.choices(blocks(cm)[0]).values()
    assert choice.ratios and not choice.reason
    assert not torch.equal(ins[0], x)  # the jitter wrote into the input, once
    torch.testing.assert_close(ins[1], ins[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-6)


def test_meta_inputs_are_not_timed(choose):
    calls = choose(True)
    cm = moepass.compile(make_moe("fused", CFG), moepass.Plan(form="single"))
    keeper = cm.__dict__[faster.KEEPER]
    graph_forward = type(cm).forward.__wrapped__
    assert keeper.forward_for(cm, graph_forward, (torch.randn(2, 5, CFG.dim, device="meta"),), {}) is None
    (choice,) = faster.choices(cm).values()
    assert not calls and not choice.original and choice.reason == "meta tensors take no time"
