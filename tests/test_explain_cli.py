"""explain never raises and says what it found; the CLI demo runs end to end."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import moepass
from samples.models import LoopMoE, SampleConfig, TinyMoELM

ROOT = Path(__file__).resolve().parents[1]


def test_explain_lists_blocks_recogniser_check_and_graph():
    text = moepass.explain(TinyMoELM(SampleConfig(style="mixed", layers=4, dense_layers=1)))
    assert "3 MoE block(s) accepted, 0 rejected" in text
    for path, recogniser in [("layers.1.mlp", "fused-3d"), ("layers.2.mlp", "gshard-capacity"),
                             ("layers.3.mlp", "modulelist-loop")]:
        assert f"== {path} (" in text and f"recogniser: {recogniser}" in text
    assert "layers.0.mlp: dense FFN, not MoE" in text
    assert "semantic check: accepted (max error" in text
    assert "torch.ops.moe.expert_ffn.default" in text


class Broken(LoopMoE):
    def forward(self, hidden_states):
        raise RuntimeError("boom")


def test_explain_never_raises():
    assert "invalid plan" in moepass.explain(nn.Linear(2, 2), "not a plan")  # type: ignore[arg-type]
    text = moepass.explain(nn.Sequential(Broken(8, 16, 4, 2)))
    assert "REJECTED" in text and "boom" in text
    assert "0 MoE block(s) accepted" in moepass.explain(nn.Linear(4, 4))


def test_explain_marks_blocks_left_alone():
    text = moepass.explain(TinyMoELM(SampleConfig(style="loop", layers=2)),
                           moepass.Plan(blocks={"layers.0.mlp": None}))
    assert "plan: left alone (Plan.blocks)" in text


def test_cli_demo_runs_and_reports_parity():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "moepass", "demo", "--steps", "2", "--no-ep"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PARITY OK" in out.stdout and "3 MoE block(s) accepted" in out.stdout


def test_cli_explain_loads_a_callable():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "moepass", "explain", "samples.models:tiny_mixtral"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 MoE block(s) accepted" in out.stdout


def test_compiled_model_deepcopies_and_its_state_dict_loads_into_the_original():
    """deepcopy, not pickle: pickling is claimed nowhere, and today a rewritten block's GraphModule does
    not survive pickle.loads (fx re-traces its code; `canonical.stack_experts` branches on its inputs)."""
    model = TinyMoELM(SampleConfig(style="mixed", layers=3))
    compiled = moepass.compile(model)
    tokens = torch.randint(0, 256, (2, 9))
    copied = copy.deepcopy(compiled)
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    assert all(a is not b for a, b in zip(copied.parameters(), compiled.parameters()))  # a copy, not an alias
    torch.testing.assert_close(copied(tokens), compiled(tokens), rtol=0, atol=0)
    fresh = TinyMoELM(SampleConfig(style="mixed", layers=3))
    fresh.load_state_dict(compiled.state_dict())
    torch.testing.assert_close(fresh(tokens), compiled(tokens), rtol=1e-5, atol=1e-6)


def test_explain_a_distributed_form_without_a_cluster():
    import torch.distributed as dist

    from samples.models import tiny_mixtral

    text = moepass.explain(tiny_mixtral(num_experts=64), moepass.Plan(form="ep", topology=moepass.Topology(8, 8)))
    assert "fake process group at world size 64" in text
    assert text.count("torch.ops.moe_comm.all_to_all.default") == 2  # dispatch + combine, the 2 blocks folded
    assert "== layers.1.mlp: same as layers.0.mlp (1 block(s); semantic check accepted on each" in text
    assert "'local_experts': 1, 'ep_size': 64" in text
    assert not dist.is_initialized()  # explain leaves no process group behind


def test_explain_folds_identical_blocks():
    """16 identical layers: the first block in full, the other 15 in one line (498 lines before, one graph per
    block); a block that differs (another top-k) is shown in full."""
    from samples.models import tiny_mixtral

    model = tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=16, heads=4)
    text = moepass.explain(model)
    assert text.count("class MoEGraphModule") == 1 and len(text.splitlines()) < 80
    assert "== layers.{1-15}.mlp: same as layers.0.mlp (15 block(s); semantic check accepted on each, max error " \
           in text
    model.layers[3].mlp.top_k = 1  # now different from the others: its own section
    text = moepass.explain(model, graphs=False)
    assert "== layers.3.mlp (LoopMoE) ==" in text
    assert "== layers.{1,2,4,5,6,7,8,9,10,11,12,13,14,15}.mlp: same as layers.0.mlp (14 block(s)" in text


def test_diff_of_a_hugging_face_block_needs_no_example_inputs():
    transformers = __import__("pytest").importorskip("transformers")
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    cm = moepass.compile(model)
    text = moepass.diff(model.model.layers[0].mlp, cm.model.layers[0].mlp)
    removed, added = text.splitlines()[1:3]
    assert "topk x1" in removed and "softmax x1" in removed
    assert "moe.route.default x1" in added and "moe.expert_ffn.default x1" in added
    assert "note: before recorded on hidden states [2, 8, 32] (the rewritten block's width)" in text


def test_draw_without_pydot_says_how_to_install_it(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setitem(sys.modules, "pydot", None)  # `import pydot` raises ImportError
    cm = moepass.compile(LoopMoE(16, 32, num_experts=4, top_k=2))
    with pytest.raises(ImportError, match=r"moepass.draw needs pydot, which is not installed: pip install pydot "
                                          r"\(or pip install 'moepass\[draw\]'\)"):
        moepass.draw(cm, str(tmp_path / "block.dot"))


def test_hp_conversion_warns_and_its_checkpoint_is_the_new_blocks():
    """compile(form='hp') on a standard block replaces it by a fresh Multi-Head LatentMoE: a UserWarning names each
    block and the new shape (explain says the same); the checkpoint holds the new block's parameters, so it does
    not load into the original model nor under form='ep' (what USER_GUIDE's HP section says). A model built as a
    Multi-Head LatentMoE keeps its math under HP: no warning."""
    import warnings

    import pytest
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from samples.models import tiny_latent_lm, tiny_mixtral

    model = tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=2, heads=4)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.warns(UserWarning, match=r"moepass.compile changed the math of 2 block\(s\), as the plan names: "
                                             r"'layers.0.mlp', 'layers.1.mlp': changed \(fresh Multi-Head LatentMoE, "
                                             r"named by Plan.form='hp'\), Multi-Head LatentMoE H=4 h=8"):
            hp = moepass.compile(model, moepass.Plan(form="hp"))
        state = moepass.logical_state_dict(hp)
        assert "layers.0.mlp.w_in.weight" in state and "layers.0.mlp.experts.0.w1.weight" not in state
        with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"layers.0.mlp.gate.weight\""):
            model.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()})
        with pytest.raises(KeyError, match=r"load_logical_state_dict: missing keys"):
            moepass.load_logical_state_dict(moepass.compile(model, moepass.Plan(form="ep")), state)
        latent = tiny_latent_lm(heads=4, head_dim=8, experts=4, top_k=2, latent_ffn_dim=16, vocab_size=64, dim=32,
                                layers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moepass.compile(latent, moepass.Plan(form="hp"))
    finally:
        dist.destroy_process_group()
    assert "(changes the model's math in 2 block(s), as the plan names" in moepass.explain(
        model, moepass.Plan(form="hp"), graphs=False)
    assert "changes the model's math" not in moepass.explain(latent, moepass.Plan(form="hp"), graphs=False)


def test_a_capacity_on_a_dropless_block_is_a_named_math_change():
    """Plan(capacity_factor=...) under EP drops tokens of a block that drops none: compile warns as for the other
    math-changing plans, and explain marks it and says the factor and how C is made."""
    import pytest
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from samples.models import tiny_mixtral

    model = tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=2)
    plan = moepass.Plan(form="ep", capacity_factor=1.5)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.warns(UserWarning, match=r"moepass.compile changed the math of 2 block\(s\), as the plan names: "
                                             r"'layers.0.mlp', 'layers.1.mlp': changed: Plan.capacity_factor=1.5 drops "
                                             r"each \(source rank, expert\)'s assignments beyond C = ceil\(1.5\*T\*K/E\) "
                                             r"where the block is dropless"):
            moepass.compile(model, plan)
        text = moepass.explain(model, plan, graphs=False)
    finally:
        dist.destroy_process_group()
    assert "(changes the model's math in 2 block(s), as the plan names: see each 'math')" in text.splitlines()[0]
    assert "'capacity': 'factor 1.5 per (source rank, expert)'" in text
    assert "changes the model's math" not in moepass.explain(model, moepass.Plan(form="ep"), graphs=False)


def test_heads_that_cannot_act_on_a_latent_block_are_refused():
    """form='hp' keeps a Multi-Head LatentMoE's own heads: other heads / head_dim raise naming both; the block's
    own values are accepted."""
    import pytest
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from samples.models import tiny_latent_lm

    latent = tiny_latent_lm(heads=4, head_dim=8, experts=4, top_k=2, latent_ffn_dim=16, vocab_size=64, dim=32, layers=1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(moepass.PlanError, match=r"^Plan.heads=8, Plan.head_dim=2 cannot act on block "
                                                    r"'layers.0.mlp': it is a Multi-Head LatentMoE already, with "
                                                    r"heads=4 and head_dim=8, which form='hp' keeps; leave heads and "
                                                    r"head_dim unset"):
            moepass.compile(latent, moepass.Plan(form="hp", heads=8, head_dim=2))
        moepass.compile(latent, moepass.Plan(form="hp", heads=4, head_dim=8))  # its own values: accepted
    finally:
        dist.destroy_process_group()
    assert "compile of this block would fail: PlanError: Plan.heads=8 cannot act" in moepass.explain(
        latent, moepass.Plan(form="hp", heads=8), graphs=False)
