"""tests/_golden.py: only MOEPASS_UPDATE_GOLDEN=1 rewrites a snapshot, and a rewrite is still compared."""

from __future__ import annotations

import itertools

import pytest
from _golden import FLAG, check_golden


@pytest.mark.parametrize("value", [None, "", "0", "false", "yes", "true"])
def test_anything_but_1_compares_and_leaves_the_file(value, tmp_path, monkeypatch):
    if value is None:
        monkeypatch.delenv(FLAG, raising=False)
    else:
        monkeypatch.setenv(FLAG, value)
    path = tmp_path / "snap.txt"
    path.write_text("old\n")
    with pytest.raises(AssertionError, match="differs from"):
        check_golden(path, lambda: "new\n")
    assert path.read_text() == "old\n"
    check_golden(path, lambda: "old\n")  # equal text passes
    missing = tmp_path / "missing.txt"
    with pytest.raises(AssertionError, match="no snapshot"):
        check_golden(missing, lambda: "new\n")
    assert not missing.exists()


def test_1_rewrites_then_compares_a_second_rendering(tmp_path, monkeypatch):
    monkeypatch.setenv(FLAG, "1")
    path = tmp_path / "snap.txt"
    path.write_text("old\n")
    check_golden(path, lambda: "new\n")
    assert path.read_text() == "new\n"
    counter = itertools.count()
    with pytest.raises(AssertionError, match="differs from"):  # output that changes between renderings
        check_golden(path, lambda: f"render {next(counter)}\n")
