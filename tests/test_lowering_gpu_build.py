"""Compile-only GPU check: every generated kernel family builds to PTX + cubin for sm_80 and sm_90.

Runs on CPU: `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` with the ptxas and
cuobjdump that ship with triton, in one clean child process (`lowering.codegen.build_many`). Asserts
no local memory (register spills) and shared memory within the per-block opt-in limit.

Specialisations built (meta tensors: only shapes and dtypes matter):
  gating   Mixtral (E=8, K=2), DeepSeek-V3 (E=256, K=8, 8 groups keep 4, sigmoid, bias, scaling),
           Qwen-style bf16 (E=60, K=4, no renorm), softmax-after-top-k bf16 with bias (E=6)
  permute  D=4096 E=8 K=2 bf16; D=7168 E=256 K=8 bf16; D=20 E=6 K=3 fp32 with int32 ids
  combine  D=4096 K=2 bf16 + fp32 weights; D=7168 K=8 bf16; unweighted (permute backward) D=20 fp32
"""

from __future__ import annotations

import pytest
import torch

from lowering import codegen as cg
from lowering import combine, gating, permute

ARCHS = (80, 90)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


SPECS = {
    "gating/mixtral": (gating, (_meta(1, 8), None, "softmax", True, 2, True, 1, 1, "top2_sum", 1.0)),
    "gating/deepseek_v3": (gating, (_meta(1, 256), _meta(256), "sigmoid", True, 8, True, 8, 4, "top2_sum", 2.5)),
    "gating/qwen_bf16": (gating, (_meta(1, 60, dtype=torch.bfloat16), None, "softmax", True, 4, False, 1, 1,
                                  "top2_sum", 1.0)),
    "gating/softmax_after_bf16": (gating, (_meta(1, 6, dtype=torch.bfloat16), _meta(6), "softmax", False, 2, True,
                                           1, 1, "top2_sum", 1.0)),
    "permute/mixtral": (permute, (_meta(1, 4096, dtype=torch.bfloat16), _meta(1, 2, dtype=torch.int64), 8)),
    "permute/deepseek_v3": (permute, (_meta(1, 7168, dtype=torch.bfloat16), _meta(1, 8, dtype=torch.int64), 256)),
    "permute/int32_ids": (permute, (_meta(1, 20), _meta(1, 3, dtype=torch.int32), 6)),
    "combine/mixtral": (combine, (_meta(2, 4096, dtype=torch.bfloat16), _meta(2, dtype=torch.int64), 2,
                                  _meta(1, 2))),
    "combine/deepseek_v3": (combine, (_meta(8, 7168, dtype=torch.bfloat16), _meta(8, dtype=torch.int64), 8,
                                      _meta(1, 8))),
    "combine/unweighted": (combine, (_meta(3, 20), _meta(3, dtype=torch.int64), 3, None)),
}


pytestmark = pytest.mark.skipif(cg.gpu_build_blocker() is not None, reason=str(cg.gpu_build_blocker()))


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, int], list[cg.BuildReport]]:
    """All builds in one child process: {(spec, arch): [BuildReport per kernel]}."""
    keys, requests = [], []
    for name, (family, args) in SPECS.items():
        module = family.kernel_module(*args)
        for arch in ARCHS:
            batch = cg.module_requests(module, arch)
            keys += [(name, arch)] * len(batch)
            requests += batch
    out: dict[tuple[str, int], list[cg.BuildReport]] = {}
    for key, report in zip(keys, cg.build_many(requests)):
        out.setdefault(key, []).append(report)
    return out


EXPECTED_KERNELS = {
    "gating": ["route_kernel"],
    "permute": ["histogram_kernel", "scan_kernel", "scatter_kernel"],
    "combine": ["invert_kernel", "combine_kernel", "combine_backward_kernel"],
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(SPECS))
def test_builds_without_spills_within_shared_memory(reports, name, arch):
    built = reports[(name, arch)]
    expected = EXPECTED_KERNELS[name.split("/")[0]]
    if name == "combine/unweighted":
        expected = expected[:2]
    assert [r.name for r in built] == expected
    for report in built:
        assert report.ptx_bytes > 0 and report.cubin_bytes > 0 and report.registers > 0
        assert report.problems() == [], report
        assert report.local_bytes == 0 and report.shared_bytes <= cg.SHARED_LIMIT_BYTES[arch]


def test_problems_flag_spills_and_shared_memory():
    report = cg.BuildReport(name="k", arch=80, num_warps=4, ptx_bytes=1, cubin_bytes=1, registers=255,
                            local_bytes=16, stack_bytes=0, shared_bytes=200 * 1024, seconds=0.0)
    problems = report.problems()
    assert len(problems) == 2 and "spills" in problems[0] and "166912" in problems[1]
    assert cg.SHARED_LIMIT_BYTES[90] == 227 * 1024
