"""The layer and its routing for `benchmarks/fsep.py` (issue 14; the module doc there says why these sizes
and scenarios): the HF Mixtral block with seeded weights, the input pool with its router bias feature, the
calibration of the router to a target per-expert share, EP's spread over all expert splits, and the
recorded skew of a trained `tiny_mixtral`. The orchestrator calibrates; the workers rebuild the block
(`make_block`) and load its state.

Shape legend: T tokens per rank, D model width, F expert hidden width, E experts, K top-k, W ranks, N pool
batches.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ep_step import mixtral_config, summary  # noqa: E402

W = 2
POOL = 16  # N input batches per rank, cycled
TOLERANCE = 1e-3  # calibration: |realised share - target| per expert


def make_block(layer: dict) -> nn.Module:
    """The HF MixtralSparseMoeBlock of a 1-layer MixtralForCausalLM (train mode; weights to be set)."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(layer["D"], layer["F"], layer["E"], layer["K"], layers=1, heads=8, kv_heads=4, vocab=64,
                         seq=layer["T"])
    block = MixtralForCausalLM(cfg).model.layers[0].mlp
    block.train()
    return block


def init_block(layer: dict) -> nn.Module:
    """`make_block` with seeded weights (see module doc)."""
    block = make_block(layer)
    gen = torch.Generator().manual_seed(0)
    D, F = layer["D"], layer["F"]
    with torch.no_grad():
        block.gate.weight.normal_(0.0, D ** -0.5, generator=gen)
        block.experts.gate_up_proj.normal_(0.0, D ** -0.5, generator=gen)
        block.experts.down_proj.normal_(0.0, F ** -0.5, generator=gen)
    return block


def input_pool(layer: dict) -> torch.Tensor:
    """[N, W, T, D]: seeded N(0, 1) tokens with feature 0 set to 1 (the router's bias feature)."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(POOL, W, layer["T"], layer["D"], generator=gen)
    pool[..., 0] = 1.0
    return pool


def zipf_shares(E: int, s: float) -> list[float]:
    """p_e ~ 1/(E - e)^s: expert E-1 the hottest (see module doc for why this order)."""
    p = [1.0 / (E - e) ** s for e in range(E)]
    return [v / sum(p) for v in p]


def router_shares(block: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """[E] share of the T*K assignments per expert, through the block's own router module."""
    with torch.no_grad():
        experts_TK = block.gate(x_TD)[2]
    E = block.gate.weight.shape[0]
    return torch.bincount(experts_TK.flatten(), minlength=E).double() / experts_TK.numel()


def calibrate(block: nn.Module, pool: torch.Tensor, target_E: list[float], iterations: int = 300) -> dict:
    """Set the router's bias column (feature 0) so that the pool's per-expert shares match `target_E`."""
    x_TD = pool.reshape(-1, pool.shape[-1])
    target = torch.tensor(target_E, dtype=torch.float64)
    weight = block.gate.weight
    with torch.no_grad():
        log_target = target.clamp(min=1e-6).log()  # a share of 0: a bias that never wins
        weight[:, 0] = log_target.float()
        best = None
        for it in range(iterations):
            share = router_shares(block, x_TD)
            err = float((share - target).abs().max())
            if best is None or err < best[0]:
                best = (err, weight[:, 0].clone(), share, it)
            if err <= TOLERANCE:
                break
            weight[:, 0] += (0.5 * (log_target - share.clamp(min=1e-6).log())).float()
        err, bias, share, it = best
        weight[:, 0] = bias
    return {"target": target_E, "realised": share.tolist(), "max_abs_error": err, "iterations": it + 1,
            "bias": bias.tolist(), "assignments": int(x_TD.shape[0] * block.gate.top_k)}


def ep_split_spread(shares_E: list[float]) -> dict:
    """EP's max/mean rows per device at W=2 for every split of the experts into two halves (35 for E=8)."""
    E = len(shares_E)
    values = []
    for half in itertools.combinations(range(1, E), E // 2 - 1):  # expert 0 on rank 0: each split once
        first = shares_E[0] + sum(shares_E[e] for e in half)
        values.append(W * max(first, 1.0 - first))
    identity = W * max(sum(shares_E[:E // 2]), sum(shares_E[E // 2:]))
    return {"identity_order": identity, "splits": len(values), **summary(values)}


def record_real_router(cfg: dict) -> dict:
    """Train `tiny_mixtral` on a fixed byte stream; each MoE layer's per-expert assignment counts over the
    last `record` steps (its router's top-k, computed as LoopMoE.forward computes it)."""
    import torch.nn.functional as F

    from samples.models import LoopMoE, tiny_mixtral

    path = Path(argparse.__file__)
    raw = path.read_bytes()
    data = torch.tensor(list(raw), dtype=torch.int64)
    torch.manual_seed(0)
    model = tiny_mixtral()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    blocks = [m for m in model.modules() if isinstance(m, LoopMoE)]
    E = blocks[0].gate.weight.shape[0]
    counts_LE = torch.zeros(len(blocks), E, dtype=torch.int64)
    recording = [False]

    def recorder(i: int):
        def pre_hook(block: nn.Module, args: tuple) -> None:
            if recording[0]:
                x_TD = args[0].reshape(-1, args[0].shape[-1])
                logits_TE = F.linear(x_TD.float(), block.gate.weight.float())
                counts_LE[i] += torch.bincount(logits_TE.topk(block.top_k, dim=-1).indices.flatten(), minlength=E)
        return pre_hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(recorder(i))
    B, S = cfg["batch"], cfg["seq"]
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        starts = ((torch.arange(B) * 9973 + step * B * S) % (len(data) - S - 1)).tolist()
        tokens_BS = torch.stack([data[s:s + S + 1] for s in starts])
        recording[0] = step >= cfg["steps"] - cfg["record"]
        opt.zero_grad()
        loss = model.loss(tokens_BS)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shares = (counts_LE.double() / counts_LE.sum(dim=1, keepdim=True)).tolist()
    return {"model": "samples.models.tiny_mixtral() (dim 64, ffn 128, E=8, top-2, 2 LoopMoE layers, vocab 256)",
            "token_stream": {"path": str(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()},
            **cfg, "loss_first": losses[0], "loss_last": losses[-1], "train_s": time.perf_counter() - t0,
            "counts": counts_LE.tolist(), "shares": shares,
            "max_over_mean": [max(s) * E for s in shares]}
