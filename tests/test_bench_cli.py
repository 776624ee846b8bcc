"""`python -m moepass bench`: argument parsing and the commands it runs; the report builder on synthetic
results (exact lines, goals, a failed benchmark, the loopback label); one real benchmark (kernel_bytes,
analytic, seconds) run through the CLI next to one that crashes; a timeout ending the benchmark and the
process it started; the network-namespace fallback and probe."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moepass import cli

bench_all = cli.bench_module()
from benchmarks import report, report_figures  # noqa: E402  (bench_module puts the checkout on sys.path)

ROOT = Path(__file__).resolve().parents[1]
KNOWN = list(bench_all.BENCHMARKS)


def names(*argv: str) -> list[str]:
    return cli.bench_names(cli.build_parser().parse_args(["bench", *argv]), KNOWN)


def test_bench_names():
    assert names("--all") == KNOWN
    assert names("hp", "compile_time") == ["compile_time", "hp"]  # the registry's order
    with pytest.raises(SystemExit, match=r"^moepass bench: unknown benchmark\(s\) nope: choose from compile_time, "):
        names("nope")
    with pytest.raises(SystemExit, match=r"^moepass bench: give --all or benchmark names, not both \(got --all and "
                                         r"\['hp'\]\)$"):
        names("--all", "hp")
    with pytest.raises(SystemExit, match=r"^moepass bench: give --all or one or more of compile_time, ep_layer, "):
        names()


def test_bench_flags():
    args = cli.build_parser().parse_args(["bench", "--all", "--full", "--out", "/tmp/x"])
    assert (args.all, args.full, args.quick, args.out) == (True, True, False, "/tmp/x")
    with pytest.raises(SystemExit):  # --quick and --full exclude each other
        cli.build_parser().parse_args(["bench", "--all", "--quick", "--full"])


def test_commands(tmp_path):
    argv, shown = bench_all.argv_for(bench_all.BENCHMARKS["ep_layer"], tmp_path, quick=True)
    assert argv == [sys.executable, str(ROOT / "benchmarks" / "ep_layer.py"), "--quick", "--rounds", "3",
                    "--workloads", "issue", "--out", str(tmp_path / "ep_layer.json")]
    assert shown == f"python benchmarks/ep_layer.py --quick --rounds 3 --workloads issue --out {tmp_path}/ep_layer.json"
    # arguments for both modes, "{out}" the output folder
    argv, _ = bench_all.argv_for(bench_all.BENCHMARKS["cost_fidelity"], tmp_path, quick=False)
    assert argv[2:] == ["--calibrate", "--profile", f"{tmp_path}/cost_profile.json", "--out",
                        str(tmp_path / "cost_fidelity.json")]
    # no --out flag: the module is imported and its OUT pointed at the folder; the command shown is the script's
    argv, shown = bench_all.argv_for(bench_all.BENCHMARKS["compile_time"], tmp_path, quick=True)
    assert argv[1] == "-c" and argv[3:] == [str(tmp_path / "compile_time.json"), "--layers", "8", "--experts", "16"]
    assert shown == ("python benchmarks/compile_time.py --layers 8 --experts 16  "
                     "# writes benchmarks/results/compile_time.json")
    argv, _ = bench_all.argv_for(bench_all.BENCHMARKS["hp"], tmp_path, quick=False, extra=("--no-netns",))
    assert argv[2:] == ["--no-netns", "--out", str(tmp_path / "hp.json")]


# --------------------------------------------------------------------------------------------------
# The report on synthetic results.
# --------------------------------------------------------------------------------------------------


def record(name: str, wall_s: float, load: tuple[float, float], json_name: str | None, status: str = "ok",
           **extra) -> dict:
    return {"name": name, "what": f"what {name} measures", "command": f"python benchmarks/{name}.py --quick",
            "mode": "quick", "note": "", "fallback": None, "wall_s": wall_s, "status": status, "json": json_name,
            "pngs": [], "before": {"uptime": f"up, load average: {load[0]}", "load": [load[0], 0, 0]},
            "after": {"uptime": f"up, load average: {load[1]}", "load": [load[1], 0, 0]}, **extra}


def steps(inter: list[int], step_s: list[float]) -> list[dict]:
    return [{"step": i, "inter_bytes": [b, b], "step_s": s} for i, (b, s) in enumerate(zip(inter, step_s))]


@pytest.fixture
def synthetic(tmp_path):
    (tmp_path / "hp_quality.json").write_text(json.dumps(
        {"mode": "quick", "train": {"steps": 30}, "converted": {"default": {"ratio": 1.02}, "heads=8": {"ratio": 1.05}}}))
    (tmp_path / "kernels.json").write_text(json.dumps(
        {"timing": {"ran": False, "reason": "no CUDA device"}, "shapes": []}))
    (tmp_path / "locality.json").write_text(json.dumps({"netns": False, "valid_measurement": False, "sizes": {"steps": 4},
        "by_data": {"domain": {"heldout_loss_ratio": 1.01, "records": {
            "switch": steps([100, 100, 100, 100], [1.0, 1.0, 1.0, 1.0]),
            "locality": steps([80, 60, 40, 50], [1.0, 1.0, 2.0, 1.0])}}}}))
    benchmarks = [
        record("hp_quality", 12.4, (0.5, 0.75), "hp_quality.json"),
        record("locality", 30, (1.0, 1.5), "locality.json",
               fallback={"args": ["--no-netns"], "why": "`ip netns add x` failed (1): denied"}),
        record("fsep", 5, (2.0, 2.0), None, status="failed",
               error={"why": "exit status 1", "stderr_tail": "Traceback\nRuntimeError: boom\n"}),
        record("kernels", 2, (2.0, 2.25), "kernels.json"),
    ]
    machine = {"cores": 2, "cpu": "x86_64", "platform": "Linux", "python": "3.11.7", "torch": "2.13.0+cpu",
               "gpu": None, "gpu_note": "no GPU", "git_commit": "0123456789abcdef", "git_dirty_files": 3}
    (tmp_path / "bench_run.json").write_text(json.dumps(
        {"command": "python -m moepass bench --all", "mode": "quick", "started": "2026-01-01T00:00:00+00:00",
         "wall_s": 49.4, "machine": machine, "netns_checked": True,
         "netns_blocker": "`ip netns add x` failed (1): denied",
         "benchmarks": benchmarks}))
    return tmp_path


def test_report_summary_and_sections(synthetic):
    written = report.build(synthetic)
    assert [p.name for p in written] == ["report.md", "report.html", "summary.png", "hp_quality_ratios.png",
                                         "locality_ratios.png"]
    lines = (synthetic / "report.md").read_text().splitlines()
    start = lines.index("## Summary")
    assert lines[start + 2:start + 9] == [
        "| benchmark | status | wall s | load 1-min before → after | figure | median | range | goal | met |",
        "|---|---|---|---|---|---|---|---|---|",
        "| hp_quality | ok | 12 | 0.50 → 0.75 | default: held-out loss converted / original | 1.02× | — | "
        "issue 15: converted loss within 3 % of the original's | yes |",
        "| locality | ok (loopback) | 30 | 1.00 → 1.50 | domain: inter-node bytes locality / switch | 0.45× | "
        "0.4× – 0.5× | issue 16: inter-node bytes ≤ 0.6× the switch router's | yes |",
        "|  |  |  |  | domain: final held-out loss locality / switch | 1.01× | — | "
        "issue 16: final held-out loss within 2 % | yes |",
        "| fsep | failed | 5 | 2.00 → 2.00 | exit status 1 | — | — | — | — |",
        "| kernels | ok | 2 | 2.00 → 2.25 | GPU timing not run: no CUDA device | — | — | — | — |",
    ]
    assert "GPU: none: no GPU. Git 0123456789ab with 3 changed file(s) in the working tree." in lines[4]
    assert lines[6] == ("Network namespaces: **could not be made** (`ip netns add x` failed (1): denied): the "
                        "benchmarks that need them ran on the loopback, labelled so below.")
    loc = lines.index("## locality: what locality measures")
    assert lines[loc + 1:loc + 15] == [
        "",
        "Command: `python benchmarks/locality.py --quick`",
        "",
        "Status: ok, 30 s. Load before: `up, load average: 1.0`; after: `up, load average: 1.5`.",
        "",
        "| figure | median | range | n | over | goal | met |",
        "|---|---|---|---|---|---|---|",
        "| domain: inter-node bytes locality / switch | 0.45× | 0.4× – 0.5× | 2 | steps of the second half (both "
        "systems on the same batch, step by step) | issue 16: inter-node bytes ≤ 0.6× the switch router's | yes |",
        "| domain: final held-out loss locality / switch | 1.01× | — | 1 | held-out loss after the last step | "
        "issue 16: final held-out loss within 2 % | yes |",
        "| domain: step time locality / switch | 1.5× | 1× – 2× | 2 | steps of the second half | — | — |",
        "",
        "- **loopback, not the tc-limited link**: network namespaces could not be made (`ip netns add x` failed "
        "(1): denied); ran with --no-netns",
        "- network namespaces: False; valid measurement: False; 4 steps",
        "",
    ]
    assert lines[loc + 15] == "![locality_ratios.png](locality_ratios.png)"
    fsep = lines.index("## fsep: what fsep measures")
    assert lines[fsep + 5:fsep + 13] == ["", "Failed: exit status 1.", "", "stderr (tail):", "", "```", "Traceback",
                                         "RuntimeError: boom"]
    page = (synthetic / "report.html").read_text()
    assert "<td>default: held-out loss converted / original</td><td>1.02×</td>" in page
    assert "<img src='summary.png'>" in page


def test_report_missing_key_is_named(synthetic):
    (synthetic / "hp_quality.json").write_text(json.dumps({"converted": {"default": {}}, "train": {"steps": 1}}))
    report.build(synthetic)
    assert ("- the JSON lacks what the report reads (KeyError: 'ratio'): see hp_quality.json"
            in (synthetic / "report.md").read_text())


# --------------------------------------------------------------------------------------------------
# A real run: kernel_bytes through `bench`, next to a benchmark that crashes.
# --------------------------------------------------------------------------------------------------


def test_bench_runs_a_benchmark_and_records_a_crash(tmp_path, monkeypatch, capsys):
    broken = bench_all.Benchmark("broken", "no_such_script.py", "a script that is not there")
    monkeypatch.setitem(bench_all.BENCHMARKS, "broken", broken)
    assert cli.main(["bench", "broken", "kernel_bytes", "--out", str(tmp_path)]) == 1
    assert "1/2 benchmarks ok" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "bench_run.json").read_text())
    ran = {b["name"]: b for b in manifest["benchmarks"]}
    assert list(ran) == ["kernel_bytes", "broken"] and manifest["mode"] == "quick"
    assert manifest["command"] == f"python -m moepass bench kernel_bytes broken --out {tmp_path}"
    assert ran["broken"]["status"] == "failed" and ran["broken"]["error"]["why"] == "exit status 2"
    assert "no_such_script.py" in ran["broken"]["error"]["stderr_tail"]
    ok = ran["kernel_bytes"]
    assert (ok["status"], ok["returncode"], ok["json"]) == ("ok", 0, "kernel_bytes.json")
    assert ok["command"] == f"python benchmarks/kernel_bytes.py --out {tmp_path}/kernel_bytes.json"
    assert len(ok["before"]["load"]) == 3 and "load average" in ok["after"]["uptime"]
    rows = json.loads((tmp_path / "kernel_bytes.json").read_text())["results"]
    median = statistics.median(r["reference_over_kernel"] for r in rows)
    text = (tmp_path / "report.md").read_text()
    assert "## kernel_bytes: bytes per generated kernel vs the unfused torch reference" in text
    assert f"| unfused reference / generated kernel bytes, all ops | {median:.3g}× |" in text
    assert "## broken: a script that is not there" in text and "Failed: exit status 2." in text
    assert (tmp_path / "kernel_bytes_ratios.png").stat().st_size > 0


def test_report_cli(synthetic, capsys):
    assert report.main([str(synthetic)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {synthetic / 'report.md'}"


def test_failed_launch_note():
    log = "Traceback\n[rank0]: ValueError: needs accelerate\nChildFailedError: \n"
    assert report_figures.failed_launches([{"launch": "tep@W2", "round": 0, "attempt": 1, "log": log}]) == [
        "launch tep@W2 (round 0, attempt 1) failed: ValueError: needs accelerate"]


def test_goal_normalised():
    at_least, at_most = report_figures.Goal("x", ">=", 1.2), report_figures.Goal("y", "<=", 0.6)
    assert at_least.met(1.2) and not at_least.met(1.19) and at_least.normalised(2.4) == 0.5
    assert at_most.met(0.6) and not at_most.met(0.61) and at_most.normalised(0.3) == 0.5
    assert not report_figures.Goal("z", "<", 1.0).met(1.0) and report_figures.Goal("z", "<", 1.0).met(0.99)
    with pytest.raises(ValueError, match=r"^Goal\('w'\): op='=<' is not one of \['<', '<=', '>=', '>'\]$"):
        report_figures.Goal("w", "=<", 1.0)


def test_timeout_ends_the_benchmark_and_its_children(tmp_path):
    """A benchmark past its timeout is recorded as such; it and the process it started are ended."""
    script = tmp_path / "sleepy.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(tmp_path / 'pids')!r}, 'w').write(f'{{child.pid}}')\n"
                      "print('started', flush=True)\n"
                      "time.sleep(60)\n")
    sleepy = bench_all.Benchmark("sleepy", str(script), "sleeps", quick_timeout_s=3.0)
    ticks: list[int] = []
    rec = bench_all.run_one(sleepy, tmp_path, quick=True, netns_reason=None, tick=lambda: ticks.append(1))
    assert (rec["status"], rec["returncode"], rec["error"]["why"]) == ("timeout", None, "timed out after 3 s")
    assert rec["error"]["stdout_tail"] == "started\n" and 2 <= len(ticks) <= 3 and 3.0 <= rec["wall_s"] < 10
    child = Path(f"/proc/{(tmp_path / 'pids').read_text()}/stat")
    time.sleep(0.2)
    assert not child.exists() or child.read_text().split(") ")[1][0] == "Z"  # gone, or a zombie not yet reaped


def test_netns_fallback_runs_on_loopback_and_says_why(tmp_path):
    """Where namespaces cannot be made, a link benchmark gets its fallback flag and its record says why."""
    script = tmp_path / "linky.py"
    script.write_text("import json, sys\nargs = sys.argv[1:]\n"
                      "open(args[args.index('--out') + 1], 'w').write(json.dumps(args))\n")
    linky = bench_all.Benchmark("linky", str(script), "needs a link", quick=("--rounds", "1"), netns=True,
                                fallback=("--no-netns",))
    why = "`ip netns add x` failed (1): Operation not permitted"
    rec = bench_all.run_one(linky, tmp_path, quick=True, netns_reason=why)
    assert rec["status"] == "ok" and rec["fallback"] == {"args": ["--no-netns"], "why": why}
    assert json.loads((tmp_path / "linky.json").read_text()) == ["--rounds", "1", "--no-netns", "--out",
                                                                 str(tmp_path / "linky.json")]
    rec = bench_all.run_one(linky, tmp_path, quick=True, netns_reason=None)
    assert rec["fallback"] is None and "--no-netns" not in json.loads((tmp_path / "linky.json").read_text())


def test_netns_probe_leaves_nothing_behind():
    why = bench_all.netns_blocker()
    assert why is None or why.startswith("`ip"), why  # None where namespaces and tc work (root), else the command
    if shutil.which("ip"):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        assert "mpbench" not in listed


def test_cost_fidelity_figures_name_the_forms_and_judge_the_worst_config():
    """The report's cost-fidelity section: predicted / measured over every form the run measured, and issue 31's goal
    on the worst configuration's |relative error| (every one within 15 %), not on the median."""
    doc = {"spearman": 0.9, "median_abs_rel_error": 0.05, "by_form": {"ep": {}, "lina": {}},
           "configs": [{"predicted": {"step_s": p}, "measured": {"step_s": 1.0}, "rel_error": p - 1.0}
                       for p in (0.95, 1.02, 1.10)]}
    figs, _ = report_figures.cost_fidelity(doc)
    assert figs[0].label == "predicted / measured step (ep, lina)"
    worst = next(f for f in figs if f.label == "worst |relative error|")
    assert worst.median == pytest.approx(0.10) and worst.met() == "yes"
    doc["configs"][0]["rel_error"] = -0.16
    worst = next(f for f in report_figures.cost_fidelity(doc)[0] if f.label == "worst |relative error|")
    assert worst.median == pytest.approx(0.16) and worst.met() == "**no**"
