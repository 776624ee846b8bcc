"""Parity checks shared by the tests: one training step of a compiled model against the original.

    assert_same_training_step(model, compiled, inputs)   loss and every parameter gradient, fp32 tolerances
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

RTOL, ATOL = 1e-5, 1e-6


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model.loss(tokens)


def assert_same_training_step(model: nn.Module, compiled: nn.Module, inputs: torch.Tensor,
                              loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lm_loss) -> None:
    """Backward through `loss_fn` on both models: the losses and every parameter's gradient agree."""
    loss_ref = loss_fn(model, inputs)
    loss_ref.backward()
    loss = loss_fn(compiled, inputs)
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    grads = dict(compiled.named_parameters())
    for name, p in model.named_parameters():
        assert grads[name].grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
