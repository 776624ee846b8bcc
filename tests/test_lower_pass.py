"""The lower pass (moepass/lower.py): dialect nodes -> generated Triton kernels, end to end.

Kernels run interpreted (TRITON_INTERPRET=1, set by conftest before `lowering` is imported), so the
models are tiny. fp32 tolerances: outputs rtol 1e-5 / atol 1e-6; parameter gradients within 1e-4 of
the largest reference gradient of the same parameter (measured: see `max_relative_grad_error`).
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx

import moepass
from moepass import canonical, dialect
from moepass.lower import lower_pass, sources
from moepass.verify import violations
from samples.models import LoopMoE, SampleConfig, TinyMoELM

OUT_RTOL, OUT_ATOL = 1e-5, 1e-6
GRAD_REL = 1e-4
PER_BLOCK = {"gating": 1, "permute": 1, "grouped_gemm": 1, "combine": 1}  # every family, once per block
NONE_LOWERED = dict.fromkeys(PER_BLOCK, 0)
LOWERED_OPS = [  # the MoE ops of one lowered block, in graph order
    "moe_lowered.route", "moe_lowered.permute", "moe_lowered.expert_ffn", "moe_lowered.unpermute_combine",
]


@pytest.fixture(autouse=True)
def _verify_every_pass(monkeypatch):
    monkeypatch.setenv("MOEPASS_VERIFY", "1")


@pytest.fixture(scope="module")
def tiny_lm():
    """Three MoE layers, one per sample style: loop, fused (+ shared expert), gshard (capacity); detected once."""
    torch.manual_seed(0)
    model = TinyMoELM(SampleConfig(style="mixed", layers=3, vocab_size=32, dim=16, ffn_dim=32, num_experts=4,
                                   top_k=2, heads=2))
    return model, moepass.detect(model)


def tiny_mixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=64)
    return transformers.MixtralForCausalLM(cfg)


def lower_stats(compiled) -> dict[str, dict]:
    out = {}
    for path, gm in compiled.moepass_info.rewritten.items():
        (record,) = [h for h in gm.history if h["pass"] == "lower"]
        out[path] = record["stats"]
    return out


def moe_ops(gm: fx.GraphModule) -> list[str]:
    return [str(n.target).rsplit(".", 1)[0] for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) in ("moe", "moe_lowered")]


def max_relative_grad_error(model, compiled) -> float:
    grads = dict(compiled.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        got = grads[name].grad
        assert got is not None, f"{name} got no gradient"
        scale = p.grad.abs().max().item() or 1.0
        worst = max(worst, (got - p.grad).abs().max().item() / scale)
    return worst


@pytest.fixture
def kernel_launches(monkeypatch):
    """Count fallbacks of the lowered ops and launches of the grouped-GEMM kernels (forward, backward)."""
    from lowering import codegen, grouped_gemm

    fallbacks = (codegen.FALLBACKS,)
    before = [dict(f) for f in fallbacks]
    launches = {"expert_ffn_forward": 0, "expert_ffn_backward": 0}
    for name in launches:
        real = getattr(grouped_gemm, name)

        def spy(*args, _real=real, _name=name):
            launches[_name] += 1
            return _real(*args)

        monkeypatch.setattr(grouped_gemm, name, spy)
    yield launches
    assert [dict(f) for f in fallbacks] == before, "a lowered op fell back to its torch reference"


# ----------------------------------------------------------------------------------------------
# End to end: Plan(lowering="triton"), interpreted, equals the reference model.
# ----------------------------------------------------------------------------------------------


def test_tiny_lm_lowered_equals_reference_outputs_and_gradients(tiny_lm, kernel_launches):
    model, report = tiny_lm
    model.zero_grad(set_to_none=True)
    compiled = moepass.compile(model, moepass.Plan(lowering="triton"), report=report)
    stats = lower_stats(compiled)
    assert list(stats) == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
    for path, s in stats.items():
        assert s["lowered"] == PER_BLOCK, path
        assert s["declined"] == {}, path
        expected = LOWERED_OPS[:1] + ["moe.capacity_keep"] * (path == "layers.2.mlp") + LOWERED_OPS[1:]  # gshard
        expected += ["moe.autocast_output"] * (path != "layers.0.mlp")  # fused, gshard: bf16 out under autocast
        assert moe_ops(compiled.moepass_info.rewritten[path]) == expected, path

    tokens = torch.randint(0, 32, (2, 9))
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=OUT_RTOL, atol=OUT_ATOL)
    loss_ref, loss = model.loss(tokens), compiled.loss(tokens)
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=OUT_RTOL, atol=OUT_ATOL)
    worst = max_relative_grad_error(model, compiled)
    print(f"max relative gradient error: {worst:.3g}")
    assert worst <= GRAD_REL
    assert kernel_launches == {"expert_ffn_forward": 2 * 3, "expert_ffn_backward": 3}  # 2 forwards of 3 blocks


def test_hf_mixtral_lowered_equals_reference_outputs_and_gradients(kernel_launches):
    model = tiny_mixtral()
    report = moepass.detect(model)
    if [s.path for s in report.blocks] != ["model.layers.0.mlp"]:
        pytest.skip(f"moepass.detect does not accept the tiny HF Mixtral yet: {report.summary()}")
    compiled = moepass.compile(model, moepass.Plan(lowering="triton"), report=report)
    assert lower_stats(compiled) == {"model.layers.0.mlp": {"mode": "triton", "lowered": PER_BLOCK, "declined": {}}}

    tokens = torch.randint(0, 64, (2, 7))
    out_ref = model(tokens, labels=tokens)
    out = compiled(tokens, labels=tokens)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=OUT_RTOL, atol=OUT_ATOL)
    out_ref.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=OUT_RTOL, atol=OUT_ATOL)
    worst = max_relative_grad_error(model, compiled)
    print(f"max relative gradient error: {worst:.3g}")
    assert worst <= GRAD_REL
    assert kernel_launches == {"expert_ffn_forward": 1, "expert_ffn_backward": 1}


# ----------------------------------------------------------------------------------------------
# Plan.lowering: torch and auto (on CPU) lower nothing; triton without the interpreter is a PlanError.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_torch_and_cpu_auto_lower_nothing_and_say_why(tiny_lm, mode):
    model, report = tiny_lm
    compiled = moepass.compile(model, moepass.Plan(lowering=mode), report=report)
    for path, s in lower_stats(compiled).items():
        assert s["lowered"] == NONE_LOWERED, path
        assert f"Plan.lowering={mode!r}" in s["declined"]["*"]
        assert not any(op.startswith("moe_lowered") for op in moe_ops(compiled.moepass_info.rewritten[path]))
    if mode == "auto":
        assert "on cpu" in s["declined"]["*"] and "TRITON_INTERPRET=1" in s["declined"]["*"]
    tokens = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=OUT_RTOL, atol=OUT_ATOL)


def test_triton_on_cpu_without_the_interpreter_is_a_plan_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # triton reads it at each launch decision
    with pytest.raises(moepass.PlanError, match=r"lowering='triton'.*TRITON_INTERPRET=1.*before importing"):
        moepass.compile(LoopMoE(dim=8, ffn_dim=16, num_experts=4, top_k=2), moepass.Plan(lowering="triton"))


# ----------------------------------------------------------------------------------------------
# The pass itself: declines with a reason, provenance, verifier, explain.
# ----------------------------------------------------------------------------------------------


def canonical_block(**kw):
    block = LoopMoE(dim=8, ffn_dim=16, num_experts=4, top_k=2, **kw)
    (spec,) = moepass.detect(block).blocks
    return canonical.build(spec, block)


def test_combine_declines_when_the_unpermute_has_another_user():
    gm = canonical_block()
    (unpermute,) = [n for n in gm.graph.nodes if n.target is dialect.UNPERMUTE]
    with gm.graph.inserting_after(unpermute):
        extra = gm.graph.call_function(torch.sum, (unpermute,))
    extra.meta["moepass"] = {"pass": "test"}
    result = lower_pass(gm, moepass.Plan(lowering="triton"))
    assert result.changed
    assert result.stats["lowered"] == {**PER_BLOCK, "combine": 0}
    assert result.stats["declined"]["combine"] == (
        "out_TD: its input y_TKD has other users ['sum_1']; the fused moe.unpermute -> moe.combine needs it alone")
    assert moe_ops(gm)[-2:] == ["moe.unpermute", "moe.combine"]


def test_lowered_nodes_record_provenance_and_pass_the_verifier():
    gm = canonical_block()
    before = {n.name for n in gm.graph.nodes}
    result = lower_pass(gm, moepass.Plan(lowering="triton"))
    gm.history.append({"pass": "lower", "stats": result.stats})
    assert violations(gm) == []
    new = {n.name: n.meta["moepass"] for n in gm.graph.nodes if n.name not in before}
    assert {name: m["family"] for name, m in new.items()} == {
        "route_lowered": "gating", "permute_lowered": "permute", "y_ND_lowered": "grouped_gemm",
        "out_TD_lowered": "combine"}
    assert all(m["pass"] == "lower" for m in new.values())
    assert new["out_TD_lowered"]["replaces"] == ["y_TKD (moe.unpermute)", "out_TD (moe.combine)"]


def test_verifier_pairs_the_lowered_permute_with_the_fused_inverse():
    gm = canonical_block()
    lower_pass(gm, moepass.Plan(lowering="triton"))
    gm.history.append({"pass": "lower"})
    assert violations(gm) == []
    (fused,) = [n for n in gm.graph.nodes if "unpermute_combine" in str(n.target)]
    (permute,) = [n for n in gm.graph.nodes if str(n.target) == "moe_lowered.permute.default"]
    broken = copy.deepcopy(gm)  # the fused inverse reads an order that no permute made
    (b_fused,) = [n for n in broken.graph.nodes if n.name == fused.name]
    with broken.graph.inserting_before(b_fused):
        fake_order = broken.graph.call_function(torch.arange, (b_fused.args[1],))
    fake_order.meta["moepass"] = {"pass": "test"}
    b_fused.update_arg(1, fake_order)
    rules = {(v.rule, v.node) for v in violations(broken)}
    assert ("V3 pairing", permute.name) in rules  # its order now feeds no inverse
    assert ("V3 pairing", fused.name) in rules  # and the inverse's order comes from no permute
    assert all(u.target is operator.getitem for u in permute.users)


def test_explain_shows_lowered_counts_and_generated_sources():
    text = moepass.explain(LoopMoE(dim=8, ffn_dim=16, num_experts=4, top_k=2), moepass.Plan(lowering="triton"),
                           graphs=False, sources=True)
    assert "'lowered': {'gating': 1, 'permute': 1, 'grouped_gemm': 1, 'combine': 1}" in text
    for name, family in [("route_lowered", "gating"), ("permute_lowered", "permute"),
                         ("y_ND_lowered", "grouped_gemm"), ("out_TD_lowered", "combine")]:
        assert f"generated Triton source of node {name} ({family})" in text
    assert text.count("@triton.jit") >= 4 and "def route_kernel(" in text


def test_sources_match_the_registry_for_each_lowered_node():
    gm = canonical_block()
    lower_pass(gm, moepass.Plan(lowering="triton"))
    found = sources(gm)
    assert [(name, family) for name, family, _ in found] == [
        ("route_lowered", "gating"), ("permute_lowered", "permute"), ("y_ND_lowered", "grouped_gemm"),
        ("out_TD_lowered", "combine")]
    assert all("import triton" in text for _, _, text in found)


def test_ep_graph_on_the_fake_process_group_lowers_both_permutes_and_verifies():
    """EP at W=4 (graph only): the local permute is lowered too; the lone K=1 unpermute stays dialect."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import reset_groups
    from samples.models import tiny_mixtral as sample_mixtral

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        model = sample_mixtral(style="fused", vocab_size=32, dim=16, ffn_dim=16, num_experts=8, top_k=2, layers=1)
        plan = moepass.Plan(form="ep", topology=moepass.Topology(2, 2), lowering="triton")
        compiled = moepass.compile(model, plan)  # MOEPASS_VERIFY=1: the verifier runs after the lower pass
        assert lower_stats(compiled)["layers.0.mlp"]["lowered"] == {**PER_BLOCK, "permute": 2}
        assert moe_ops(compiled.layers[0].mlp) == [
            "moe_lowered.route", "moe_lowered.permute", "moe_lowered.permute", "moe_lowered.expert_ffn",
            "moe.unpermute", "moe_lowered.unpermute_combine", "moe.autocast_output"]  # fused: bf16 under autocast
    finally:
        dist.destroy_process_group()
        reset_groups()
