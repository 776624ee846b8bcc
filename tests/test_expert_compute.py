"""The expert FFN's torch implementation (`moepass.grouped_ffn`): parity with the dialect's reference,
the GEMM engine it picks, what it allocates in one backward, and `Plan(expert_recompute=True)`.

Legend: N rows sorted by expert, D width, F expert width, E experts.
"""

import copy

import pytest
import torch

import moepass
from moepass import dialect, grouped_ffn
from samples.models import FusedMoE, LoopMoE

ACTIVATIONS = ["swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu", "relu2", "clamped_swiglu"]
GATED = ("swiglu", "geglu", "geglu_tanh", "clamped_swiglu")
COUNTS = torch.tensor([3, 0, 7, 1, 11, 0])  # empty experts, E=6


class OpLog:
    """Every op run inside the block (custom ops' insides included: the profiler, not a dispatch mode),
    with its input shapes and the bytes it allocated itself."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                           profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.events = [e for e in self.prof.events() if e.name.startswith("aten::")]

    def count(self, name: str) -> int:
        return sum(1 for e in self.events if e.name == name)


# the GEMM engines (`grouped_ffn` module doc): expert by expert (row counts in host memory and [N, F] large: a
# CPU layer), else padded (opt-in), `torch._grouped_mm`, or the per-GEMM expert loop (unaligned rows)
ENGINES = [(16, 32, "per_expert"), (6, 10, "per_expert"), (16, 32, "small"), (16, 32, "grouped_mm"),
           (6, 10, "loop")]


def use_engine(engine, monkeypatch):
    monkeypatch.setattr(grouped_ffn, "PADDED_MACS", 1 << 18 if engine == "small" else 0)  # the small engine: opt-in
    monkeypatch.setattr(grouped_ffn, "PER_EXPERT_ELEMENTS", 0 if engine == "per_expert" else 1 << 62)


def ffn_args(activation, D, F, bias, dtype=torch.float32, counts=COUNTS):
    gen = torch.Generator().manual_seed(0)
    E, gated = counts.shape[0], activation in GATED
    w = lambda *s: (torch.randn(*s, generator=gen) * 0.3).to(dtype).requires_grad_()  # noqa: E731
    x = w(int(counts.sum()), D)
    return [x, counts, w(E, F, D), w(E, F, D) if gated else None, w(E, D, F),
            w(E, F) if bias else None, w(E, F) if bias and gated else None, w(E, D) if bias else None,
            activation, 1.5, 1.702]


def grads_of(fn, args, probe):
    inputs = [a for i, a in enumerate(args) if i in dialect.FFN_DIFFERENTIABLE and a is not None]
    y = fn(*args)
    return [y, *torch.autograd.grad((y * probe).sum(), inputs)]


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("D,F,engine", ENGINES)
def test_matches_the_reference_forward_and_every_gradient(activation, bias, recompute, D, F, engine, monkeypatch):
    use_engine(engine, monkeypatch)
    args = ffn_args(activation, D, F, bias)
    probe = torch.randn(args[0].shape[0], D)
    with OpLog() as log:
        got = grads_of(lambda *a: torch.ops.moe.expert_ffn(*a, recompute), args, probe)
    want = grads_of(dialect.expert_ffn_ref, args, probe)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    gemms = (2 if activation in GATED else 1) + 1  # forward GEMMs
    bwd = 6 if activation in GATED else 4  # backward: grad_a, wgrad down, and wgrad + grad_x per projection
    expected = gemms + bwd + (gemms - 1 if recompute else 0)
    assert log.count("aten::_grouped_mm") == (expected if engine == "grouped_mm" else 0)
    if engine == "per_expert":  # each GEMM once per expert with rows; a bias inside its GEMM (addmm), never gathered
        assert log.count("aten::mm") + log.count("aten::addmm") == expected * 4
        assert log.count("aten::addmm") == (4 * (gemms + (gemms - 1 if recompute else 0)) if bias else 0)
        assert log.count("aten::index_select") == log.count("aten::index_add_") == 0
    if engine == "small":  # one bmm per GEMM whatever E, and nothing read on the host
        assert log.count("aten::bmm") == expected
        assert log.count("aten::_local_scalar_dense") == 0


@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("relu", True), ("gelu", False)])
def test_per_expert_split_backward_equals_the_whole_bit_for_bit(activation, bias, monkeypatch):
    """Lancet's split backward (`backward_input`, later `backward_weights`) runs the same per-expert functions
    as `backward`: the same gradients bit for bit, saved or recomputed pre-activations."""
    use_engine("per_expert", monkeypatch)
    x, counts, *weights_and_options = [a.detach() if isinstance(a, torch.Tensor) else a
                                       for a in ffn_args(activation, 16, 32, bias)]
    grad_y = torch.randn(x.shape[0], 16)
    y, h_gate, h_up = grouped_ffn.forward(x, counts, *weights_and_options)
    for saved in ((h_gate, h_up), (None, None)):
        whole = grouped_ffn.backward(grad_y, x, *saved, counts, *weights_and_options)
        grad_x, work = grouped_ffn.backward_input(grad_y, x, *saved, counts, *weights_and_options)
        split = [grad_x, *grouped_ffn.backward_weights(work)]
        assert [g is None for g in split] == [g is None for g in whole]
        assert all(torch.equal(a, b) for a, b in zip(split, whole) if a is not None)


def test_bf16_matches_the_reference_computed_in_fp32():
    args = ffn_args("swiglu", 16, 32, bias=True, dtype=torch.bfloat16)
    probe = torch.randn(args[0].shape[0], 16, dtype=torch.bfloat16)
    got = grads_of(torch.ops.moe.expert_ffn, args, probe)
    fp32 = [a.detach().float().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    want = grads_of(dialect.expert_ffn_ref, fp32, probe.float())
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2)


def test_no_rows_at_all_gives_zero_weight_gradients():
    args = ffn_args("swiglu", 16, 32, bias=True, counts=torch.zeros(4, dtype=torch.int64))
    y, *grads = grads_of(torch.ops.moe.expert_ffn, args, torch.randn(0, 16))
    assert y.shape == (0, 16)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_engine_choice():
    x, w = torch.randn(8, 16), torch.randn(3, 16, 8)
    assert grouped_ffn.grouped_mm_ok(x, w)
    assert grouped_ffn.grouped_mm_ok(x, w.transpose(-2, -1).contiguous().transpose(-2, -1))
    assert not grouped_ffn.grouped_mm_ok(x.double(), w.double())  # dtype
    assert not grouped_ffn.grouped_mm_ok(torch.randn(8, 6), torch.randn(3, 6, 8))  # 24-byte rows: unaligned
    assert not grouped_ffn.grouped_mm_ok(x, w.bfloat16())  # mixed dtypes


def _backward_log(block, x):
    y = block(x)
    probe = torch.randn_like(y)
    loss = (y * probe).sum()
    with OpLog() as log:
        loss.backward()
    return log


@pytest.mark.parametrize("style", ["fused", "loop"])
def test_one_backward_allocates_each_expert_weight_gradient_once(style):
    """The O(E^2) pattern (a zero-filled full-size [E, ...] gradient per expert) must not come back."""
    torch.manual_seed(0)
    E, D, F = 8, 32, 64
    block = FusedMoE(D, F, E, 2) if style == "fused" else LoopMoE(D, F, E, 2)
    compiled = moepass.compile(block, moepass.Plan(form="single"))
    log = _backward_log(compiled, torch.randn(2, 16, D, requires_grad=True))  # N = 64 rows: activations < weights
    full = E * F * D * 4  # bytes of one [E, F, D] fp32 weight
    big = [(e.name, e.input_shapes) for e in log.events if e.self_cpu_memory_usage >= full]
    # grad_w_gate, grad_w_up, grad_w_down once each; where the block stores gate and up in one tensor,
    # the op takes it whole and writes its [E, 2F, D] gradient at once. Never one buffer per expert.
    assert len(big) == (2 if style == "fused" else 3), big
    fills = [(e.name, e.input_shapes) for e in log.events
             if e.name in ("aten::fill_", "aten::zero_") and _numel(e.input_shapes[0]) >= E * F * D // 4]
    assert not fills, fills
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in log.events)
    weight_bytes = sum(p.numel() * 4 for p in compiled.parameters())
    assert allocated < 4 * weight_bytes, (allocated, weight_bytes)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_expert_recompute_keeps_fewer_activations_and_the_same_gradients():
    torch.manual_seed(0)
    block = FusedMoE(32, 64, 4, 2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved_bytes, grads = {}, {}
    for recompute in (False, True):
        cm = moepass.compile(block, moepass.Plan(form="single", expert_recompute=recompute))
        passes = [h["pass"] for h in cm.history]
        assert ("expert_recompute" in passes) == recompute
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = cm(x)
        (y * y).sum().backward()
        saved_bytes[recompute] = total
        grads[recompute] = [p.grad.clone() for p in cm.parameters()]
    rows = 2 * 16 * 2  # N = T * K
    assert saved_bytes[False] - saved_bytes[True] == 2 * rows * 64 * 4  # h_gate, h_up: 2 * N * F fp32
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_modulelist_experts_are_read_in_place_not_stacked_each_step():
    torch.manual_seed(0)
    block = LoopMoE(32, 64, 4, 2)
    compiled = moepass.compile(block, moepass.Plan(form="single"))
    # compile's copy of the block laid w1, w3, w2 of the 4 experts out (one buffer each): nothing left to move
    assert compiled.history[1]["stats"] == {"relaid_expert_params": 0}
    assert list(compiled.state_dict()) == list(block.state_dict())
    x = torch.randn(2, 8, 32)
    with OpLog() as log:
        y = compiled(x)
    assert log.count("aten::stack") == 0 and log.count("aten::cat") == 0
    torch.testing.assert_close(y, block(x), rtol=1e-5, atol=1e-6)
    # a dtype change (nn.Module._apply) lays the experts out again: still read in place, still exact
    compiled.double()
    with OpLog() as log:
        y64 = compiled(x.double())
    assert log.count("aten::stack") == 0 and log.count("aten::cat") == 0
    torch.testing.assert_close(y64, block.double()(x.double()))
    # a parameter re-allocated behind the module's back: the read falls back to a copy, still exact
    w = next(p for n, p in compiled.named_parameters() if n.startswith("experts.1."))
    with torch.no_grad():
        w.data = w.data.clone()
    with OpLog() as log:
        y64 = compiled(x.double())
    assert log.count("aten::cat") + log.count("aten::stack") >= 1
    torch.testing.assert_close(y64, block(x.double()))


def test_the_cost_model_prices_expert_recompute():
    from cost_model.search import Pricing, search
    from moepass.runtime.topology import Topology

    block = FusedMoE(64, 128, 8, 2)
    kept, again = (search(moepass.detect(block).blocks, Topology(1, 2), (4, 64), profile="a100",
                          pricing=Pricing(recompute=r)) for r in (False, True))
    single = [next(c for c in res.ranked if c.form == "single") for res in (kept, again)]
    # gated experts: 3 forward GEMMs; recomputing gate and up adds 2 of them to the 9 of fwd+bwd (the per-layer
    # formula's expert compute); the timeline the search ranks by prices the step with it, dense compute included
    assert float(single[1].formula.compute / single[0].formula.compute) == pytest.approx((3 + 2 / 3) / 3)
    assert float(single[1].terms.compute) > float(single[0].terms.compute)


def test_a_compiled_modulelist_block_pickles_and_still_reads_in_place():
    import pickle

    torch.manual_seed(0)
    block = LoopMoE(16, 32, 4, 2)
    compiled = moepass.compile(block, moepass.Plan(form="single"))
    again = pickle.loads(pickle.dumps(compiled))
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(again(x), block(x), rtol=1e-5, atol=1e-6)
    targets = [n.target for n in again.graph.nodes if n.op == "call_function"]
    assert targets.count(moepass.canonical.stack_experts) == 3 and torch.stack not in targets


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("D,F,engine", ENGINES)
def test_fused_gate_up_equals_separate_gate_and_up(activation, D, F, engine, monkeypatch):
    """w_gate [E, 2F, D] without w_up (Hugging Face's gate_up_proj): the same function, one GEMM each way."""
    use_engine(engine, monkeypatch)
    x, counts, wg, wu, wd, *_, act, clamp, alpha = ffn_args(activation, D, F, bias=False)
    fused = torch.cat([wg.detach(), wu.detach()], 1).requires_grad_()
    probe = torch.randn(x.shape[0], D)
    for recompute in (False, True):
        y_sep = torch.ops.moe.expert_ffn(x, counts, wg, wu, wd, None, None, None, act, clamp, alpha, recompute)
        g_sep = torch.autograd.grad((y_sep * probe).sum(), [x, wg, wu, wd])
        y = torch.ops.moe.expert_ffn(x, counts, fused, None, wd, None, None, None, act, clamp, alpha, recompute)
        g = torch.autograd.grad((y * probe).sum(), [x, fused, wd])
        torch.testing.assert_close(y, y_sep, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g[0], g_sep[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g[1], torch.cat([g_sep[1], g_sep[2]], 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g[2], g_sep[3], rtol=1e-5, atol=1e-6)


def _grads_after(block, xs, zero_between, monkeypatch, reuse):
    monkeypatch.setattr(grouped_ffn, "GRAD_BUFFER_BYTES", 0 if reuse else 1 << 62)
    seen = []
    for x in xs:
        if zero_between:
            block.zero_grad(set_to_none=True)
        block(x).pow(2).sum().backward()
        seen.append({n: p.grad for n, p in block.named_parameters()})  # the .grad objects themselves, kept
    return seen


@pytest.mark.parametrize("style", ["fused", "loop"])
@pytest.mark.parametrize("zero_between", [False, True], ids=["accumulate", "set_to_none"])
def test_reused_weight_gradient_buffers_give_the_same_gradients_and_never_overwrite_a_kept_one(
        style, zero_between, monkeypatch):
    """`grouped_ffn.reusable_grad_buffer` (on for every size here): gradients accumulated over micro-batches
    and after `zero_grad(set_to_none=True)` equal, bit for bit, those of fresh buffers; a `.grad` the caller
    kept from an earlier step keeps its values; a block called twice in one step gets the sum."""
    torch.manual_seed(0)
    E, D, F = 4, 16, 32
    block = FusedMoE(D, F, E, 2) if style == "fused" else LoopMoE(D, F, E, 2)
    compiled = [moepass.compile(copy.deepcopy(block), moepass.Plan(form="single")) for _ in range(2)]
    xs = [torch.randn(2, 8, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fresh = _grads_after(compiled[0], xs, zero_between, monkeypatch, reuse=False)
    reused = _grads_after(compiled[1], xs, zero_between, monkeypatch, reuse=True)
    fresh_values = [{n: g.clone() for n, g in step.items()} for step in fresh]
    for step_fresh, step_reused in zip(fresh_values, reused):
        for name, g in step_fresh.items():
            assert torch.equal(step_reused[name], g), name  # the kept objects: not overwritten since
    twice = compiled[1]
    twice.zero_grad(set_to_none=True)
    (twice(xs[0]).pow(2).sum() + twice(xs[1]).pow(2).sum()).backward()
    once = compiled[0]
    monkeypatch.setattr(grouped_ffn, "GRAD_BUFFER_BYTES", 1 << 62)
    separate = []
    for x in xs[:2]:
        once.zero_grad(set_to_none=True)
        once(x).pow(2).sum().backward()
        separate.append({n: p.grad.clone() for n, p in once.named_parameters()})
    for name, p in twice.named_parameters():
        torch.testing.assert_close(p.grad, separate[0][name] + separate[1][name])


def test_a_released_weight_gradient_buffer_is_reused_and_a_held_one_is_not(monkeypatch):
    monkeypatch.setattr(grouped_ffn, "GRAD_BUFFER_BYTES", 0)
    w, shape = torch.randn(4, 8, 16), (4, 16, 8)
    first = grouped_ffn.reusable_grad_buffer(w, shape)
    second = grouped_ffn.reusable_grad_buffer(w, shape)  # `first` still held: a new buffer
    assert second.data_ptr() != first.data_ptr()
    ptr = second.data_ptr()
    del first, second
    third = grouped_ffn.reusable_grad_buffer(w, shape)  # released: the same memory again
    assert third.data_ptr() == ptr and third.shape == shape
    param = torch.nn.Parameter(torch.randn(shape))
    param.grad = third  # what AccumulateGrad does with a gradient it can take as `.grad`
    del third
    assert grouped_ffn.reusable_grad_buffer(w, shape).data_ptr() != ptr  # a live .grad is never overwritten
    param.grad = None  # zero_grad(set_to_none=True)
    monkeypatch.setattr(grouped_ffn, "GRAD_BUFFER_BYTES", 1 << 62)
    assert grouped_ffn.reusable_grad_buffer(w, shape) is None  # small: the caller allocates
    monkeypatch.setattr(grouped_ffn, "GRAD_BUFFER_BYTES", 0)
    assert grouped_ffn.reusable_grad_buffer(w.to("meta"), shape) is None
