"""`Plan(deterministic=True)`: bitwise-reproducible training runs.

Reruns of the same program (same seeds, inputs, world size, hardware and software) give bitwise-identical
outputs and gradients. What moepass does for it, and what holds by construction:

- `compile` turns on PyTorch's own switch, `torch.use_deterministic_algorithms(True)`. It is process-wide
  (PyTorch has no narrower one), stays on after compile, and is what makes the ops moepass runs through
  PyTorch deterministic on CUDA: the `index_add_` / `scatter_add` / `index_select` and `gather` backwards
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

import os

import torch

from moepass.errors import PlanError

CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")


def enable() -> None:
    """Turn deterministic algorithms on for this process (what `compile` does for Plan(deterministic=True))."""
    if torch.cuda.is_available():
        value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if value not in CUBLAS_WORKSPACE_CONFIGS:
            raise PlanError(
                f"Plan.deterministic=True needs CUBLAS_WORKSPACE_CONFIG set to one of {list(CUBLAS_WORKSPACE_CONFIGS)} "
                f"on a machine with CUDA (it is {value!r}): cuBLAS reads it when it first runs, so export "
                f"CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python.")
    torch.use_deterministic_algorithms(True)


def describe() -> str:
    """`explain`'s line for Plan(deterministic=True)."""
    return ("deterministic: on: compile calls torch.use_deterministic_algorithms(True) (process-wide); "
            "Triton grouped GEMMs use fixed block configs, no atomics")
