"""torch.compile(model, backend="moepass"): MoE regions of Dynamo graphs rewritten to the dialect, with
outputs and gradients equal to the original model; compiled models keep one graph (fullgraph=True).

fp32 tolerances: rtol 1e-4, atol 1e-5 (Dynamo and AOT reorder reductions; the rewrite itself is exact
within fp32 rounding). Inner compiler "aot_eager" unless stated: it runs AOT autograd (the graph the
backend returns is differentiated) without inductor's C++ build cost.
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import moepass
from moepass import backend as B
from moepass import dialect
from samples import hf_models
from samples.models import ExpertMLP, FusedMoE, SampleConfig, TinyMoELM, tiny_mixtral

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    B.reset()
    yield
    torch._dynamo.reset()


def backend_options(inner="aot_eager", **plan):
    return {"plan": moepass.Plan(**plan), "inner": inner}


def assert_parity(model, compiled, loss_fn, trained=None):
    """Loss and every parameter gradient of `compiled` equal those of an untouched copy of `model`.

    `trained` owns the parameters `compiled` runs on: `model` itself, or the result of moepass.compile.
    """
    reference = copy.deepcopy(model)
    loss = loss_fn(compiled)
    loss.backward()
    loss_ref = loss_fn(reference)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    grads = dict(reference.named_parameters())
    for name, p in (model if trained is None else trained).named_parameters():
        if grads[name].grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{name} got no gradient through the backend"
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def lm_loss(model, tokens):
    """TinyMoELM.loss through `model.__call__` (an OptimizedModule's `.loss` would run uncompiled)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def regions(action):
    return [r for report in B.reports() for r in report.regions if r.action == action]


class GraphCounter:
    """A backend counting Dynamo graphs, then running them through aot_eager (so gradients are checked)."""

    def __init__(self):
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)


# ----------------------------------------------------------------------------------------------
# Registration and options.
# ----------------------------------------------------------------------------------------------


def test_backend_is_registered_and_declared_as_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    assert "moepass" in torch._dynamo.list_backends()
    assert lookup_backend("moepass") is B.moepass_backend
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert points["moepass"].value == "moepass.backend:moepass_backend"
    assert points["moepass"].load() is B.moepass_backend


def test_unknown_option_raises_plan_error():
    compiled = torch.compile(ExpertMLP(8, 16), backend="moepass", options={"plna": moepass.Plan()})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, 8))
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, moepass.PlanError) and "'plan'" in str(err)


# ----------------------------------------------------------------------------------------------
# (a) MoE regions of Dynamo graphs are rewritten: the sample blocks and Hugging Face families.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["fused", "gshard"])
def test_sample_parity_and_regions_rewritten(style):
    model = TinyMoELM(SampleConfig(style=style, layers=2))
    compiled = torch.compile(model, backend="moepass", options=backend_options())
    tokens = torch.randint(0, 256, (2, 9))
    assert_parity(model, compiled, lambda m: lm_loss(m, tokens))
    report = B.last_report()
    assert [r.path for r in regions("rewritten")] == ["layers.0.mlp", "layers.1.mlp"], report.summary()
    assert B.COUNTERS["regions_rewritten"] == 2 and B.COUNTERS["regions_passthrough"] == 0
    assert all(r.nodes_removed > 0 and r.nodes_added > 0 for r in report.regions)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("style", ["fused", "gshard"])
