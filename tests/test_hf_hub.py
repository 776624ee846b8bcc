"""The whole Hub (issue 27 item 6): every MoE family of the installed transformers that moepass compiles
exactly under `Plan(form="single")` today keeps doing so, and detection never raises on a family that builds.

Families, tiny configs and the parity check: `samples/hf_hub.py`; the table: docs/HF_FAMILIES.md
(`python benchmarks/hf_hub.py`). `EXACT` is that table's "exact under single" rows: a family listed here
that regresses (rejected, not reported, a crash, a parity difference) fails its test, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from samples import hf_hub as H  # noqa: E402

# exact under single on transformers 5.23 (docs/HF_FAMILIES.md): detection + fp32 parity of the eval output,
# the train loss and every parameter gradient. Some guard a detection rule no other test reaches: kolibri1 (a
# selection bias held as a buffer), cohere2_moe (softmax over the top-k logits), laguna (a selection bias read
# through a dtype cast; a constant scaling the combined output), step3p5 (an overridden `_apply_gate`), beam and
# minimax_m3_vl_text (both of the last two),
# nemotron_h (a parameter-free module called on the tokens is no shared expert), phimoe (sparsemixer: rounds of
# `max`, its router module's own selection called as it is), openai_privacy_filter (a router module returning
# softmax / K, the block's output times K: `RouterSpec.selection_scale`), axk1 (a norm on the block's output,
# `MoESpec.output_module`), dbrx (expert weights stored flattened [E·F, D]: `TensorSource.unflatten`; gate / up
# and down read in opposite orientations), llama4_text (routing weights on the experts' input, a [T, D] return,
# a sigmoid over the top-k logits, its nn.Linear-subclass router called as it is), switch_transformers (an
# expert no token reaches: None against zero, `hf_hub.UNROUTED`), inkling2_text (a softcapped SwiGLU, its caps the
# constants of the graph's `tanh(v / c)` calls), gemma4_text and diffusion_gemma_text (router and experts inline in
# the decoder layer beside attention: the region outlined from the traced layer, `moepass.detect.outline`; the
# experts' own input norm, `MoESpec.input_module`; gated GELU-tanh experts),
# inkling_text (a shared-expert sink: a router over E + 1 selecting
# among E, the sink's weight handed to the shared expert, `SharedExpertSpec.router_outputs`), nllb-moe (its router
# module's dispatch ids read as they are, its optional padding mask passed through; detected on its own batch),
# jetmoe (its attention experts left alone, `BlockReport.left_alone`; its MoE MLP rewritten), zaya (a router called
# by keyword with the previous layer's router state, which the block returns: `ROUTER_OUTPUT`; a skip expert).
EXACT = (
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_ocr2_text",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffusion_gemma_text", "dots1", "ernie4_5_moe",
    "exaone_moe", "flex_olmo", "flint", "gemma4_text", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text",
    "glm5_next_text", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_text", "inkling_text", "jamba", "jetmoe",
    "kimi_linear", "kolibri1", "laguna", "lfm2_moe", "llama4_text", "mellum", "mimo_v2_flash", "minimax",
    "minimax_m2", "minimax_m3_vl_text", "mistral4", "mistral_large4_text", "mixtral", "nemotron_h", "nllb-moe",
    "olmoe", "openai_privacy_filter", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next",
    "qwen3_omni_moe_text", "qwen3_vl_moe_text", "solar_open", "step3p5", "switch_transformers",
    "unlimited_ocr_text", "zaya",
)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "HF_FAMILIES.md"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one thread is faster than two, and far faster when the cores are shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def families() -> dict[str, H.Family]:
    return {f.model_type: f for f in H.moe_families()}


_OUTCOMES: dict[str, H.Outcome] = {}  # family -> its full evaluation, shared by the tests of this module


def _outcome(family: H.Family) -> H.Outcome:
    if family.model_type not in _OUTCOMES:
        _OUTCOMES[family.model_type] = H.evaluate(family)
    return _OUTCOMES[family.model_type]


def test_enumeration_finds_the_families_by_their_config():
    found = {f.model_type: f for f in H.moe_families()}
    assert set(EXACT) <= set(found)
    assert {"mixtral", "switch_transformers", "dbrx", "phimoe", "gpt_oss"} <= set(found)
    assert found["llama4"].covered_by == "llama4_text" and found["llama4_text"].covered_by is None
    assert found["dbrx"].expert_field == "ffn_config.moe_num_experts"
    assert "llama" not in found and "bert" not in found  # dense model types declare no expert count


def test_count_routed_sees_each_selection(families):
    model, batch = H.build(families["mixtral"])
    assert H.count_routed(model, batch) == {f"model.layers.{i}.mlp.gate": "topk" for i in range(H.LAYERS)}


def test_the_docs_table_lists_these_families_as_exact():
    rows = [line.split("|") for line in DOCS.read_text().splitlines() if line.startswith("| ")]
    assert sorted(r[1].strip() for r in rows if r[6].strip() == "exact under single") == sorted(EXACT), \
        "docs/HF_FAMILIES.md and EXACT disagree: run `python benchmarks/hf_hub.py` and update EXACT"


@pytest.mark.parametrize("family", EXACT)
def test_exact_under_single(family, families):
    out = _outcome(families[family])
    assert out.verdict == "exact under single", (
        f"{family} regressed to {out.verdict}: {out.why_not_built or out.crash or out.parity} "
        f"rejected={out.rejected} not_reported={out.not_reported}")
    assert out.expected >= 1 and len(out.accepted) >= 1


@pytest.mark.slow  # every family that builds (a minute here); the exact ones reuse their evaluation
def test_detect_never_raises_on_a_built_family(families):
    """Every family that builds tiny: `moepass.detect` returns a report (a block it cannot read is rejected
    with its reason, never an exception)."""
    raised = {}
    for name, family in families.items():
        if family.covered_by is not None:
            continue
        out = _OUTCOMES.get(name) or H.evaluate(family, compile_=False)
        if out.crash.startswith("detect raised"):
            raised[name] = out.crash
    assert not raised, raised


def test_a_router_linear_subclass_is_a_router_module(families):
    """Llama-4's router subclasses nn.Linear with its own forward (top-k logits, their sigmoid scattered over E,
    and the logits): it is called as it is (`logits_from="module"`, its hooks fire), never read as a plain
    Linear; its weights multiply the experts' input."""
    import moepass

    model, _ = H.build(families["llama4_text"])
    report = moepass.detect(model)
    assert not report.rejected and len(report.blocks) == H.LAYERS, report.summary()
    for spec in report.blocks:
        assert (spec.router.logits_from, spec.router.module_path, spec.router.score_func) == (
            "module", "router", "sigmoid"), spec.summary()
        assert (spec.weights_on, spec.flat_output, spec.side_outputs) == ("input", True, ("router_logits",))


