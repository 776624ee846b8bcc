"""GPU numerics of every kernel family in `lowering/`: the compiled Triton kernels on CUDA against their
torch references, forward and backward (lowering/numerics.py says what each family checks; `python -m moepass
selfcheck` runs the same checks).

The kernels run in a child process with TRITON_INTERPRET=0: this session imports Triton interpreted
(tests/conftest.py) and Triton reads the flag when it is imported. The `gpu` tests are skipped, with
the reason, where torch.cuda.is_available() is False (tests/conftest.py). On CPU the same checks run
interpreted on small shapes, so the GPU tests' code is exercised everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowering

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("gating", "permute", "grouped_gemm", "combine")


def run_harness(device: str, interpret: str, timeout: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                                                       os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "lowering.numerics", device], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["interpret"] == interpret
    return report


@pytest.fixture(scope="module")
def cuda_report():
    return run_harness("cuda", "0", timeout=1800)


def test_every_kernel_family_has_a_gpu_check():
    from lowering import numerics

    assert set(FAMILIES) == set(lowering.FAMILIES) == set(numerics.CHECKS)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_matches_torch_reference_on_cuda(family, cuda_report):
    result = cuda_report["families"][family]
    assert result["ok"], f"{family} on {cuda_report['device']}:\n{result['error']}"
    assert result["checks"] > 0


@pytest.mark.slow
def test_gpu_checks_run_interpreted_on_cpu():
    report = run_harness("cpu", "1", timeout=600)
    for family in FAMILIES:
        result = report["families"][family]
        assert result["ok"] and result["checks"] > 0, f"{family}:\n{result['error']}"


@pytest.mark.gpu
def test_direct_launch_gives_the_bits_of_tritons_path_on_cuda(tmp_path):
    """lowering/launcher.py's direct launch against Triton's own path, for a jit kernel, an autotuned one and the
    expert FFN (benchmarks/launch_overhead.py, few launches): the same output bits, fewer Python calls."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "benchmarks/launch_overhead.py", "--rounds", "2", "--launches", "50", "--out",
                          str(tmp_path / "launch.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    cases = json.loads((tmp_path / "launch.json").read_text())["cases"]
    assert set(cases) == {"jit", "autotuned", "expert_ffn"}
    for name, row in cases.items():
        assert row["bit_identical"], name
        assert row["direct"]["python_calls"] < row["plain"]["python_calls"], name
