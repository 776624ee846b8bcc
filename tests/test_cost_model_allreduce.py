"""The gradient all-reduce's own figures (`cost_model.calibrate_allreduce`, alpha_r and B_r): the fit recovers a line
exactly, the microbenchmark runs on two gloo ranks, a profile's figures reach `Hardware`, and every price of a gradient
all-reduce -- the search's formulas (EP, HP, the dense tail) and the simulator's timeline -- uses them; the presets
have none and price the all-reduce at the all-to-all's alpha and the link's bandwidth, as before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cost_model import calibrate_allreduce
from cost_model import ep as cm
from cost_model import hp as hp_cm
from cost_model.presets import A100, PRESETS, this_machine
from cost_model.step_timeline import allreduce_work

SHAPE = {"T": 1000, "K": 2, "D": 64, "F": 128, "m": 3, "E": 8, "G": 2, "rho": 1.0, "c_f": 1.0}


def test_the_fit_recovers_the_latency_and_the_rate():
    alpha, rate = 1.2e-3, 2e9
    timings = [(size, alpha + size / rate) for size in calibrate_allreduce.SIZES]  # W = 2: a rank sends the tensor
    out = calibrate_allreduce.figures(timings, 2)
    assert out["allreduce_alpha"] == pytest.approx(alpha, rel=1e-9)
    assert out["allreduce_bandwidth"] == pytest.approx(rate, rel=1e-9)
    assert [s["sent_bytes"] for s in out["allreduce_samples"]] == [float(s) for s in calibrate_allreduce.SIZES]
    at_four = calibrate_allreduce.figures([(size, alpha + 1.5 * size / rate) for size in calibrate_allreduce.SIZES], 4)
    assert at_four["allreduce_bandwidth"] == pytest.approx(rate, rel=1e-9)  # W = 4: 2 (W-1)/W = 1.5 of it sent


def test_the_microbenchmark_runs_on_two_ranks():
    from cost_model.calibrate import spawn_ranks

    sizes = (1 << 14, 1 << 16)
    out = spawn_ranks(calibrate_allreduce.worker, (2, sizes, 3), len(sizes), "all_reduce timing", 120.0)
    assert [size for size, _ in out] == list(sizes)
    assert all(math.isfinite(seconds) and seconds > 0 for _, seconds in out)


def test_a_profile_gives_the_hardware_its_all_reduce_figures(tmp_path: Path):
    base = {"alpha": 1e-4, "bandwidth": 2e9, "flops": 1e11, "cores": 2}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**base, "allreduce_alpha": 1.5e-3, "allreduce_bandwidth": 1e9}))
    values = this_machine(path).values()
    assert (values["alpha_r"], values["B_r"]) == (1.5e-3, 1e9)
    path.write_text(json.dumps(base))  # an older profile: the all-to-all's figures price the all-reduce
    assert "alpha_r" not in this_machine(path).values() and "B_r" not in this_machine(path).values()
    assert all("alpha_r" not in hw.values() and "B_r" not in hw.values() for hw in PRESETS.values())


def test_every_gradient_all_reduce_price_uses_them():
    """Its latency is alpha_r; its rate the link's bandwidth capped at B_r: in EP's expert and dense all-reduces (the
    link model and the tail), HP's, and the simulator's timeline, the same figures."""
    x = {**A100.values(), **SHAPE, "P_d": 200_000, "u": 1 << 20}
    own = {**x, "alpha_r": 2e-3, "B_r": 1e9}
    assert cm.allreduce_figures(x, 5e10) == (5e10, x["alpha"])
    assert cm.allreduce_figures(own, 5e10) == (1e9, 2e-3) and cm.allreduce_figures(own, 5e8) == (5e8, 2e-3)
    dense_bytes = 200_000 * x["b_g"]
    pieces = math.ceil(dense_bytes / (1 << 20))
    expected = pieces * cm.allreduce_time(dense_bytes / pieces, 2, 1e9, 2e-3)
    assert cm.dense_allreduce_tail(own, 2, cross_node=False) == pytest.approx(expected, rel=1e-12)
    assert cm.dense_allreduce_tail(x, 2, cross_node=False) == pytest.approx(
        pieces * cm.allreduce_time(dense_bytes / pieces, 2, x["B_intra"], x["alpha"]), rel=1e-12)
    assert allreduce_work(dense_bytes, 2, x["B_intra"], own, 1 << 20) == (pieces, pytest.approx(expected, rel=1e-12))
    # EP over dp = 2 replicas: the expert gradients' all-reduce is the last layer's exposed tail
    slow = cm.ep_layer(own, ep=2, n=1, dp=2, dropless=True, cross_node_dp=False)
    fast = cm.ep_layer(x, ep=2, n=1, dp=2, dropless=True, cross_node_dp=False)
    assert float(slow.other_comm) > float(fast.other_comm) and slow.compute == fast.compute
    hp_x = {**own, "H": 4, "h": 32}
    assert float(hp_cm.hp_layer(hp_x, ep=2, dp=2, cross_node=False).other_comm) > float(
        hp_cm.hp_layer({**hp_x, "alpha_r": x["alpha"], "B_r": math.inf}, ep=2, dp=2, cross_node=False).other_comm)
