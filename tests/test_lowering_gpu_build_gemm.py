"""Compile-only GPU build of the grouped-GEMM kernels for sm_80 and sm_90 (no GPU needed).

Every kernel role (gate_up forward, gate_up backward, rows, wgrad) in its widest variant (every
optional operand present) x every config it may be autotuned over, built to PTX + cubin in one child
process (`_codegen.build_many`), then `cuobjdump --dump-resource-usage`: shared memory within the
arch's limit and no register spills (local memory / stack).

The spill check needs the build to see what a real launch specialises: 16-byte aligned pointers and
ints divisible by 16. Without those hints Triton cannot vectorise or pipeline the loads and every
large tile spills, so that check runs only when `_codegen.BuildRequest` accepts `divisible`.
"""

from __future__ import annotations

import pytest

from lowering import _codegen

gg = pytest.importorskip("lowering.grouped_gemm")

ARCHS = (80, 90)
# (spec, which configs): the 16-bit path with every config, fp32 (IEEE products) with the ends of each list.
BUILDS = (
    (gg.FfnSpec("swiglu", True, True, True, True, "bfloat16", False, False), "all"),
    (gg.FfnSpec("clamped_swiglu", True, False, False, False, "float32", False, False), "ends"),
)
HINTS = "divisible" in _codegen.BuildRequest.__dataclass_fields__


@pytest.fixture(scope="module")
def reports():
    requests = [(spec, role, cfg, request) for spec, which in BUILDS for arch in ARCHS
                for role, cfg, request in gg.gpu_build_requests(spec, arch, which=which)]
    built = _codegen.build_many([r[-1] for r in requests])
    return [(spec, role, cfg, report) for (spec, role, cfg, _), report in zip(requests, built)]


def test_every_role_builds_for_both_archs(reports):
    seen = {(spec.dtype, role, report.arch) for spec, role, _, report in reports}
    for spec, _ in BUILDS:
        for role in gg.ROLES:
            for arch in ARCHS:
                assert (spec.dtype, role, arch) in seen
    for _, _, _, report in reports:
        assert report.cubin_bytes > 0 and report.ptx_bytes > 0


def test_shared_memory_within_limit(reports):
    for spec, role, cfg, report in reports:
        assert report.shared_bytes <= report.shared_limit_bytes, (spec.label, role, cfg, report)
        # The autotune pruner's estimate is an upper bound of what the compiler allocates.
        elem = 4 if spec.dtype == "float32" else 2
        assert report.shared_bytes <= gg.shared_bytes_estimate(role, cfg, elem, spec.gated) + 2048, (role, cfg, report)


@pytest.mark.xfail(not HINTS, strict=False,
                   reason="_codegen.BuildRequest has no `divisible` hints: the build cannot see 16-byte "
                          "alignment, so loads are neither vectorised nor pipelined and large tiles spill")
def test_no_register_spills(reports):
    problems = [f"{spec.dtype} {role} {cfg}: {p}" for spec, role, cfg, report in reports for p in report.problems()]
    assert not problems, "\n".join(problems)