def test_only_attention_experts_are_left_alone(families):
    """jetmoe is exact with its attention-expert blocks left as they are (not rewritten): those, and nothing else,
    are the blocks detection leaves alone by design."""
    out = _outcome(families["jetmoe"])
    assert out.verdict == "exact under single", (out.rejected, out.parity, out.crash)
    assert sorted(out.left_alone) == ["model.layers.0.self_attention", "model.layers.1.self_attention"]
    assert all("mixture of attention experts" in why for why in out.left_alone.values()), out.left_alone
    assert sorted(out.accepted) == ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_widths_build_the_moe_block_at_the_given_sizes(family, families):
    """`hf_hub.Widths` (the never-slower benchmark's layer case): the detected block has exactly D, F, E and K;
    the tiny build keeps its own sizes."""
    import moepass

    widths = H.Widths(D=96, F=160, E=8, K=3)
    for given, want in ((widths, (96, 160, 8, 3)), (None, (32, 16 if family == "deepseek_v3" else 48, H.E, H.K))):
        model, batch = H.build(families[family], seed=0, widths=given)
        spec = moepass.detect(model, example_inputs=batch).blocks[0]
        assert (spec.experts.hidden_dim, spec.experts.ffn_dim, spec.router.num_experts, spec.router.top_k) == want
