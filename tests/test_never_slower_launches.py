"""`benchmarks/never_slower.py --launches`: the rows of several fresh-process launches merged per case."""

from __future__ import annotations

import pytest

from benchmarks import never_slower


def row(ratio: float, original: float, load: float = 1.0) -> dict:
    return {"case": "layer sample loop", "dtype": "float32", "ratio": ratio, "ratio_range": [ratio - 0.01, ratio + 0.01],
            "original_ms": original, "moepass_ms": original * ratio, "load": load, "rounds": [{"original": 1.0}]}


def test_merged_row_is_the_median_and_range_of_the_launches_ratios():
    launches = [[row(1.02, 30.0), {"case": "layer hf x", "dtype": "float32", "skipped": "no block"}],
                [row(0.97, 31.0)], [row(0.99, 32.0, load=2.0)]]
    merged = never_slower.merge_launches(launches)
    loop = next(r for r in merged if r["case"] == "layer sample loop")
    assert loop["ratio"] == pytest.approx(0.99) and loop["ratio_range"] == pytest.approx([0.97, 1.02])
    assert loop["original_ms"] == 31.0 and loop["load"] == 1.0
    assert [launch["ratio"] for launch in loop["launches"]] == [1.02, 0.97, 0.99]
    assert "rounds" not in loop  # per-launch rounds stay in each launch's own file
    assert next(r for r in merged if r["case"] == "layer hf x")["skipped"] == "no block"