def test_symbolic_sizes_keep_the_rewrite(style, dynamic):
    """Sequence lengths that change (Dynamo's automatic dynamic shapes on the second one, or dynamic=True): the
    size arithmetic Dynamo shares between layers (`mul = s0 * s1`) stays in the graph, the blocks are still
    rewritten, and every step equals the model's own."""
    model = TinyMoELM(SampleConfig(style=style, layers=2))
    compiled = torch.compile(model, backend="moepass", options=backend_options(), dynamic=dynamic)
    for batch, length in [(2, 9), (3, 6), (1, 11)]:
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 256, (batch, length))
        assert_parity(model, compiled, lambda m, t=tokens: lm_loss(m, t))
    assert B.COUNTERS["regions_passthrough"] == 0, [r.summary() for r in B.reports()]
    assert B.COUNTERS["regions_rewritten"] == 2 * B.COUNTERS["graphs"] >= 4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_hf_symbolic_sizes_keep_the_rewrite(family):
    """The same for Hugging Face models with dynamic=True (its blocks reshape by sizes Dynamo shares)."""
    model, _ = hf_models.build(family)
    compiled = torch.compile(model, backend="moepass", options=backend_options(), dynamic=True)
    for batch, length in [(2, 8), (3, 5)]:
        model.zero_grad(set_to_none=True)
        ids = torch.randint(1, hf_models.VOCAB, (batch, length))
        assert_parity(model, compiled, lambda m, ids=ids: m(input_ids=ids, labels=ids).loss)
    assert B.COUNTERS["regions_passthrough"] == 0, [r.summary() for r in B.reports()]
    assert B.COUNTERS["regions_rewritten"] == hf_models.MOE_BLOCKS[family] * B.COUNTERS["graphs"] > 0


def test_a_compiled_forward_attribute_is_detected_without_entering_dynamo_again():
    """Hugging Face's recipe `model.forward = torch.compile(model.forward, ...)`: detection records the model
    through its own forward (not the compiled one, which would trace detection's spies: one graph per spy call),
    and the compiled forward is back afterwards."""
    import torch._dynamo.utils as dynamo_utils

    model = TinyMoELM(SampleConfig(style="fused", layers=2))
    reference = copy.deepcopy(model)
    compiled_forward = torch.compile(model.forward, backend="moepass", options=backend_options())
    model.forward = compiled_forward
    dynamo_utils.counters.clear()
    tokens = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=RTOL, atol=ATOL)
    assert model.forward is compiled_forward
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert [r.path for r in regions("rewritten")] == ["layers.0.mlp", "layers.1.mlp"], B.last_report().summary()


class SoftcappedRouterMoE(torch.nn.Module):
    """Fused 3-D experts computed by gathering each token's K expert weights (one Dynamo graph), routed by
    inline code no known rule describes: soft-capped logits with a learnable cap (a traced router)."""

    def __init__(self, D=16, F=24, E=4, K=2):
        super().__init__()
        self.top_k = K
        self.gate = torch.nn.Linear(D, E, bias=False)
        self.softcap = torch.nn.Parameter(torch.tensor(2.0))
        self.w1 = torch.nn.Parameter(torch.randn(E, F, D) * 0.1)
        self.w3 = torch.nn.Parameter(torch.randn(E, F, D) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(E, D, F) * 0.1)

    def forward(self, h):
        x_TD = h.reshape(-1, h.shape[-1])
        logits_TE = self.softcap * torch.tanh(self.gate(x_TD) / self.softcap)
        weights_TK, experts_TK = logits_TE.float().softmax(-1).topk(self.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        w1, w3, w2 = self.w1[experts_TK], self.w3[experts_TK], self.w2[experts_TK]
        h_TKF = F.silu(torch.einsum("tkfd,td->tkf", w1, x_TD)) * torch.einsum("tkfd,td->tkf", w3, x_TD)
        y_TKD = torch.einsum("tkdf,tkf->tkd", w2, h_TKF)
        return (y_TKD * weights_TK[..., None]).sum(1).view_as(h)


def test_traced_router_block_is_rewritten_with_parity():
    """A block whose inline router runs as traced code (`logits_from="traced"`) is rewritten by the backend
    too: one region, outputs and every gradient (the learnable cap's included) as the block's own."""
    torch.manual_seed(0)
    block = SoftcappedRouterMoE()
    (spec,) = moepass.detect(block).blocks
    assert spec.router.logits_from == "traced"
    compiled = torch.compile(block, backend="moepass", options=backend_options())
    x = torch.randn(2, 5, 16)
    assert_parity(block, compiled, lambda m: (m(x) * x.cos()).sum())
    assert [r.path for r in regions("rewritten")] == [""] and B.COUNTERS["regions_passthrough"] == 0
    assert block.softcap.grad is not None and block.softcap.grad.abs() > 0


def test_new_sequence_length_recompiles_with_dynamic_shapes_and_rewrites_again():
    model = TinyMoELM(SampleConfig(style="fused", layers=1))
    compiled = torch.compile(model, backend="moepass", options=backend_options())
    for length in (9, 13, 17):  # the second shape makes Dynamo mark the sequence dim dynamic
        tokens = torch.randint(0, 256, (2, length))
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=RTOL, atol=ATOL)
    assert len(B.reports()) == 2 and [r.rewritten for r in B.reports()] == [1, 1]
    assert any(n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in B.last_graph().graph.nodes), "the second graph has a symbolic size input"


