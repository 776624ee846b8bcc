"""`benchmarks/never_slower.py --launches` and `--isolate`: fresh-process launches merged per case."""

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


def test_isolated_launches_run_each_case_in_its_own_process(tmp_path, monkeypatch):
    """`--isolate`: one fresh process per case and launch, selected by its full name (`--case`), launch by
    launch; the per-case rows of each launch are merged as with whole-run launches."""
    calls = []

    def fake_run(cmd, check):
        case = cmd[cmd.index("--case") + 1]
        calls.append((case, cmd))
        out = cmd[cmd.index("--out") + 1]
        ratio = 1.0 + 0.01 * len(calls)
        with open(out, "w") as f:
            f.write(never_slower.json.dumps({"rows": [{**row(ratio, 30.0), "case": case}]}))

    monkeypatch.setattr(never_slower.subprocess, "run", fake_run)
    out = tmp_path / "merged.json"
    argv = ["--hf", "--launches", "2", "--isolate", "--rounds", "3", "--out", "elsewhere.json"]
    names = ["layer sample loop", "layer hf olmoe"]
    assert never_slower.run_launches(argv, 2, {"device": "cpu"}, out, names) == 0
    assert [case for case, _ in calls] == names * 2  # launch by launch, every case once per launch
    for _, cmd in calls:  # the case's own flags kept, the driver's dropped
        assert cmd.count("--out") == 1 and "--isolate" not in cmd and "--launches" not in cmd and "2" not in cmd
        assert cmd[cmd.index("--rounds") + 1] == "3" and "elsewhere.json" not in cmd
    result = never_slower.json.loads(out.read_text())
    assert result["meta"]["isolated"] is True and result["meta"]["launches"] == 2
    olmoe = next(r for r in result["rows"] if r["case"] == "layer hf olmoe")
    assert [launch["ratio"] for launch in olmoe["launches"]] == pytest.approx([1.02, 1.04])


def test_case_selects_one_case_by_its_full_name():
    args = never_slower.argparse.Namespace(case="layer sample fused", only="", hf=False)
    assert [name for name, _, _ in never_slower.selected_cases(["layer"], args)] == ["layer sample fused"]
    args = never_slower.argparse.Namespace(case="", only="sample", hf=False)
    assert [name for name, _, _ in never_slower.selected_cases(["layer", "tiny"], args)] == [
        f"{size} sample {style}" for size in ("layer", "tiny") for style in ("loop", "fused", "gshard")]
