"""Golden-file snapshots: compared by default, rewritten only with MOEPASS_UPDATE_GOLDEN=1.

    check_golden(path, render)   render() -> text; the test fails when it differs from the file

Only the exact value "1" rewrites: "0", "" or anything else compares. After a rewrite the text is
rendered a second time, from scratch, and compared with the file just written, so an update run
still fails on output that differs between two renderings; the updated file is then checked by the
next run without the flag (review `git diff tests/golden` in between).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path

FLAG = "MOEPASS_UPDATE_GOLDEN"


def update_requested() -> bool:
    return os.environ.get(FLAG) == "1"


def check_golden(path: Path, render: Callable[[], str]) -> None:
    text = render()
    if update_requested():
        path.write_text(text)
        text = render()  # a second rendering, compared below with what was written
    assert path.exists(), f"no snapshot {path}: run with {FLAG}=1 once and review it"
    want = path.read_text()
    if text != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "now"))[:60])
        raise AssertionError(f"output differs from {path}: if deliberate, rerun with {FLAG}=1 and review the diff\n"
                             f"{diff}")
