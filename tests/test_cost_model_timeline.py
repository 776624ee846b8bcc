"""`cost_model.timeline`: an op of k pieces runs as k ops issued back to back on its stream, under both
sharing policies (the step, each stream's busy time and the all-to-all's longest wait are the same)."""

from __future__ import annotations

import pytest

from cost_model.timeline import POLICIES, Timeline


def _step(pieced: bool, policy: str) -> Timeline:
    """Compute, then an all-reduce of 5 pieces on "other" while a chain of all-to-alls and compute runs."""
    tl = Timeline()
    start = tl.add("compute", "start", 0.1)
    if pieced:
        tl.add("other", "ar", 5 * 0.3, [start], pieces=5)
    else:
        for j in range(5):
            tl.add("other", f"ar{j}", 0.3, [start])
    last = start
    for j in range(4):
        a2a = tl.add("a2a", f"a2a{j}", 0.2, [last])
        last = tl.add("compute", f"c{j}", 0.25, [a2a])
    return tl.run(policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_pieced_op_equals_its_pieces(policy):
    ops, pieced = _step(False, policy), _step(True, policy)
    assert pieced.step == pytest.approx(ops.step, rel=1e-12)
    for key, value in ops.breakdown().items():
        assert pieced.breakdown()[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_pieces_must_be_positive():
    with pytest.raises(ValueError, match="pieces=0 is invalid"):
        Timeline().add("other", "ar", 1.0, pieces=0)
