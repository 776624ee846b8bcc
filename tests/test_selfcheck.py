"""`python -m moepass selfcheck` on this machine (CPU: kernels interpreted, 2 gloo ranks): every item ok or
skipped with its reason, every kernel family and every form in the table, exit status 0; with failures planted
(`--fault`) the planted items FAIL with a one-line error, the others still pass, and the exit status is 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowering
from moepass import cli
from moepass.plan import FORMS
from moepass.selfcheck import headline, item_names, kernel_items, machine

ROOT = Path(__file__).resolve().parents[1]
FORMS_CHECKED = [f for f in FORMS if f != "auto"]


def selfcheck(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    """Run the command as a user does (no TRITON_INTERPRET of the test session); rc, stdout, the JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out_json = tmp_path / "selfcheck.json"
    out = subprocess.run([sys.executable, "-m", "moepass", "selfcheck", "--json", str(out_json), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out_json.exists(), f"no JSON written (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.returncode, out.stdout, json.loads(out_json.read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_selfcheck_passes_here_and_lists_every_family_and_form(tmp_path):
    rc, stdout, report = selfcheck(tmp_path)
    items = {i["name"]: i for i in report["items"]}
    bad = {n: i for n, i in items.items() if i["verdict"] not in ("ok", "skipped")}
    assert rc == 0 and not bad and report["failed"] == [], (bad, stdout)
    assert all(i["detail"] for i in items.values() if i["verdict"] == "skipped"), "a skip without its reason"
    assert {f"kernel {f}" for f in lowering.FAMILIES} <= set(items), sorted(items)
    assert {f"form {f}" for f in FORMS_CHECKED} <= set(items), sorted(items)
    for op in ("all_to_all_single", "all_reduce"):
        assert {f"collective {op} 1 MiB", f"collective {op} 16 MiB"} <= set(items), sorted(items)
    # on this CPU machine nothing is skipped: the kernels run interpreted, the forms on 2 gloo ranks
    assert all(items[f"kernel {f}"]["verdict"] == "ok" and "interpreted" in items[f"kernel {f}"]["detail"]
               for f in lowering.FAMILIES)
    assert all(items[f"form {f}"]["verdict"] == "ok" and "W=2 gloo" in items[f"form {f}"]["detail"]
               for f in FORMS_CHECKED if f != "single")
    head = report["header"]
    assert head["backend"] == "gloo" and head["world_size"] == 2 and head["torch"] and head["devices"]
    assert stdout.splitlines()[0].startswith("moepass selfcheck: torch ") and all(name in stdout for name in items)
    assert f"{len(items)}/{len(items)} items ok or skipped" in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_planted_failures_fail_their_items_only_and_the_exit_status(tmp_path):
    rc, stdout, report = selfcheck(tmp_path, "--fault", "kernel:combine", "--fault", "form:ep")
    items = {i["name"]: i for i in report["items"]}
    assert rc == 1, stdout
    assert report["failed"] == ["kernel combine", "form ep"], stdout
    combine, ep = items["kernel combine"], items["form ep"]
    assert combine["detail"].startswith("AssertionError: unpermute_combine ") and "\n" not in combine["detail"]
    assert ep["detail"].startswith("W=2 gloo: rank 0: AssertionError: loss: ") and "\n" not in ep["detail"]
    assert all(i["verdict"] == "ok" for n, i in items.items() if n not in ("kernel combine", "form ep"))
    assert "FAILED: kernel combine, form ep" in stdout.splitlines()[-1]


@pytest.mark.slow
def test_a_kernel_child_that_exits_with_an_error_fails_every_family_with_it():
    """The child process that runs the kernel checks fails before any check (here: an argument it refuses):
    each family is a FAIL carrying the child's one-line error, and the call returns (nothing raises)."""
    items = kernel_items(machine(), ["no_such_family"])
    assert [i.name for i in items] == [f"kernel {f}" for f in lowering.FAMILIES]
    assert all(i.verdict == "FAIL" for i in items)
    assert "exited with 1: ValueError: lowering.numerics: --fault ['no_such_family'] names no kernel family" in \
        items[0].detail, items[0].detail


def test_an_unknown_fault_names_the_items():
    with pytest.raises(SystemExit, match=r"selfcheck --fault \['kernel:nope'\]: no such item; choose from "):
        cli.main(["selfcheck", "--fault", "kernel:nope"])
    assert set(item_names()) == {f"kernel:{f}" for f in lowering.FAMILIES} | {f"form:{f}" for f in FORMS_CHECKED}


def test_selfcheck_is_a_listed_subcommand():
    parser = cli.build_parser()
    assert "selfcheck" in parser.format_help()
    args = parser.parse_args(["selfcheck", "--json", "out.json"])
    assert args.fn is cli.selfcheck and args.json == "out.json" and args.fault == []


def test_headline_is_the_exception_line_with_the_largest_difference():
    tb = ("--- rank 1 ---\nTraceback (most recent call last):\n  File \"x.py\", line 3, in f\n    assert_close(a, b)\n"
          "AssertionError: gradient w: Tensor-likes are not close!\n\nMismatched elements: 1 / 4 (25.0%)\n"
          "Greatest absolute difference: 0.5 at index (0,) (up to 1e-05 allowed)\n")
    assert headline(tb) == ("rank 1: AssertionError: gradient w: Tensor-likes are not close! "
                            "(Greatest absolute difference: 0.5 at index (0,) (up to 1e-05 allowed))")
    assert headline("RuntimeError: no GPU") == "RuntimeError: no GPU"
