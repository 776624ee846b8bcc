"""The expert FFN kernel's host cost beyond its GEMMs (`cost_model.calibrate_ffn`): the calibration times the kernel
on the engine the priced layers run (expert by expert) against the same GEMMs as plain matmuls, and fits the excess
per local expert and per hidden element."""

from __future__ import annotations

import pytest

from cost_model import calibrate_ffn


def test_every_calibration_size_runs_the_kernel_expert_by_expert():
    import torch

    from moepass import grouped_ffn

    for experts, rows, width, hidden in calibrate_ffn.SIZES:
        counts = torch.full((experts,), rows // experts)
        assert grouped_ffn.Rows(counts, rows).per_expert(width, hidden), (experts, rows, width, hidden)


def test_the_gemm_step_runs_the_kernels_gemms_on_the_same_shapes(monkeypatch):
    """The reference step's matmuls are the kernel's: the same count and the same (m, k, n) shapes per expert."""
    import torch

    seen: dict[str, list[tuple[int, int, int]]] = {"kernel": [], "gemms": []}
    mm = torch.mm
    which = "kernel"

    def spy(a, b, **kwargs):
        seen[which].append((a.shape[0], a.shape[1], b.shape[1]))
        return mm(a, b, **kwargs)

    kernel, gemms = calibrate_ffn.ffn_steps(4, 256, 16, 256, seed=0)
    monkeypatch.setattr(torch, "mm", spy)
    kernel()
    which = "gemms"
    gemms()
    assert len(seen["kernel"]) == 9 * 4
    assert sorted(seen["kernel"]) == sorted(seen["gemms"])


def test_the_fit_recovers_the_per_expert_and_per_element_slopes():
    c_0, c_expert, c_act = 2e-4, 5e-5, 3e-9
    excess = [(i, c_0 + c_expert * e + c_act * n * f) for i, (e, n, _, f) in enumerate(calibrate_ffn.SIZES)]
    figures = calibrate_ffn.figures(excess)
    assert figures["expert_overhead"] == pytest.approx(c_expert, rel=1e-6)
    assert figures["act_cost"] == pytest.approx(c_act, rel=1e-6)
    assert calibrate_ffn.figures([(i, 1e-3 - 1e-5 * calibrate_ffn.SIZES[i][0]) for i in range(len(excess))]) \
        == {"expert_overhead": 0.0, "act_cost": pytest.approx(0.0, abs=1e-15)}
