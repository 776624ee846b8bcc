"""The expert FFN kernel's host cost beyond its GEMMs (`cost_model.calibrate_ffn`): the calibration times the kernel
on the engine the priced layers run (expert by expert) against the same GEMMs as plain matmuls, and fits the excess
per local expert and per hidden element; and the row chain around it priced on the rows each op touches."""

from __future__ import annotations

import pytest

from cost_model import calibrate_ffn
from cost_model.presets import A100

X = {**A100.values(), "T": 1000, "K": 2, "D": 64, "F": 128, "m": 3, "E": 8, "G": 2, "rho": 1.0, "c_f": 1.0}


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


def test_the_row_chain_prices_a_capacitys_dropped_rows_where_they_are_gathered():
    """Under a capacity, the permute gathers every top-k assignment (the dropped ones into a bin that is never sent),
    the combine reads them all back: 3 of the row chain's 5 ops run on T*K rows, the local permute and unpermute on
    the kept rows. Dropless without skew: all five on the same rows, as before."""
    from cost_model import ep as cm

    c_row, D, T, K = 1e-9, 64, 1000, 2
    assert cm.host_time(2000, D, 128, 8, 2, c_row=c_row) == pytest.approx(c_row * 2000 * D, rel=1e-12)
    kept = 0.6 * T * K
    assert cm.host_time(kept, D, 128, 8, 2, c_row=c_row, routed=T * K) \
        == pytest.approx(c_row * D * (3 * T * K + 2 * kept) / 5, rel=1e-12)
    x = {**X, "T": T, "K": K, "D": D, "c_row": c_row}
    dropless = cm.ep_layer(x, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    capped = cm.ep_layer({**x, "c_f": 0.6}, ep=2, n=1, dp=1, dropless=False, cross_node_dp=False)
    assert float(dropless.host) == pytest.approx(c_row * T * K * D, rel=1e-9)
    assert float(capped.host) == pytest.approx(c_row * D * (3 * T * K + 2 * kept) / 5, rel=1e-9)
