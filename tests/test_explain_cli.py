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
    assert text.count("torch.ops.moe_comm.all_to_all.default") == 4  # dispatch + combine, 2 blocks
    assert "'local_experts': 1, 'ep_size': 64" in text
    assert not dist.is_initialized()  # explain leaves no process group behind
