"""Memory that trains (issue 31, item 4): every system of the four published set-ups fits its device with
the sharding and recomputation the systems use, and each memory mode is the least that fits
(replicated -> ZeRO-1 -> + recomputation). The breakdown per system: benchmarks/scenario_memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.simulate import SEARCH_ROW, simulate

SCENARIOS = sorted((Path(__file__).parent / "data" / "scenarios").glob("*.json"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_system_the_paper_ran_fits_in_memory(path):
    result = simulate(path)
    rows = [p for p in result.predictions if p.modelled and p.system != SEARCH_ROW]
    assert rows
    for p in rows:
        parts = p.memory
        assert p.feasible, f"{p.case} {p.system}: {parts['total'] / 1e9:.3g} GB/rank ({p.plan['memory']})"
        assert parts["total"] == pytest.approx(
            parts["weights+grads+optimizer"] + parts["activations"] + parts["buffers"], rel=1e-12)
        assert p.plan["memory"] in ("replicated", "zero-1", "zero-1+recompute")
