"""The router's per-token host cost (`cost_model.ep.host_time`'s c_route): exact per token in EP, FSEP and HP (T*H
sub-tokens), zero on the GPU presets, read from a profile; the calibration's router step runs the dialect's route op
forward and backward (`cost_model.calibrate_route`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_model import calibrate_route
from cost_model import ep as cm
from cost_model import fsep as fsep_cm
from cost_model import hp as hp_cm
from cost_model.presets import A100, PRESETS, this_machine

C_ROUTE = 4e-7  # s per token
X = {**A100.values(), "T": 1000, "K": 2, "D": 64, "F": 128, "m": 3, "E": 8, "G": 2, "rho": 1.0, "c_f": 1.0}


def test_host_time_adds_the_router_per_token():
    base = cm.host_time(2000, 64, 128, 8, 2, c_layer=1e-3, c_row=1e-9)
    assert cm.host_time(2000, 64, 128, 8, 2, c_layer=1e-3, c_row=1e-9, c_route=C_ROUTE, tokens=1000) \
        == pytest.approx(base + C_ROUTE * 1000, rel=1e-12)


@pytest.mark.parametrize("form", ["ep", "fsep", "hp"])
def test_each_form_prices_its_routed_tokens(form):
    def layer(x):
        if form == "ep":
            return cm.ep_layer(x, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
        if form == "fsep":
            return fsep_cm.fsep_layer(x, W=2, C=4, n=1, rho=1.0, a2a_rows=(0.5, 0.0))
        return hp_cm.hp_layer({**x, "H": 4, "h": 32}, ep=2, dp=1, cross_node=False)

    base, routed = layer(X), layer({**X, "c_route": C_ROUTE})
    tokens = 1000 * (4 if form == "hp" else 1)  # HP routes each of a token's H sub-tokens
    assert float(routed.host - base.host) == pytest.approx(C_ROUTE * tokens, rel=1e-9)
    assert float(routed.step - base.step) == pytest.approx(C_ROUTE * tokens, rel=1e-9)
    assert routed.compute == base.compute and routed.a2a_exposed == base.a2a_exposed


def test_gpu_presets_and_old_profiles_price_no_router_host_time(tmp_path: Path):
    assert all(hw.values()["c_route"] == 0 for hw in PRESETS.values())
    path = tmp_path / "profile.json"
    base = {"alpha": 1e-4, "bandwidth": 2e9, "flops": 5e10, "created": "now"}
    path.write_text(json.dumps(base))
    assert this_machine(path).values()["c_route"] == 0
    path.write_text(json.dumps({**base, "route_cost": C_ROUTE}))
    assert this_machine(path).values()["c_route"] == C_ROUTE


def test_the_router_step_runs_the_route_op_forward_and_backward():
    import torch

    step, (x, gate) = calibrate_route.route_step(64, seed=0)
    step()
    assert x.shape == (64, calibrate_route.D) and gate.shape == (calibrate_route.E, calibrate_route.D)
    assert x.grad is not None and gate.grad is not None and torch.isfinite(gate.grad).all()
