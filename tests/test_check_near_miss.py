"""The semantic check can fail: a near-miss spec of a real block is rejected, with a reason.

Each case takes the spec detection accepted for one block of a tiny Hugging Face model, changes one
thing (`spec.replace` / `dataclasses.replace`), and checks both on the same probe inputs: the
accepted spec passes, the near miss is rejected and its reason names what differs.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import moepass
from moepass.detect.check import MIN_GROUP_TOKENS, check_specs
from moepass.spec import MoESpec
from samples import hf_models as H

pytest.importorskip("transformers")

SELECTION = "tokens select different experts"
OUTPUTS = "outputs differ"


def _router(**changes):
    return lambda s: s.replace(router=replace(s.router, **changes))


def _capacity(**changes):
    return lambda s: s.replace(capacity=replace(s.capacity, **changes))


# kind of miss -> (family, built with, spec change, words the reason must contain)
CASES = {
    "renormalisation dropped": ("mixtral", {}, _router(renormalize=False), OUTPUTS),
    "renormalisation added": ("olmoe", {}, _router(renormalize=True), OUTPUTS),
    "softmax after top-k instead of before": ("olmoe", {}, _router(softmax_before_topk=False), OUTPUTS),
    "selection bias forgotten": ("deepseek_v3", {}, _router(selection_bias=None), SELECTION),
    "selection bias used as a weight bias": (
        "deepseek_v3", {}, lambda s: s.replace(router=replace(s.router, bias=s.router.selection_bias,
                                                                 selection_bias=None, logits_from="linear")),
        SELECTION),
    "groups ignored": ("deepseek_v3", {}, _router(n_group=1, topk_group=1), SELECTION),
    "routed scaling forgotten": ("deepseek_v3", {}, _router(routed_scaling_factor=1.0), OUTPUTS),
    "softmax instead of sigmoid": ("deepseek_v3", {}, _router(score_func="softmax"), SELECTION),
    "wrong top-k": ("qwen2_moe", {}, _router(top_k=3), "selects 3 experts per token"),
    "shared expert forgotten": ("qwen2_moe", {}, lambda s: s.replace(shared=None), OUTPUTS),
    "shared expert gate forgotten": ("qwen2_moe", {}, lambda s: s.replace(shared=replace(s.shared, gate_path=None)),
                                     OUTPUTS),
    "capacity ignored": ("switch", {}, lambda s: s.replace(capacity=None), OUTPUTS),
    "capacity counted over the batch": ("switch", {}, _capacity(scope="batch"), OUTPUTS),
    "dropped tokens passed through": ("switch", {}, _capacity(drop_policy="identity"), OUTPUTS),
    "jitter forgotten": ("mixtral", {"jitter": 0.1}, _router(jitter_eps=0.0), "train-mode outputs differ"),
    "router module not called (logits not recorded)": (
        "mixtral", {}, _router(logits_from="linear"), "is called 0x by the graph"),
}


@pytest.fixture(scope="module")
def blocks():
    """(family, config) -> (model, its accepted specs), each built and detected once."""
    cache: dict = {}

    def get(family: str, config: dict):
        key = (family, tuple(sorted(config.items())))
        if key not in cache:
            model, _ = H.build(family, **config)
            report = moepass.detect(model)
            assert len(report.blocks) == H.MOE_BLOCKS[family], report.summary()
            cache[key] = (model, report.blocks)
        return cache[key]

    return get


@pytest.mark.parametrize("kind", list(CASES))
def test_near_miss_is_rejected(kind, blocks):
    family, config, change, words = CASES[kind]
    model, specs = blocks(family, config)
    spec: MoESpec = specs[0]
    near_miss = change(spec)
    assert near_miss != spec
    good, miss = check_specs(model.get_submodule(spec.path), [spec, near_miss])
    assert good.accepted, good.reason
    assert not miss.accepted, f"near miss '{kind}' was accepted: {miss.describe()}"
    assert words in miss.reason, miss.reason


def test_groups_are_exercised(blocks):
    """The probe inputs include tokens where group-limited top-k differs from plain top-k."""
    model, specs = blocks("deepseek_v3", {})
    for spec in specs:
        (result,) = check_specs(model.get_submodule(spec.path), [spec])
        assert result.accepted and result.group_sensitive_tokens >= MIN_GROUP_TOKENS


def test_probe_scaling_when_the_model_has_none(blocks):
    """A model whose routed_scaling_factor is 1 is probed at 2.5, yet the accepted spec keeps 1."""
    model, _ = H.build("deepseek_v3")
    for layer in model.model.layers[1:]:
        layer.mlp.gate.routed_scaling_factor = 1.0
    report = moepass.detect(model)
    assert len(report.blocks) == 2
    spec = report.blocks[0]
    assert spec.router.routed_scaling_factor == 1.0
    assert model.model.layers[1].mlp.gate.routed_scaling_factor == 1.0  # the user's block is untouched
    wrong = _router(routed_scaling_factor=2.5)(spec)
    good, miss = check_specs(model.get_submodule(spec.path), [spec, wrong])
    assert good.accepted and not miss.accepted


def test_near_ties_are_reprobed_not_compared(blocks):
    """Two experts with identical router rows tie on every token: those tokens are left out of the
    selection comparison (and more probes are drawn), the spec is still accepted."""
    model, specs = blocks("mixtral", {})
    tied = copy.deepcopy(model.get_submodule(specs[0].path))
    with torch.no_grad():
        tied.gate.weight[1] = tied.gate.weight[0]
    (result,) = check_specs(tied, [specs[0]])
    assert result.accepted, result.reason
    probed = 3 * 24
    assert 0 < result.compared_tokens, result.describe()
    assert result.compared_tokens != probed  # near-tie tokens were excluded, extra probes drawn
