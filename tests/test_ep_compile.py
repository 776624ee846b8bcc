"""torch.compile over an expert-parallel model (W=2, gloo): one graph, no breaks, same numbers.

The EP graph's count exchange, issue/wait all-to-alls and grouped FFN are opaque custom ops with
fake implementations, so Dynamo captures each rank's whole model as one graph (fullgraph=True), and
aot_eager trains through it with the same loss and gradients as eager EP.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

pytestmark = pytest.mark.distributed
CFG = dict(vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=2, heads=4)


def case_fullgraph(rank, world, style):
    import torch._dynamo

    import moepass
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    cm = moepass.compile(tiny_mixtral(style=style, **CFG),
                         moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
    tokens = torch.randint(0, CFG["vocab_size"], (world * 2, 9), generator=torch.Generator().manual_seed(1))
    mine = tokens[rank * 2:(rank + 1) * 2]

    def loss_of(forward):
        cm.zero_grad()
        logits = forward(mine[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in cm.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_of(cm)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(cm, backend=counting, fullgraph=True)(mine)
    same_forward = torch.equal(out, cm(mine))
    torch._dynamo.reset()
    loss, grads = loss_of(torch.compile(cm, backend="aot_eager", fullgraph=True))
    grad_err = max((grads[n] - g).abs().max().item() for n, g in eager_grads.items())
    return {"graphs": len(graphs), "same_forward": same_forward, "loss_err": (loss - eager_loss).abs().item(),
            "grad_err": grad_err, "grads": len(grads) == len(eager_grads)}


@pytest.mark.parametrize("style", ["loop", "fused"])
def test_ep_w2_compiles_to_one_graph_with_parity(style):
    for rank, r in enumerate(pool(2).run(case_fullgraph, style)):
        assert r["graphs"] == 1, (rank, r)
        assert r["same_forward"] and r["grads"], (rank, r)
        assert r["loss_err"] <= 1e-6 and r["grad_err"] <= 1e-6, (rank, r)
