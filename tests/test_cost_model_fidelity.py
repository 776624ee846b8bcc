"""benchmarks/cost_fidelity.py's predictions without a measurement: every form it measures (EP, FSEP, HP,
locality) is priced, the forward/backward split adds up to the step, and the in-run CPU share scales exactly the
CPU-bound terms (compute and host) and nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cost_model.presets import this_machine

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("cost_fidelity", ROOT / "benchmarks" / "cost_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_form_is_priced_and_the_phases_add_up():
    bench = _bench()
    hw = this_machine(bench.PROFILE)
    configs = bench.CONFIGS + bench.FSEP_CONFIGS + bench.HP_CONFIGS + bench.LOCALITY_CONFIGS
    assert {c.form for c in configs} == set(bench.ALL_FORMS.split(","))
    for c in configs:
        p = bench.predict(c, hw)
        assert p["step_s"] > 0 and 0 < p["fwd_s"] < p["step_s"], c
        assert p["fwd_s"] + p["bwd_s"] == pytest.approx(p["step_s"], rel=1e-12)
        assert p["step_s"] == pytest.approx(p["compute_s"] + p["a2a_s"] + p["host_s"] + p["other_s"], rel=1e-9), c


def test_the_in_run_share_scales_compute_and_host_only():
    bench = _bench()
    hw = this_machine(bench.PROFILE)
    for c in (bench.CONFIGS[0], bench.HP_CONFIGS[0], bench.LOCALITY_CONFIGS[0]):
        full, half = bench.predict(c, hw), bench.predict(c, bench.at_share(hw, 0.5))
        assert half["a2a_s"] == pytest.approx(full["a2a_s"], rel=1e-12)
        assert half["compute_s"] == pytest.approx(2 * full["compute_s"], rel=1e-9)
        assert half["host_s"] == pytest.approx(2 * full["host_s"], rel=1e-9)
    profile = {"samples": {"matmul": [{"n": bench.PROBE_N, "seconds": 2e-3}]}}
    assert bench.cpu_share(profile, [1e-3, 1e-3, 4e-3]) == pytest.approx(2.0)
    assert bench.cpu_share({}, [1e-3]) is None
