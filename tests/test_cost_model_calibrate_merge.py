"""Several calibrations merged into one profile (`cost_model.calibrate_merge`): each figure's median, the GEMM table
cell by cell, constants kept as they are, and a clear error on profiles that do not match."""

from __future__ import annotations

import pytest

from cost_model import calibrate_merge
from cost_model.presets import this_machine


def profile(alpha: float, bandwidth: float, efficiency: float, created: str) -> dict:
    return {"version": 1, "world_size": 2, "created": created, "alpha": alpha, "bandwidth": bandwidth,
            "flops": 1e11, "load_average": [1.0, 1.0, 1.0],
            "gemm": [{"D": 64, "M": 64, "time_ratio": 1.0, "efficiency": efficiency},
                     {"D": 128, "M": 64, "time_ratio": 1.0, "efficiency": 0.9}]}


def test_each_figure_is_the_median_over_the_calibrations(tmp_path):
    import json

    runs = [profile(1e-4, 2e9, 0.8, "a"), profile(3e-4, 1.5e9, 0.9, "b"), profile(2e-4, 2.5e9, 0.7, "c")]
    merged = calibrate_merge.median_profile(runs)
    assert (merged["alpha"], merged["bandwidth"], merged["flops"]) == (2e-4, 2e9, 1e11)
    assert merged["version"] == 1 and isinstance(merged["world_size"], int)  # equal everywhere: kept as written
    assert {(c["D"], c["M"]): c["efficiency"] for c in merged["gemm"]} == {(64, 64): 0.8, (128, 64): 0.9}
    assert [m["created"] for m in merged["merged_from"]] == ["a", "b", "c"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(merged))
    assert float(this_machine(path).alpha) == 2e-4
    assert this_machine(merged).values() == this_machine(path).values()  # a profile held in memory reads the same
    assert runs[0]["alpha"] == 1e-4 and "merged_from" not in runs[0]  # the inputs are not changed


def test_profiles_that_do_not_match_are_refused_by_name():
    short = profile(1e-4, 2e9, 0.8, "b")
    del short["bandwidth"]
    with pytest.raises(ValueError, match=r"'bandwidth' is missing from profile\(s\) \[1\]"):
        calibrate_merge.median_profile([profile(1e-4, 2e9, 0.8, "a"), short])
    with pytest.raises(ValueError, match="no calibration profile"):
        calibrate_merge.median_profile([])
