"""The command line as users run it: `moepass ...` (the console script pip writes) and `python -m moepass ...`,
in subprocesses, from a project folder that is not the checkout. Every subcommand's options are parsed and
listed by --help; `module:callable` is imported from the current directory by both entry points; bad input
ends with one line on stderr naming the fix, no traceback, exit status 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moepass import cli

ROOT = Path(__file__).resolve().parents[1]
# what pip writes for `[project.scripts] moepass = "moepass.cli:main"`: its sys.path[0] is its own folder
CONSOLE_SCRIPT = textwrap.dedent("""\
    import re
    import sys
    from moepass.cli import main
    if __name__ == '__main__':
        sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
        sys.exit(main())
""")
MODELS = textwrap.dedent("""\
    from samples.models import tiny_mixtral

    def build():
        return tiny_mixtral(style="loop", vocab_size=64, dim=32, ffn_dim=64, num_experts=4, top_k=2, layers=1,
                            heads=4)

    def broken():
        raise RuntimeError("no weights at /data/ckpt")

    def not_a_model():
        return {"layers": 2}
""")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's folder holding `mymodels.py`, and the console script in a `bin/` elsewhere."""
    base = tmp_path_factory.mktemp("cli")
    (base / "proj").mkdir()
    (base / "proj" / "mymodels.py").write_text(MODELS)
    (base / "bin").mkdir()
    (base / "bin" / "moepass").write_text(CONSOLE_SCRIPT)
    return base


def run(project: Path, *argv: str, entry: str = "script") -> subprocess.CompletedProcess:
    command = [sys.executable, str(project / "bin" / "moepass")] if entry == "script" else \
        [sys.executable, "-m", "moepass"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEPASS_DEBUG": "0"}
    return subprocess.run([*command, *argv], cwd=project / "proj", env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("entry", ["script", "module"])
def test_both_entry_points_import_module_callable_from_the_current_directory(project, entry):
    out = run(project, "explain", "mymodels:build", entry=entry)
    assert out.returncode == 0, out.stderr
    assert "1 MoE block(s) accepted" in out.stdout and "== layers.0.mlp" in out.stdout


BAD = [  # argv, the one line on stderr (a regex); a misspelt --form: tests/test_cli_inputs.py (a usage error)
    (["explain", "nomodule:build"],
     r"moepass explain: no module 'nomodule' in the current directory \(.*proj\) or on PYTHONPATH: run from the "
     r"folder that holds it, or add that folder to PYTHONPATH"),
    (["explain", "mymodels:biuld"], r"moepass explain: module 'mymodels' has no 'biuld'. Did you mean 'build'\?"),
    (["explain", "mymodels"], r"moepass explain: 'mymodels' is not of the form module:callable"),
    (["explain", "mymodels:broken"],
     r"moepass explain: mymodels:broken\(\) raised RuntimeError: no weights at /data/ckpt \(fix the builder; "
     r"MOEPASS_DEBUG=1 shows the traceback\)"),
    (["explain", "mymodels:not_a_model"],
     r"moepass explain: mymodels:not_a_model gave a dict, not a torch.nn.Module: name a callable that returns "
     r"the model"),
    (["search", "mymodels:broken"], r"moepass search: mymodels:broken\(\) raised RuntimeError"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=["no-module", "no-callable", "no-colon", "raising-builder",
                                                "not-a-model", "search-raising-builder"])
def test_bad_input_is_one_line_with_the_fix_and_exit_status_1(project, argv, line):
    import re

    out = run(project, *argv)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert re.fullmatch(line + r".*", out.stderr.strip()), out.stderr


def test_debug_shows_the_traceback(project):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEPASS_DEBUG": "1"}
    out = subprocess.run([sys.executable, str(project / "bin" / "moepass"), "explain", "mymodels:broken"],
                         cwd=project / "proj", env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "Traceback" in out.stderr and "RuntimeError: no weights" in out.stderr


SUBCOMMAND_OPTIONS = {  # every option each subcommand takes, as --help lists it
    "demo": ["--style", "--steps", "--no-graph", "--no-ep"],
    "explain": ["target", "--form", "--ep-size", "--batch", "--mu"],
    "search": ["target", "--scenario", "--nodes", "--ranks-per-node", "--batch", "--seq", "--profile", "--limit"],
    "calibrate": ["--out", "--quick", "--reps", "--timeout", "--no-progress", "--no-host"],
    "bench": ["names", "--all", "--quick", "--full", "--out"],
    "selfcheck": ["--json", "--fault"],
    "train": ["--form", "--nproc", "--device", "--steps", "--seed", "--seq", "--global-batch", "--experts", "--top-k",
              "--lr", "--warmup", "--clip", "--ep-size", "--fsdp", "--grad-sync", "--bf16", "--ac", "--compile",
              "--reference", "--out", "--ckpt-every", "--resume"],
}


def test_every_subcommand_lists_its_options_in_help(capsys):
    parser = cli.build_parser()
    subparsers = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    assert set(subparsers) == set(SUBCOMMAND_OPTIONS)
    for command, options in SUBCOMMAND_OPTIONS.items():
        with pytest.raises(SystemExit) as done:
            parser.parse_args([command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert all(option in text for option in options), (command, text)
    assert "single, ep, fsep, hp, locality, auto" in " ".join(subparsers["explain"].format_help().split())


def test_calibrate_options_are_parsed_not_swallowed(project):
    """`moepass calibrate --quick --out X` was "unrecognized arguments" (argparse.REMAINDER): its options are
    the calibration's own (cost_model.calibrate.add_arguments), parsed by the moepass parser."""
    args = cli.build_parser().parse_args(["calibrate", "--quick", "--out", "x.json", "--reps", "3"])
    assert (args.fn, args.quick, str(args.out), args.reps, args.no_host) == (cli.calibrate, True, "x.json", 3, False)
    out = run(project, "calibrate", "--quick", "--out", "x.json", "--help")
    assert out.returncode == 0 and "--no-host" in out.stdout and "unrecognized" not in out.stderr
    out = run(project, "calibrate", "--quikc")
    assert out.returncode == 2 and "unrecognized arguments: --quikc" in out.stderr


@pytest.mark.slow
def test_train_resume_continues_the_log(project, tmp_path):
    """A run checkpointed at step 2 and resumed to step 3: train_log.json holds steps 1, 2 and 3 (each
    checkpoint keeps the log's steps so far), and a resume to a step the checkpoint already reached is refused
    before any rank starts."""
    import json

    tiny = ["train", "--form", "single", "--nproc", "1", "--dim", "16", "--ffn-dim", "32", "--layers", "1",
            "--experts", "2", "--heads", "2", "--global-batch", "2", "--seq", "16", "--out", str(tmp_path)]
    out = run(project, *tiny, "--steps", "2", "--ckpt-every", "2")
    assert out.returncode == 0, out.stderr
    out = run(project, *tiny, "--steps", "2", "--resume", "latest")
    assert out.returncode == 1 and "Traceback" not in out.stderr and "is at step 2" in out.stderr
    out = run(project, *tiny, "--steps", "3", "--resume", "latest")
    assert out.returncode == 0, out.stderr
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert [r["step"] for r in log["steps"]] == [1, 2, 3] and log["start_step"] == 2
