"""Inspecting rewritten graphs: moepass.diff, moepass.draw, set_debug / MOEPASS_DEBUG, and a golden
snapshot of `explain` for the sample (regenerate with MOEPASS_UPDATE_GOLDEN=1 after a deliberate change).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from _golden import check_golden
from torch import fx

import moepass
from moepass import inspect as I
from samples.models import FusedMoE, LoopMoE, tiny_mixtral

GOLDEN = pathlib.Path(__file__).parent / "golden" / "explain_sample.txt"
ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def sample():
    torch.manual_seed(0)
    model = tiny_mixtral()
    return model, moepass.compile(model, moepass.Plan())


def test_explain_sample_matches_golden(sample):
    # measured errors depend on the BLAS build: the snapshot keeps their place, not their digits
    check_golden(GOLDEN, lambda: re.sub(r"max error [0-9.e+-]+", "max error <err>",
                                        moepass.explain(sample[0], moepass.Plan())) + "\n")


def test_diff_of_block_and_its_rewritten_graph(sample):
    model, cm = sample
    text = moepass.diff(model.layers[0].mlp, cm.layers[0].mlp, example_inputs=(torch.randn(2, 5, 64),))
    head = text.splitlines()[:3]
    assert head[0].startswith("graph diff:")
    for op in ("moe.route.default x1", "moe.permute.default x1", "moe.expert_ffn.default x1", "moe.combine.default x1"):
        assert op in head[2], head
    assert "+route = moe.route.default(logits_f32, None, 'softmax', True, 2, True" in text
    assert moepass.diff(cm.layers[0].mlp, cm.layers[0].mlp).endswith("(same nodes)")


def test_diff_of_a_block_fx_cannot_trace_records_its_forward():
    """A loop over experts (a data-dependent `if`) does not trace with torch.fx: its forward is recorded as detection
    records it, whole (no Dynamo fragments), on hidden states of the rewritten block's width or on example_inputs."""
    block = LoopMoE(16, 32, num_experts=4, top_k=2)
    text = moepass.diff(block, moepass.compile(block))
    assert "moe.expert_ffn.default x1" in text and "linear x12" in text.splitlines()[1]  # 4 experts x 3 linears
    assert "note: before recorded on hidden states [2, 8, 16] (the rewritten block's width)" in text
    text = moepass.diff(block, moepass.compile(block), example_inputs=(torch.randn(2, 3, 16),))
    assert "note: before recorded on example_inputs" in text and "moe.route.default x1" in text


def test_draw_svg_is_xml_and_png_renders(sample, tmp_path):
    _, cm = sample
    dot_file = moepass.draw(cm, str(tmp_path / "model.dot"))  # needs no graphviz
    source = pathlib.Path(dot_file).read_text()
    assert "layers.0.mlp" in source and I.PASS_COLOURS["canonical"] in source and "moe.route.default" in source
    if shutil.which("dot") is None:
        pytest.skip("graphviz `dot` is not installed (apt-get install graphviz): SVG/PNG rendering not checked")
    svg = moepass.draw(cm, str(tmp_path / "model.svg"))
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert "route" in "".join(root.itertext())
    png = pathlib.Path(moepass.draw(cm.layers[1].mlp, str(tmp_path / "block.png")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_draw_labels_communication_nodes_through_the_hook():
    graph = fx.Graph()
    x = graph.placeholder("x")
    sent = graph.call_function(torch.ops._c10d_functional.all_to_all_single.default, (x, [2, 2], [2, 2], "0"))
    sent.meta["moepass"] = {"pass": "rewrite:ep", "bytes": 3 * 2**20}
    done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (sent,))
    graph.output(done)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    labels = {n.get_name(): n.get("label") for c in I.to_dot(gm).get_subgraphs() for n in c.get_nodes()}
    assert "3.00 MiB" in labels["g0_all_to_all_single_default"] and "bytes: run-time" in labels["g0_wait_tensor_default"]

    def predicted(node):
        return (None, 0.0025) if node.name == "all_to_all_single_default" else None

    labels = {n.get_name(): n.get("label") for c in I.to_dot(gm, annotate=predicted).get_subgraphs()
              for n in c.get_nodes()}
    assert "3.00 MiB | 2.500 ms predicted" in labels["g0_all_to_all_single_default"]


def test_set_debug_logs_each_pass_after_import(capsys):
    block = FusedMoE(16, 32, num_experts=4, top_k=2)
    moepass.set_debug(True)
    try:
        moepass.compile(block)
    finally:
        moepass.set_debug(False)
    err = capsys.readouterr().err
    assert "moepass: rewrite:single [<root>]" in err and " ms " in err
    moepass.compile(block)
    assert "rewrite:single" not in capsys.readouterr().err


@pytest.mark.parametrize("value, logs", [("1", True), ("0", False)])
def test_moepass_debug_environment_variable(value, logs):
    """MOEPASS_DEBUG=1 in a fresh process logs each pass; MOEPASS_DEBUG=0 logs nothing."""
    code = ("import torch, moepass; from samples.models import FusedMoE; "
            "moepass.compile(FusedMoE(16, 32, num_experts=4, top_k=2))")
    env = {**os.environ, "MOEPASS_DEBUG": value, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if logs:
        assert "rewrite:single [<root>]" in done.stderr
    else:
        assert "rewrite:single" not in done.stderr, done.stderr[-2000:]
