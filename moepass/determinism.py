"""`Plan(deterministic=True)`: bitwise-reproducible training runs.

Reruns of the same program (same seeds, inputs, world size, hardware and software) give bitwise-identical
outputs and gradients. What moepass does for it, and what holds by construction:

- The compiled model runs under PyTorch's own switch, `torch.use_deterministic_algorithms(True)`, and only
  it: `compile` installs `scope(model)`, which turns the switch on when the model's forward starts, back to
  what it was when the forward ends, on again when the backward reaches the model's outputs and back when
  that backward ends (an autograd engine callback). Nothing else in the process changes mode; a training
  loop that wants the whole step deterministic wraps it in `with moepass.determinism.deterministic():`.
  The switch is what makes the ops moepass runs through PyTorch deterministic on CUDA: the `index_add_` / `scatter_add` / `index_select` and `gather` backwards
  of routing, permutation, the expert weight gradients and FSEP's restore take their deterministic
  kernels, and cuBLAS its fixed-workspace mode. Under it PyTorch also fills fresh `torch.empty` memory
  with NaN (`torch.utils.deterministic.fill_uninitialized_memory`), so a read of uninitialised memory
  shows as NaN instead of varying from run to run.
- cuBLAS needs `CUBLAS_WORKSPACE_CONFIG=:4096:8` (or `:16:8`) in the environment before its first use:
  on a machine with CUDA, `compile` checks it and raises `PlanError` with the fix rather than failing at
  the first GEMM of the first step.
- The generated Triton kernels use no atomics (every family; a test renders them all and checks), so
  each output element is reduced in one fixed order. On a GPU the grouped-GEMM kernels are normally
  autotuned: the fastest block sizes win a timing race, and another block_k is another summation
  order. While deterministic algorithms are on, the kernels take the one config `pick_config` gives for
  the shape instead (`lowering.grouped_gemm.configs.FfnSpec.fixed_configs`), as they do interpreted.
- The collectives keep their order: gloo and NCCL reduce a fixed world in a fixed order for a given
  message size (NCCL: with one NCCL version and topology; pin `NCCL_ALGO` / `NCCL_PROTO` to exclude its
  tuner's choice across machines). The priority scheduler only delays collectives, never reorders them
  within a group; all-to-all moves data without arithmetic.
- FSEP's planner is a deterministic function of counts every rank gathers identically, and the forward
  joins its worker thread before installing a table, so the table a step uses never depends on timing.
- Randomness (jitter noise in train mode, dropout) follows torch's seeded generators as in the original
  model: seed them as usual.

Not covered: other ranks' hardware differing from this rank's, and ops of the user's own model that
PyTorch has no deterministic kernel for (they raise, naming the op, as PyTorch documents).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

from moepass.errors import PlanError
from moepass.process_state import DETERMINISTIC_BACKWARD

CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")


def check_environment() -> None:
    """Raise before anything runs when cuBLAS cannot be deterministic in this process."""
    if torch.cuda.is_available():
        value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if value not in CUBLAS_WORKSPACE_CONFIGS:
            raise PlanError(
                f"Plan.deterministic=True needs CUBLAS_WORKSPACE_CONFIG set to one of {list(CUBLAS_WORKSPACE_CONFIGS)} "
                f"on a machine with CUDA (it is {value!r}): cuBLAS reads it when it first runs, so export "
                f"CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python.")


def enable() -> None:
    """Turn deterministic algorithms on for the whole process, for good (an explicit call; compile scopes it)."""
    check_environment()
    torch.use_deterministic_algorithms(True)


Mode = tuple[bool, bool]  # torch's switch: (deterministic algorithms on, warn only)


def switch_on() -> Mode:
    """Turn deterministic algorithms on; returns the mode they replaced (for `restore`)."""
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    return mode


def restore(mode: Mode) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic algorithms on inside the block, the previous mode restored after it."""
    check_environment()
    mode = switch_on()
    try:
        yield
    finally:
        restore(mode)


def output_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's output: a tensor, or nested tuples, lists and mappings (ModelOutput too)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from output_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from output_tensors(item)


class BackwardMode:
    """The mode during one backward pass: on from the first scoped output it reaches to its end.

    One per process, as torch's switch is: several scopes (a model's, each graph the backend compiled)
    can meet in one backward, and the engine runs its end-of-backward callbacks first-queued first, so
    the mode to restore is kept here once, not per scope."""

    def __init__(self) -> None:
        self.saved: Mode | None = None

    def enter(self) -> None:
        if self.saved is None:
            self.saved = switch_on()
            Variable._execution_engine.queue_callback(self.exit)

    def exit(self) -> None:
        assert self.saved is not None
        mode, self.saved = self.saved, None
        restore(mode)


def backward_mode() -> BackwardMode:
    """This process's one `BackwardMode` (`moepass.process_state.DETERMINISTIC_BACKWARD`, made on first use)."""
    return DETERMINISTIC_BACKWARD.get(BackwardMode)


class Scope:
    """Deterministic algorithms on while `module` runs forward and while a backward runs through it.

    Forward: a pre-hook turns the switch on, a hook (called on exceptions too) restores it. Backward:
    a hook on each output that needs a gradient turns it on when the backward reaches the module and
    queues an engine callback that restores it when that backward ends (activation recomputation inside
    it runs under the switch too). Nested or re-entrant calls restore in order (a stack)."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.saved: list[Mode] = []
        self.handles = [] if module is None else [
            module.register_forward_pre_hook(self.enter_forward),
            module.register_forward_hook(self.exit_forward, always_call=True)]

    def enter_forward(self, module: torch.nn.Module | None, args: Any) -> None:
        self.saved.append(switch_on())

    def exit_forward(self, module: torch.nn.Module | None, args: Any, output: Any) -> None:
        restore(self.saved.pop())
        if torch.is_grad_enabled():
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self.enter_backward)

    def enter_backward(self, grad: torch.Tensor) -> None:
        backward_mode().enter()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run as a scoped module's forward (the torch.compile backend's compiled graph)."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.enter_forward(None, args)
            output = None
            try:
                output = fn(*args, **kwargs)
            finally:
                self.exit_forward(None, args, output)
            return output

        return run

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def scope(module: torch.nn.Module | None = None) -> Scope:
    """Run `module` (forward and backward) under deterministic algorithms; what compile installs.
    Without a module, `scope().wrap(fn)` does the same for a callable."""
    check_environment()
    return Scope(module)


def describe() -> str:
    """`explain`'s line for Plan(deterministic=True)."""
    return ("deterministic: on: the compiled model's forward and backward run under "
            "torch.use_deterministic_algorithms(True), the process's mode restored after each; "
            "Triton grouped GEMMs use fixed block configs, no atomics")
