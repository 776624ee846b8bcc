"""Bad command-line input ends before any work starts, with one line on stderr naming the option (or module
path), the bad value and the fix: exit status 1, or 2 for argparse's usage errors (a number out of range,
an unknown choice), and no traceback. Most cases call `moepass.cli.main` in this process (each fails in
milliseconds); the ones that depend on the interpreter's start-up (sys.path, environment flags, the
subcommand boundary) run `python -m moepass` in a subprocess from a user's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest

from moepass import cli

ROOT = Path(__file__).resolve().parents[1]
MODELS = textwrap.dedent("""\
    import torch
    from samples.models import tiny_mixtral

    def build():
        return tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=1,
                            heads=4)

    def dense():
        return torch.nn.Linear(4, 4)
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A user's folder: cli_inputs_models.py, a plain file `afile` and a samples.py / lowering.py of its own."""
    base = tmp_path_factory.mktemp("cli_inputs")
    (base / "cli_inputs_models.py").write_text(MODELS)
    (base / "afile").write_text("not a folder\n")
    (base / "samples.py").write_text("WHAT = 'the user own samples.py'\n")
    (base / "lowering.py").write_text("WHAT = 'the user own lowering.py'\n")
    return base


def run(folder: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "MOEPASS_DEBUG": "0", **env}
    return subprocess.run([sys.executable, "-m", "moepass", *argv], cwd=folder, env=environ, capture_output=True,
                          text=True, timeout=120)


