"""Compile-only GPU build of the grouped-GEMM kernels for sm_80 and sm_90 (no GPU needed).

Every kernel role (gate_up forward, gate_up backward, rows, wgrad) in its widest variant (every
optional operand present) x every config it may be autotuned over, built to PTX + cubin in one child
process (`codegen.build_many`), then `cuobjdump --dump-resource-usage`: shared memory within the
arch's limit and no register spills (local memory / stack).

The build sees what a real launch specialises to (`gpu_build_requests`): 16-byte aligned pointers,
ints divisible by 16, unit strides as constants. Without those hints Triton can neither vectorise
nor pipeline the loads, and large tiles spill: the check would not describe what runs.
"""

from __future__ import annotations

import pytest

from lowering import codegen

gg = pytest.importorskip("lowering.grouped_gemm")

ARCHS = (80, 90)
# (spec, which configs): the 16-bit path with every config, fp32 (IEEE products) with the ends of each list.
BUILDS = (
    (gg.FfnSpec("swiglu", True, True, True, True, "bfloat16", False, False), "all"),
    (gg.FfnSpec("clamped_swiglu", True, False, False, False, "float32", False, False), "ends"),
)


@pytest.fixture(scope="module")
def reports():
    requests = [(spec, role, cfg, request) for spec, which in BUILDS for arch in ARCHS
                for role, cfg, request in gg.gpu_build_requests(spec, arch, which=which)]
    built = codegen.build_many([r[-1] for r in requests])
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


def test_no_register_spills(reports):
    problems = [f"{spec.dtype} {role} {cfg}: {p}" for spec, role, cfg, report in reports for p in report.problems()]
    assert not problems, "\n".join(problems)


def test_operand_loads_are_pipelined(reports):
    """At least num_stages - 1 buffers of the operand tiles live in shared memory (cp.async / TMA pipelining)."""
    for spec, role, cfg, report in reports:
        elem = 4 if spec.dtype == "float32" else 2
        buffered = gg.shared_bytes_estimate(role, cfg, elem, spec.gated) * (cfg.num_stages - 1) // cfg.num_stages
        assert report.shared_bytes >= buffered, (spec.label, role, cfg, report.arch, report.shared_bytes, buffered)