@pytest.mark.parametrize("family,implementation", [
    ("mixtral", "grouped_mm"),
    ("mixtral", "batched_mm"),
    ("qwen2_moe", "grouped_mm"),
    ("deepseek_v3", "grouped_mm"),
])
def test_hf_parity_and_regions_rewritten(family, implementation):
    model, batch = hf_models.build(family)
    model.set_experts_implementation(implementation)
    seen: list[fx.GraphModule] = []

    def inner(gm, example_inputs):  # the graph the backend hands on: dialect ops instead of the HF MoE
        seen.append(gm)
        return GraphCounter()(gm, example_inputs)

    compiled = torch.compile(model, backend="moepass", options={"inner": inner})
    assert_parity(model, compiled, lambda m: m(**batch).loss)
    rewritten = regions("rewritten")
    assert len(rewritten) == hf_models.MOE_BLOCKS[family], B.last_report().summary()
    assert len(seen) == 1, "one Dynamo graph"
    targets = [n.target for n in seen[0].graph.nodes]
    assert targets.count(dialect.EXPERT_FFN) == targets.count(dialect.ROUTE) == hf_models.MOE_BLOCKS[family]
    if implementation == "grouped_mm":  # the HF expert kernels are gone from the graph
        assert not any("grouped_mm" in str(t) for t in targets)


def test_block_split_by_graph_breaks_passes_through_with_reason(caplog):
    """The loop-style sample breaks Dynamo's graph inside the block: nothing is rewritten, and it says why."""
    model = TinyMoELM(SampleConfig(style="loop", layers=1))
    compiled = torch.compile(model, backend="moepass", options=backend_options())
    tokens = torch.randint(0, 256, (2, 9))
    with caplog.at_level(logging.WARNING, logger="moepass"):
        assert_parity(model, compiled, lambda m: lm_loss(m, tokens))
    assert not regions("rewritten")
    passed = regions("passthrough")
    assert passed and {r.path for r in passed} == {"mlp"}  # relative to the frame: DecoderLayer.forward
    assert {report.frame for report in B.reports() if report.regions} == {"DecoderLayer"}
    assert all("graph break" in r.reason and "moepass.compile" in r.reason for r in passed)
    assert "graph break" in caplog.text


def test_unrecognised_graph_comes_back_unchanged_with_diagnostic():
    dense = ExpertMLP(8, 16)
    x = torch.randn(3, 8)
    plain: list[str] = []
    torch.compile(dense, backend=lambda gm, ex: plain.append(gm.code) or gm.forward)(x)
    torch._dynamo.reset()
    through: list[str] = []
    compiled = torch.compile(dense, backend="moepass",
                             options={"inner": lambda gm, ex: through.append(gm.code) or gm.forward})
    torch.testing.assert_close(compiled(x), dense(x))
    assert through == plain
    report = B.last_report()
    assert report.nodes_before == report.nodes_after and not report.changed
    assert "no MoE block in this graph" in report.diagnostics

    # Outside Dynamo (a plain FX graph) the module objects are unknown: unchanged, and said so.
    gm = fx.symbolic_trace(dense)
    code = gm.code
    fn = B.moepass_backend(gm, [x], options={"inner": "eager"})
    assert gm.code == code
    torch.testing.assert_close(fn(x), dense(x))
    assert "not called from a Dynamo compilation" in B.last_report().diagnostics[0]


