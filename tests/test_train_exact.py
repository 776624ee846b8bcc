"""The single form computes what the user's block computes, bit for bit (issue 30: the recipe's curves).

The recipe's model (`samples/train.py`'s defaults: the sample Mixtral-like LM, loop experts, softmax ->
top-2 -> renormalise) compiled with `Plan(form="single")` against the untouched model, one process:

- the MoE block: output and every gradient (input, router, each expert weight) bitwise equal;
- the arithmetic the canonical ops copy from the torch code the block runs: `moe.route`'s backward is
  autograd's (softmax / sigmoid, renormalised or not, scaled, softmax after top-k) and `moe.combine` rounds
  each product before adding (no fused multiply-add), bitwise;
- training: 30 AdamW steps of the whole model bitwise equal (losses and parameters); at step 24 an expert
  of layer 1 gets no token: the untouched loop skips it (gradient None, which AdamW skips), the form
  hands it a zero gradient (AdamW decays it), so the recipe zero-fills missing gradients
  (`moepass.train.optim.fill_missing_grads`); without that the parameters part at step 24.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recipe_models() -> tuple[torch.nn.Module, torch.nn.Module, argparse.Namespace]:
    """(the untouched recipe model, its single-form compile) from the recipe's default options."""
    import moepass
    from samples.train import add_arguments, build_model

    args = add_arguments(argparse.ArgumentParser()).parse_args([])
    model = build_model(args, 1)
    untouched = copy.deepcopy(model)
    return untouched, moepass.compile(model, moepass.Plan(form="single")), args


def test_single_form_block_forward_and_gradients_are_the_blocks_bitwise():
    from moepass.train.data import Batches

    untouched, single, args = recipe_models()
    tokens = Batches.from_corpus(args.seq, args.global_batch, args.seed).global_batch_at(0)
    seen = {}
    handle = untouched.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.setdefault("x", i[0].detach()))
    untouched(tokens[:, :-1])
    handle.remove()

    def run(block):
        x = seen["x"].clone().requires_grad_(True)
        y = block(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}

    y0, gx0, g0 = run(untouched.layers[0].mlp)
    y1, gx1, g1 = run(single.layers[0].mlp)
    assert type(single.layers[0].mlp).__name__ == "MoEGraphModule"
    assert torch.equal(y0, y1), f"output: max |diff| {(y0 - y1).abs().max():.3e}"
    assert torch.equal(gx0, gx1), f"grad of the input: max |diff| {(gx0 - gx1).abs().max():.3e}"
    assert g0.keys() == g1.keys() and len(g0) == 1 + 3 * args.experts
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"grad of {name}: max |diff| {(g0[name] - g1[name]).abs().max():.3e}"


@pytest.mark.parametrize("score,before,renorm,scaling", [
    ("softmax", True, True, 1.0), ("softmax", True, False, 1.0), ("softmax", True, True, 2.5),
    ("sigmoid", True, True, 1.0), ("sigmoid", True, False, 2.5), ("softmax", False, False, 1.0)])
def test_route_weights_and_backward_are_autograds_arithmetic(score, before, renorm, scaling):
    from moepass.dialect import route_backward_ref, route_ref

    g = torch.Generator().manual_seed(0)
    T, E, K = 256, 8, 3
    logits = torch.randn(T, E, generator=g).requires_grad_(True)
    grad_w = torch.randn(T, K, generator=g)
    if score == "softmax" and not before:  # top-k of the logits, softmax over those (Qwen-MoE style)
        top, experts = logits.topk(K, dim=-1)
        weights = top.softmax(-1)
    else:
        scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(K, dim=-1)
        if renorm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    weights.backward(grad_w)
    ref_w, ref_e = route_ref(logits.detach(), None, score, before, K, renorm, 1, 1, "max", scaling)
    assert torch.equal(ref_e, experts) and torch.equal(ref_w, weights.detach())
    grad = route_backward_ref(grad_w, logits.detach(), experts, score, before, renorm, scaling)
    assert torch.equal(grad, logits.grad), f"max |diff| {(grad - logits.grad).abs().max():.3e}"


def test_combine_rounds_each_product_then_adds_in_choice_order():
    from moepass.dialect import combine_ref

    g = torch.Generator().manual_seed(0)
    y, w = torch.randn(512, 2, 64, generator=g), torch.rand(512, 2, generator=g)
    out = combine_ref(y, w)
    assert torch.equal(out, (y * w[..., None]).sum(1))  # a fused block's combine
    loop = torch.zeros(512, 64)  # a loop's: index_add_ per expert (K=2: the order of two adds is free)
    for k in (1, 0):
        loop.index_add_(0, torch.arange(512), y[:, k] * w[:, k:k + 1])
    assert torch.equal(out, loop)
    fused = y[:, 0] * w[:, :1]
    fused.addcmul_(y[:, 1], w[:, 1:])  # one rounding per element: what combine_ref no longer does
    assert not torch.equal(out, fused)


def train_both(steps: int, zero_fill: bool) -> tuple[list[tuple[float, float]], int | None]:
    """(per step (single-form loss, untouched loss), the first step after which a parameter differs)."""
    from moepass.train.data import Batches

    untouched, single, args = recipe_models()
    batches = Batches.from_corpus(args.seq, args.global_batch, args.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: threads only contend on this shared machine
    try:
        return steps_of(untouched, single, args, batches, steps, zero_fill)
    finally:
        torch.set_num_threads(threads)


def steps_of(untouched, single, args, batches, steps: int, zero_fill: bool) -> tuple[list[tuple[float, float]], int | None]:
    from moepass.train.optim import build_optimizer, fill_missing_grads, lr_at, set_lr
    from samples.train import lm_loss

    runs = [(single, build_optimizer(single, args.lr, args.weight_decay)),
            (untouched, build_optimizer(untouched, args.lr, args.weight_decay))]
    losses, parted = [], None
    for step in range(steps):
        tokens = batches.global_batch_at(step)
        pair = []
        for model, opt in runs:
            set_lr(opt, lr_at(step, args.lr, args.warmup, args.steps))
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, tokens)
            loss.backward()
            if zero_fill:
                fill_missing_grads(model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
        if parted is None and any(not torch.equal(p, q) for p, q in zip(single.parameters(), untouched.parameters())):
            parted = step + 1
    return losses, parted


def test_single_form_trains_bitwise_like_the_untouched_model():
    losses, parted = train_both(30, zero_fill=True)
    assert parted is None and all(a == b for a, b in losses), [(s + 1, a - b) for s, (a, b) in enumerate(losses)
                                                               if a != b][:3]


def test_without_zero_fill_the_expert_no_token_chose_parts_the_runs_at_step_24():
    _, parted = train_both(25, zero_fill=False)
    assert parted == 24  # layers.1.mlp.experts.3 got no token at step 24: None (skipped) vs a zero gradient
