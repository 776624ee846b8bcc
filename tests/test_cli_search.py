"""`python -m moepass search --scenario …`: a readable ranked table per case of a published set-up."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cost_model.search import search_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT.parent / "shared" / "scenarios"
LINA = SCENARIOS / "lina_priority.json"

pytestmark = pytest.mark.skipif(not LINA.exists(), reason=f"{LINA} not present (shared/ sits beside the repo)")


def test_search_scenario_ranks_every_case():
    results = search_scenario(LINA)
    labels = [label for label, _ in results]
    assert len(results) == 12 and "gpt2[E=16] W=16" in labels  # 3 models x 4 expert counts, devices = experts
    for _, result in results:
        assert result.best.step <= min(c.step for c in result.ranked if c.feasible and not c.math_changing)


def test_cli_prints_a_table_in_under_ten_seconds():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "moepass", "search", "--scenario", str(LINA), "--limit", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert "scenario lina-priority: hardware a100" in out.stdout
    assert "filled intra_node_bw: preset a100" in out.stdout  # a null figure names the preset that filled it
    assert out.stdout.count("best: ") == 12 and "fsep: FSEP (LAER-MoE): not modelled yet" in out.stdout
    print(f"search --scenario took {seconds:.1f} s")