def one_line(stderr: str, *words: str) -> str:
    """The single line of `stderr`, checked to hold each of `words` and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert all(word in lines[0] for word in words), (words, lines[0])
    return lines[0]


@pytest.fixture
def main(monkeypatch, capsys, folder):
    """cli.main(argv) in this process from `folder`: (exit status, stderr); sys.path and sys.modules restored."""
    monkeypatch.setenv("MOEPASS_DEBUG", "0")
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "cli_inputs_models", raising=False)

    def call(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as done:
            cli.main(list(argv))
        code, err = done.value.code, capsys.readouterr().err
        if isinstance(code, str):  # SystemExit("message"): the interpreter prints it, exit status 1
            return 1, err + code + "\n"
        return int(code or 0), err

    yield call
    sys.modules.pop("cli_inputs_models", None)


# ---- 1. search --------------------------------------------------------------------------------------------

USAGE = [  # argv, the option the one line names, the bad value
    (["search", "m:b", "--nodes", "0"], "--nodes", "'0'"),
    (["search", "m:b", "--ranks-per-node", "-2"], "--ranks-per-node", "'-2'"),
    (["search", "m:b", "--seq", "-5"], "--seq", "'-5'"),
    (["search", "m:b", "--batch", "0"], "--batch", "'0'"),
    (["search", "m:b", "--limit", "-1"], "--limit", "'-1'"),
    (["search", "m:b", "--limit", "0"], "--limit", "'0'"),
    (["search", "m:b", "--profile", "h200"], "--profile", "Did you mean 'h100'?"),
    (["search", "m:b", "--profile", "nosuch.json"], "--profile", "nosuch.json"),
    (["search", "m:b", "--profile", "."], "--profile", "is a folder"),
    (["search", "m:b", "--nodes", "two"], "--nodes", "'two' is not a whole number"),
    (["demo", "--steps", "0"], "--steps", "'0'"),
    (["demo", "--steps", "-1"], "--steps", "'-1'"),
    (["train", "--nproc", "0"], "--nproc", "'0'"),
    (["train", "--nproc", "-1"], "--nproc", "'-1'"),
    (["train", "--log-every", "0"], "--log-every", "'0'"),
    (["train", "--global-batch", "0"], "--global-batch", "'0'"),
    (["train", "--steps", "0"], "--steps", "'0'"),
    (["train", "--steps", "-1"], "--steps", "'-1'"),
    (["train", "--ckpt-every", "-1"], "--ckpt-every", ">= 0"),
    (["train", "--lr", "nan"], "--lr", "finite"),
    (["train", "--seq", "0"], "--seq", "'0'"),
    (["explain", "m:b", "--form", "EP"], "--form", "Did you mean 'ep'?"),
    (["explain", "m:b", "--form", "sinlge"], "--form", "Did you mean 'single'?"),
    (["explain", "m:b", "--ep-size", "0"], "--ep-size", "'0'"),
    (["explain", "m:b", "--mu", "-1"], "--mu", "'-1'"),
]


@pytest.mark.parametrize("argv,option,value", USAGE, ids=[" ".join(a[0:1] + a[2:]) for a, _, _ in USAGE])
def test_out_of_range_numbers_and_unknown_choices_are_one_usage_line(main, argv, option, value):
    code, err = main(*argv)
    assert code == 2
    one_line(err, f"moepass {argv[0]}: argument {option}", value, "--help")


def test_search_scenario_that_is_not_a_file(main):
    code, err = main("search", "--scenario", "nosuch.json")
    assert code == 1
    one_line(err, "moepass search: --scenario nosuch.json: no such file", "repository root")


def test_search_profile_file_is_passed_as_a_path(tmp_path):
    profile = tmp_path / "calibrated"
    profile.write_text("{}")
    assert cli.profile_choice(str(profile)) == profile and cli.profile_choice("h100") == "h100"


def test_search_of_a_model_without_moe_blocks_is_one_line_and_debug_raises(folder):
    out = run(folder, "search", "cli_inputs_models:dense")
    assert out.returncode == 1 and out.stdout == ""
    one_line(out.stderr, "moepass search: cli_inputs_models:dense: search got no MoE blocks", "moepass explain")
    out = run(folder, "search", "cli_inputs_models:dense", MOEPASS_DEBUG="1")
    assert out.returncode == 1 and "Traceback" in out.stderr and "ValueError: search got no MoE blocks" in out.stderr


def test_preset_errors_name_the_nearest_preset_and_the_profile_alternative(tmp_path):
    from cost_model.presets import preset, this_machine

    with pytest.raises(ValueError, match=r"'h200'.*calibration profile path \(\.json\)\. Did you mean 'h100'\?"):
        preset("h200")
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        this_machine(tmp_path)


# ---- 2, 3, 5. train: the world, output folders, --resume -----------------------------------------------------


def test_launch_refuses_zero_ranks():
    from moepass.train.launch import run as launch

    with pytest.raises(ValueError, match="nproc=0 is invalid"):
        launch(print, None, 0, "cpu")


def test_train_batch_must_split_over_the_ranks(main, tmp_path):
    code, err = main("train", "--nproc", "2", "--global-batch", "7", "--out", str(tmp_path / "run"))
    assert code == 1
    one_line(err, "--global-batch 7 is not a multiple of the world size 2")


@pytest.mark.parametrize("out", ["afile/sub", "afile"])
def test_train_out_that_cannot_be_a_folder(main, out):
    code, err = main("train", "--out", out, "--nproc", "1")
    assert code == 1
    one_line(err, f"moepass train: --out {out}: cannot create the folder", "writable folder")


def checkpoint_at(out: Path, step: int, reference: bool = False) -> Path:
    """A checkpoint folder as moepass.train.checkpoint.save leaves it (its COMPLETE marker), with the log's
    steps as samples/train.py saves them; no tensors (nothing here loads it)."""
    path = out / "ckpt" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(f"{step}\n")
    (path / "train_steps.json").write_text(json.dumps({"steps": [{"step": s, "loss": 1.0 / s}
                                                                 for s in range(1, step + 2)]}))
    if reference:
        (path / "reference.pt").write_bytes(b"")
    return path


def test_train_resume_errors_come_before_any_rank_starts(main, tmp_path):
    out = tmp_path / "run"
    code, err = main("train", "--nproc", "1", "--out", str(out), "--resume", "latest")
    assert code == 1
    one_line(err, "--resume latest: no complete checkpoint in", "--ckpt-every")
    code, err = main("train", "--nproc", "1", "--out", str(out), "--resume", str(tmp_path / "nosuch_ckpt"))
    assert code == 1
    one_line(err, "--resume", "nosuch_ckpt: no such checkpoint folder")
    (tmp_path / "half").mkdir()
    code, err = main("train", "--nproc", "1", "--out", str(out), "--resume", str(tmp_path / "half"))
    assert code == 1
    one_line(err, "not a complete checkpoint (no COMPLETE marker)")
    checkpoint_at(out, 4)
    for steps in ("3", "4"):
        code, err = main("train", "--nproc", "1", "--out", str(out), "--resume", "latest", "--steps", steps)
        assert code == 1
        one_line(err, f"--steps {steps}: the checkpoint", "is at step 4", "above 4")
    code, err = main("train", "--nproc", "1", "--out", str(out), "--resume", "latest", "--steps", "6", "--reference")
    assert code == 1
    one_line(err, "--reference: the checkpoint", "has no reference model", "resume without --reference")


def test_resume_continues_the_log_saved_with_the_checkpoint(tmp_path):
    from samples.train import earlier_steps

    path = checkpoint_at(tmp_path, 4)
    assert [r["step"] for r in earlier_steps(str(path), 4)] == [1, 2, 3, 4]  # step 5 came after the save
    assert earlier_steps(str(tmp_path), 4) == []  # a checkpoint saved without the steps: the log starts there


# ---- 4. output paths of selfcheck, calibrate, bench -----------------------------------------------------------


def test_selfcheck_json_path_is_checked_first(folder):
    out = run(folder, "selfcheck", "--json", "afile/x.json")
    assert out.returncode == 1 and out.stdout == ""
    one_line(out.stderr, "moepass selfcheck: --json afile/x.json: its folder", "cannot create the folder")


def test_selfcheck_json_that_is_a_folder(main):
    code, err = main("selfcheck", "--json", ".")
    assert code == 1
    one_line(err, "moepass selfcheck: --json .: is a folder")


def test_calibrate_out_is_checked_first(main, folder, capsys):
    code, err = main("calibrate", "--quick", "--out", "afile/p.json")
    assert code == 1
    one_line(err, "moepass calibrate: --out afile/p.json", "cannot create the folder")
    from cost_model.calibrate import run as calibrate  # its own entry point checks it too

    assert calibrate(Namespace(out=folder / "afile" / "p.json")) == 1
    one_line(capsys.readouterr().err, "calibrate: --out", "afile/p.json", "writable file path")


def test_bench_out_is_checked_first(main):
    code, err = main("bench", "kernel_bytes", "--out", "afile/results")
    assert code == 1
    one_line(err, "moepass bench: --out ", "afile/results: cannot create the folder")


# ---- 6. demo ----------------------------------------------------------------------------------------------


def test_demo_functions_refuse_zero_steps_and_ranks():
    from samples.demo import run as demo
    from samples.demo_ep import main as demo_ep

    with pytest.raises(ValueError, match="steps=0 is invalid"):
        demo(steps=0)
    for argv in (["--world", "0"], ["--world", "4", "--nodes", "3"]):
        with pytest.raises(SystemExit) as done:
            demo_ep(argv)
        assert done.value.code == 2


def test_demo_help_says_it_spawns_four_ranks(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert "4 gloo ranks" in " ".join(capsys.readouterr().out.split())


# ---- 7. explain's plan options ------------------------------------------------------------------------------


@pytest.mark.parametrize("form,needs", [("locality", "--mu"), ("auto", "--batch")])
def test_explain_form_that_needs_an_option(main, form, needs):
    code, err = main("explain", "cli_inputs_models:build", "--form", form)
    assert code == 1
    one_line(err, f"moepass explain: --form {form} needs {needs}")


def test_explain_ep_at_a_world_size(main, capsys):
    assert cli.main(["explain", "cli_inputs_models:build", "--form", "ep", "--ep-size", "4"]) == 0
    assert "fake process group at world size 4" in capsys.readouterr().out


def test_explain_option_the_form_does_not_use(main):
    code, err = main("explain", "cli_inputs_models:build", "--mu", "0.1")
    assert code == 1
    one_line(err, "moepass explain: Plan.mu=0.1 has no effect with form='single'")


# ---- 8. environment flags -------------------------------------------------------------------------------------


def test_a_bad_debug_flag_is_one_line(folder):
    out = run(folder, "explain", "cli_inputs_models:build", MOEPASS_DEBUG="maybe")
    assert out.returncode == 1 and out.stdout == ""
    one_line(out.stderr, "MOEPASS_DEBUG='maybe'", "'1', 'true'", "'0', 'false'")


# ---- 9. targets ---------------------------------------------------------------------------------------------

TARGETS = [
    ("cli_inputs_models.py:build", "give the dotted module name, cli_inputs_models:build"),
    ("./cli_inputs_models.py:build", "give the dotted module name, cli_inputs_models:build"),
    ("pkg/m:build", "give the dotted module name, pkg.m:build"),
    ("/abs/where/m.py:build", "run from /abs/where (or add it to PYTHONPATH) and give m:build"),
    ("cli_inputs_models:nosuch", "has no 'nosuch'. It defines build, dense."),
    ("cli_inputs_models:biuld", "has no 'biuld'. Did you mean 'build'?"),
]


@pytest.mark.parametrize("target,line", TARGETS)
def test_target_messages_name_the_module_spelling(main, target, line):
    code, err = main("explain", target)
    assert code == 1
    one_line(err, f"moepass explain: {target!r}" if ":nosuch" not in target and ":biuld" not in target
             else "moepass explain: module 'cli_inputs_models'", line)
    assert "torch" not in err


# ---- 10. a samples.py / lowering.py in the current directory ----------------------------------------------------


def test_own_packages_are_not_shadowed_by_the_current_directory(folder):
    out = run(folder, "train", "--help")
    assert out.returncode == 0 and "--resume" in out.stdout, out.stderr
    out = run(folder, "train", "--steps", "0")  # samples.train parsed the option: its validator answered
    assert out.returncode == 2
    one_line(out.stderr, "argument --steps: '0' is invalid")


# ---- 11. help texts -------------------------------------------------------------------------------------------


def test_help_says_where_bench_writes_and_where_scenario_paths_start(capsys):
    for command, words in (("bench", "inside the source checkout"), ("search", "relative to the repository root")):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert words in " ".join(capsys.readouterr().out.split())
