"""Hugging Face transformers 5.x MoE families: detection, `compile(form="single")` parity, side outputs.

Tiny random-init models (samples/hf_models.py; no weights are downloaded). For each family: the
exact number of MoE blocks is detected by the family's router recogniser, and the compiled model
matches the original in fp32: logits (eval), the train-mode loss with `output_router_logits=True`
(aux / z losses from the router logits recorded by transformers' output hooks), the recorded router
logits themselves, and every parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch

import moepass
from samples import hf_models as H

pytest.importorskip("transformers")

# family -> (recogniser, RouterSpec.dtype observed from the HF source's behaviour)
FAMILIES = {
    "mixtral": ("hf-softmax-topk", "input"),
    "qwen2_moe": ("hf-softmax-topk", "input"),
    "qwen3_moe": ("hf-softmax-topk", "input"),  # Qwen2/OLMoE's router under another class name: no new code
    "olmoe": ("hf-softmax-topk", "input"),
    "deepseek_v3": ("hf-group-limited", "float32"),
    "switch": ("hf-top1-capacity", "float32"),
}
# family -> (MoE block paths, dense FFN paths), read off the tiny configs of samples/hf_models.py: every
# decoder layer's mlp is MoE, except DeepSeek-V3's first (first_k_dense_replace=1); Switch has 2 encoder
# and 2 decoder blocks with every 2nd sparse (encoder/decoder_sparse_step=2), so block 1 of each stack is
# MoE and block 0 a dense T5 FFN (layer 1 of an encoder block, layer 2 of a decoder block).
_DECODER = ["model.layers.0.mlp", "model.layers.1.mlp"]
LAYOUT = {
    "mixtral": (_DECODER, []),
    "qwen2_moe": (_DECODER, []),
    "qwen3_moe": (_DECODER, []),
    "olmoe": (_DECODER, []),
    "deepseek_v3": (["model.layers.1.mlp", "model.layers.2.mlp"], ["model.layers.0.mlp"]),
    "switch": (["decoder.block.1.layer.2.mlp", "encoder.block.1.layer.1.mlp"],
               ["decoder.block.0.layer.2.mlp", "encoder.block.0.layer.1.mlp"]),
}
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", autouse=True)
def _verify():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEPASS_VERIFY", "1")  # the verifier runs after every pass
        yield


@pytest.fixture(scope="module")
def built():
    """family key -> (model, batch, compiled model), each built once for the module."""
    cache: dict = {}

    def get(family: str, **config_kw):
        key = (family, tuple(sorted(config_kw.items())))
        if key not in cache:
            model, batch = H.build(family, **config_kw)
            cache[key] = (model, batch, moepass.compile(model, moepass.Plan(form="single")))
        return cache[key]

    return get


def _train_step(model, batch, seed: int = 0):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()
    return out


def _router_logits(out) -> list[torch.Tensor]:
    found = []
    for name in ("router_logits", "encoder_router_logits", "decoder_router_logits"):
        value = getattr(out, name, None)
        if value is not None:
            found.extend(value)
    return found


def _assert_train_parity(model, compiled, batch):
    ref, got = _train_step(model, batch), _train_step(compiled, batch)
    torch.testing.assert_close(got.loss, ref.loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.logits, ref.logits, rtol=RTOL, atol=ATOL)
    for name in ("aux_loss", "encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss"):
        a, b = getattr(ref, name, None), getattr(got, name, None)
        assert (a is None) == (b is None), name
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=name)
    ref_logits, got_logits = _router_logits(ref), _router_logits(got)
    assert len(ref_logits) == len(got_logits) > 0, "router logits are recorded through the router module's hooks"
    for a, b in zip(ref_logits, got_logits):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    ref_params, got_params = dict(model.named_parameters()), dict(compiled.named_parameters())
    assert ref_params.keys() == got_params.keys()
    for name, p in ref_params.items():
        q = got_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_detect_and_compile_parity(family, built):
    model, batch, compiled = built(family)
    report = compiled.moepass_info.report
    recogniser, dtype = FAMILIES[family]
    assert len(report.blocks) == H.MOE_BLOCKS[family], report.summary()
    assert not report.rejected, report.summary()
    assert {s.recogniser for s in report.blocks} == {recogniser}
    assert all(s.router.logits_from == "module" and s.router.dtype == dtype for s in report.blocks)
    assert sorted(compiled.moepass_info.rewritten) == sorted(s.path for s in report.blocks)
    moe_paths, dense_paths = LAYOUT[family]
    assert sorted(s.path for s in report.blocks) == moe_paths, report.summary()
    assert sorted(report.dense) == dense_paths, report.summary()

    with torch.no_grad():
        model.eval(), compiled.eval()
        torch.testing.assert_close(compiled(**batch).logits, model(**batch).logits, rtol=RTOL, atol=ATOL)
    _assert_train_parity(model, compiled, batch)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_load_balancing_loss_set_in_the_config_keeps_the_blocks(family):
    """`config.output_router_logits=True` (Hugging Face's auxiliary loss, computed in the model's forward from
    every layer's router logits with a top-k of its own): that top-k is no MoE block of the whole model; the
    layers' blocks are found and rewritten, and the loss with its aux_loss trains as the model's."""
    model, batch = H.build(family)
    model.config.output_router_logits = True
    compiled = moepass.compile(model, moepass.Plan(form="single"))
    report = compiled.moepass_info.report
    assert sorted(s.path for s in report.blocks) == LAYOUT[family][0] and not report.rejected, report.summary()
    assert sorted(compiled.moepass_info.rewritten) == LAYOUT[family][0]
    _assert_train_parity(model, compiled, batch)


def test_deepseek_spec_reads_the_router(built):
    _, _, compiled = built("deepseek_v3")
    for spec in compiled.moepass_info.report.blocks:
        r = spec.router
        assert (r.score_func, r.n_group, r.topk_group, r.routed_scaling_factor, r.renormalize) == \
            ("sigmoid", 4, 2, 2.5, True)
        assert r.selection_bias is not None and r.selection_bias.paths == ("gate.e_score_correction_bias",)
        assert spec.shared is not None and spec.shared.module_path == "shared_experts"
    check = compiled.moepass_info.report.details[0].check
    assert check is not None and check.group_sensitive_tokens > 0  # group-limited top-k was exercised


def test_switch_spec_keeps_capacity_and_drops(built):
    _, _, compiled = built("switch")
    for spec in compiled.moepass_info.report.blocks:
        assert spec.top_k == 1 and spec.experts.activation == "relu"
        c = spec.capacity
        assert c is not None and (c.fixed, c.scope, c.drop_policy) == (3, "sequence", "zero")


@pytest.mark.parametrize("family", ["mixtral", "switch"])
def test_train_mode_jitter_reproduced(family, built):
    """Mixtral jitters the block input (canonical.jitter, same draw); Switch jitters inside its router
    module, which the graph calls. Same seed -> same loss and gradients."""
    model, batch, compiled = built(family, jitter=0.1)
    specs = compiled.moepass_info.report.blocks
    assert len(specs) == H.MOE_BLOCKS[family]
    if family == "mixtral":
        assert all(s.router.jitter_eps == 0.1 for s in specs)
    else:
        assert all(s.router.jitter_eps == 0.0 and "jitter" in " ".join(s.notes) for s in specs)
    _assert_train_parity(model, compiled, batch)
    m1, m2 = _train_step(model, batch, seed=0).loss, _train_step(model, batch, seed=1).loss
    assert not torch.equal(m1, m2), "jitter is active in train mode"


def test_switch_expert_dropout_is_rejected_with_reason():
    model, _ = H.build("switch", dropout=0.1)
    report = moepass.detect(model)
    assert len(report.blocks) == 0 and len(report.rejected) == 2
    for _path, reason in report.rejected:
        assert "dropout p=0.1" in reason and "dropout_rate=0" in reason, reason
    compiled = moepass.compile(model, report=report)
    assert not compiled.moepass_info.rewritten  # left untouched


@pytest.mark.parametrize("family", list(FAMILIES))
def test_explain_lists_blocks_and_dense_layers(family, built):
    model, _, compiled = built(family)
    text = moepass.explain(model, graphs=False)
    recogniser, _ = FAMILIES[family]
    for spec in compiled.moepass_info.report.blocks:
        assert f"{spec.path}: {recogniser}:" in text
        # each block's section, or its one line when it repeats an earlier identical block (explain folds them)
        assert f"== {spec.path} (" in text or f"== {spec.path}: same as " in text, text
    for path in LAYOUT[family][1]:
        assert f"{path}: dense FFN, not MoE" in text


class LegacyTupleBlock(torch.nn.Module):
    """A transformers 4.x-style block: returns (hidden_states, router_logits)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts

    def forward(self, hidden_states: torch.Tensor):
        B, S, D = hidden_states.shape
        x_TD = hidden_states.view(-1, D)
        router_logits, weights_TK, experts_TK = self.gate(x_TD)
        return self.experts(x_TD, experts_TK, weights_TK).view(B, S, D), router_logits


def test_tuple_output_block(built):
    """A block returning (hidden, router_logits) gets the side output; without it the spec is rejected."""
    from moepass.detect.check import check_specs

    model, _, _ = built("mixtral")
    block = LegacyTupleBlock(model.model.layers[0].mlp)
    report = moepass.detect(block)
    assert len(report.blocks) == 1, report.summary()
    spec = report.blocks[0]
    assert spec.side_outputs == ("router_logits",)
    good, miss = check_specs(block, [spec, spec.replace(side_outputs=())])
    assert good.accepted and not miss.accepted and "returns 1 value(s)" in miss.reason, miss.reason

    compiled = moepass.compile(block)
    x = torch.randn(2, 5, 32, requires_grad=True)
    ref, got = block(x), compiled(x)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    (ref[0].sum() + ref[1].square().sum()).backward()
    grad_ref = x.grad.clone()
    x.grad = None
    (got[0].sum() + got[1].square().sum()).backward()
    torch.testing.assert_close(x.grad, grad_ref, rtol=RTOL, atol=ATOL)


def test_detection_leaves_the_global_rng_alone(built):
    """Seeded jitter parity relies on it: detecting (probes, train-mode check) draws from its own generators."""
    model, _, _ = built("mixtral", jitter=0.1)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert len(moepass.detect(model).blocks) == H.MOE_BLOCKS["mixtral"]
    assert torch.equal(torch.rand(3), expected)
