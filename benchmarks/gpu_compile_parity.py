"""On a CUDA machine: the sample model (loop and fused styles) detected, compiled under form="single" with the
Triton lowering, one loss + backward against the untouched model (loss, every gradient). One short check for a
lent GPU (benchmarks/gpu_check.sh runs the rest):

    PYTHONPATH=. python3 benchmarks/gpu_compile_parity.py
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moepass  # noqa: E402
from samples.models import tiny_mixtral  # noqa: E402


def main() -> None:
    start = time.time()
    for style in ("loop", "fused"):
        torch.manual_seed(0)
        model = tiny_mixtral(style=style, vocab_size=64, dim=64, ffn_dim=128, num_experts=8, top_k=2, layers=2,
                             heads=4).cuda()
        cm = moepass.compile(copy.deepcopy(model), moepass.Plan(form="single", keep_original_if_slower=False))
        ids = torch.randint(0, 64, (4, 17), device="cuda")
        ref_loss, loss = model.loss(ids), cm.loss(ids)
        ref_loss.backward()
        loss.backward()
        ref = dict(model.named_parameters())
        err = max((p.grad - ref[n].grad).abs().max().item() for n, p in cm.named_parameters() if p.grad is not None)
        lowered = [h["stats"] for gm in cm.moepass_info.rewritten.values() for h in gm.history if h["pass"] == "lower"]
        print(style, "rewritten", sorted(cm.moepass_info.rewritten), "loss", ref_loss.item(), loss.item(),
              "max grad err", err, "lowered", lowered[:1])
    print(f"{time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