def test_a_block_whose_compile_fails_passes_through_with_the_exception(monkeypatch):
    """The backend never raises on a model: a block whose compilation raises runs as it is, the reason kept."""
    import moepass.pipeline

    def fails(spec, block, plan, **_):
        raise RuntimeError("no kernel for this block")

    monkeypatch.setattr(moepass.pipeline, "compile_block", fails)
    block = FusedMoE(16, 32, num_experts=4, top_k=2)
    compiled = torch.compile(block, backend="moepass", options=backend_options())
    x = torch.randn(2, 5, 16)
    assert_parity(block, compiled, lambda m: m(x).square().sum())
    (passed,) = regions("passthrough")
    assert passed.reason == "compiling the block failed: RuntimeError: no kernel for this block"
    assert not regions("rewritten")


def test_distributed_form_on_unsharded_model_raises_plan_error():
    block = FusedMoE(16, 32, num_experts=4, top_k=2)
    compiled = torch.compile(block, backend="moepass", options=backend_options(form="ep"))
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 5, 16))
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, moepass.PlanError), repr(info.value)
    assert "moepass.compile(model" in str(err) and "form='ep'" in str(err)


# ----------------------------------------------------------------------------------------------
# (b) + item 2: a model compiled by moepass.compile is one graph, dialect ops opaque and intact.
# ----------------------------------------------------------------------------------------------


def test_compiled_sample_is_one_graph_and_backend_keeps_dialect():
    model = tiny_mixtral()  # loop style: Dynamo alone breaks inside every block
    tokens = torch.randint(0, 256, (2, 9))
    raw = GraphCounter()
    torch.compile(copy.deepcopy(model), backend=raw)(tokens)
    assert len(raw.graphs) > 1, "the loop-style sample breaks Dynamo's graph by itself"
    torch._dynamo.reset()

    cm = moepass.compile(model, moepass.Plan())
    counter = GraphCounter()
    assert_parity(model, torch.compile(cm, backend=counter, fullgraph=True), lambda m: lm_loss(m, tokens), cm)
    assert len(counter.graphs) == 1
    torch._dynamo.reset()

    seen: list[fx.GraphModule] = []
    compiled = torch.compile(cm, backend="moepass", fullgraph=True,
                             options={"inner": lambda gm, ex: seen.append(gm) or counter(gm, ex)})
    torch.testing.assert_close(lm_loss(compiled, tokens), lm_loss(model, tokens), rtol=RTOL, atol=ATOL)
    kept = regions("kept")
    assert [r.path for r in kept] == ["layers.0.mlp", "layers.1.mlp"] and not regions("rewritten")
    (gm,) = seen
    dialect_nodes = [n for n in gm.graph.nodes if dialect.is_dialect_op(n.target)]
    assert len(dialect_nodes) == 2 * 5  # route, permute, expert_ffn, unpermute, combine per block


def test_compiled_hf_mixtral_eager_experts_is_one_graph():
    """transformers' eager experts give 12 Dynamo graphs; after moepass.compile, one (fullgraph=True)."""
    model, batch = hf_models.build("mixtral")
    model.set_experts_implementation("eager")
    raw = GraphCounter()
    torch.compile(copy.deepcopy(model), backend=raw)(**batch)
    assert len(raw.graphs) == 12
    torch._dynamo.reset()
    cm = moepass.compile(model, moepass.Plan())
    counter = GraphCounter()
    assert_parity(model, torch.compile(cm, backend=counter, fullgraph=True), lambda m: m(**batch).loss, cm)
    assert len(counter.graphs) == 1
    targets = [n.target for n in counter.graphs[0].graph.nodes]
    assert targets.count(dialect.EXPERT_FFN) == hf_models.MOE_BLOCKS["mixtral"]


# ----------------------------------------------------------------------------------------------
# The one inductor test.
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_inductor_inner_on_sample():
    model = TinyMoELM(SampleConfig(style="fused", layers=1))
    compiled = torch.compile(model, backend="moepass", options=backend_options(inner="inductor"))
    tokens = torch.randint(0, 256, (2, 9))
    assert_parity(model, compiled, lambda m: lm_loss(m, tokens))
    assert [r.path for r in regions("rewritten")] == ["layers.0.mlp"]
