"""Bytes read + written per generated kernel vs the unfused torch reference it replaces (analytic).

Shape legend: T tokens, D model width, E experts, K top-k, N = T*K routed rows, B row blocks.

Kernels: counted by hand from the generated templates, launch by launch, using the same tile sizes
the templates use (`GatingSpec.block_t`, `PermuteSpec.block_n`, `CombineSpec.block_d`, ...). Every
load and store counts once per program that issues it (small vectors reloaded per program
included), gathers count the rows they fetch, no cache reuse is assumed.

References: counted, not estimated: the reference function runs on `meta` tensors under a
TorchDispatchMode that sees every aten op and adds the bytes of its tensor inputs (reads) and
outputs (writes). View ops move nothing; broadcast (stride-0) dims count once; a gather
(index_select / gather / index) reads as many source bytes as it outputs. Multi-pass internals of
a single aten op (e.g. the passes of a radix sort) are NOT counted, so the reference figures are
lower bounds. "intermediates" = tensors the reference materialises that are not its outputs.

Run:  .venv/bin/python benchmarks/kernel_bytes.py [--out PATH]  -> benchmarks/results/kernel_bytes.json + a table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel modules import anywhere; nothing is launched here

from lowering.combine import CombineSpec  # noqa: E402
from lowering.gating import GatingSpec  # noqa: E402
from lowering.permute import PermuteSpec  # noqa: E402
from moepass import dialect  # noqa: E402

aten = torch.ops.aten
RESULT = Path(__file__).resolve().parent / "results" / "kernel_bytes.json"
INT64 = 8
INT32 = 4


# ----------------------------------------------------------------------------------------------
# Counting the torch reference.
# ----------------------------------------------------------------------------------------------


def _touched(t: torch.Tensor) -> int:
    """Bytes an op touches in `t`: broadcast (stride-0) dims count once."""
    return t.element_size() * math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)


_NO_TRAFFIC = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.detach.default,
               aten.empty_strided.default, aten.lift_fresh.default}
_GATHERS = {aten.index_select.default, aten.gather.default, aten.index.Tensor}


class ByteCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []
        self.produced: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.moe.unpermute.default:  # inside a dialect backward formula: count its reference
            with self:  # re-enter so the reference's own aten ops are counted
                return dialect.unpermute_ref(*args, **kwargs)
        if func is aten.bincount.default:  # data-dependent size on meta: the reference passes minlength=E
            x, minlength = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            self.ops.append(("bincount", _touched(x), minlength * INT64))
            return torch.empty(minlength, dtype=torch.int64, device=x.device)
        out = func(*args, **kwargs)
        if func._schema.is_mutable is False and func.is_view or func in _NO_TRAFFIC:
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        reads = sum(_touched(t) for t in inputs)
        if func in _GATHERS:  # the source is read only where gathered
            reads = reads - _touched(inputs[0]) + sum(_touched(o) for o in outputs)
        self.ops.append((func.__name__, reads, sum(_touched(o) for o in outputs)))
        self.produced += outputs
        return out


@dataclass
class Count:
    read: int
    write: int
    launches: int = 0  # kernel launches (kernels) or aten ops (reference)
    intermediates: int = 0  # reference only: tensors materialised that are not outputs
    intermediate_bytes: int = 0

    @property
    def total(self) -> int:
        return self.read + self.write


def count_reference(fn, *args) -> Count:
    with ByteCounter() as counter:
        result = fn(*args)
    finals = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    final = {id(t) for t in finals} | {id(t._base) for t in finals if t._base is not None}  # views of outputs
    inter = [t for t in counter.produced if id(t) not in final]
    return Count(sum(r for _, r, _ in counter.ops), sum(w for _, _, w in counter.ops), len(counter.ops),
                 len(inter), sum(_touched(t) for t in inter))


# ----------------------------------------------------------------------------------------------
# Analytic kernel counts (one function per family, mirroring the templates).
# ----------------------------------------------------------------------------------------------


def gating_bytes(spec: GatingSpec, T: int) -> Count:
    ls = torch.empty(0, dtype=spec.logits_dtype).element_size()
    programs = math.ceil(T / spec.block_t)
    bias = programs * spec.E * torch.empty(0, dtype=spec.bias_dtype).element_size() if spec.bias_dtype else 0
    return Count(read=T * spec.E * ls + bias, write=T * spec.K * (ls + INT64), launches=1)


def permute_bytes(spec: PermuteSpec, T: int) -> Count:
    N = T * spec.K
    B = math.ceil(N / spec.block_n)
    xs = torch.empty(0, dtype=spec.x_dtype).element_size()
    es = torch.empty(0, dtype=spec.experts_dtype).element_size()
    histogram = Count(N * es, B * spec.E * INT32)
    scan = Count(B * spec.E * INT32, B * spec.E * INT32 + spec.E * INT64)
    scatter = Count(B * spec.E * (INT64 + INT32) + N * es + N * spec.D * xs, N * INT64 + N * spec.D * xs)
    return _sum([histogram, scan, scatter])


def combine_bytes(spec: CombineSpec, T: int, backward: bool = False) -> Count:
    N = T * spec.K
    ys = torch.empty(0, dtype=spec.y_dtype).element_size()
    ws = torch.empty(0, dtype=spec.weights_dtype).element_size() if spec.weights_dtype else 0
    if backward:  # one launch: order, weights, gathered grad rows, y rows -> grad_y rows, grad_w
        return Count(N * INT64 + N * ws + 2 * N * spec.D * ys, N * spec.D * ys + N * ws, launches=1)
    d_tiles = math.ceil(spec.D / spec.block_d)  # inverse indices and weights are reloaded per D tile
    invert = Count(N * INT64, N * INT64)
    gather = Count(d_tiles * N * (INT64 + ws) + N * spec.D * ys, T * spec.D * ys)
    return _sum([invert, gather])


def _sum(parts: list[Count]) -> Count:
    return Count(sum(p.read for p in parts), sum(p.write for p in parts), launches=len(parts))


# ----------------------------------------------------------------------------------------------
# The comparison.
# ----------------------------------------------------------------------------------------------

CONFIGS = {
    # name: T, D, E, K, router options (score, before, renorm, n_group, topk_group, group_score, scaling, bias)
    "mixtral_8x7b_like": (4096, 4096, 8, 2, ("softmax", True, True, 1, 1, "top2_sum", 1.0, False)),
    "deepseek_v3_like": (4096, 7168, 256, 8, ("sigmoid", True, True, 8, 4, "top2_sum", 2.5, True)),
}
X_DTYPE = torch.bfloat16


def rows(name: str) -> list[dict]:
    T, D, E, K, (score, before, renorm, n_group, topk_group, group_score, scaling, bias) = CONFIGS[name]
    meta = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")
    N = T * K
    logits_TE, bias_E = meta(T, E), meta(E) if bias else None
    route_args = (logits_TE, bias_E, score, before, K, renorm, n_group, topk_group, group_score, scaling)
    x_TD, experts_TK = meta(T, D, dtype=X_DTYPE), meta(T, K, dtype=torch.int64)
    y_ND, order_N, w_TK, grad_TD = meta(N, D, dtype=X_DTYPE), meta(N, dtype=torch.int64), meta(T, K), \
        meta(T, D, dtype=X_DTYPE)
    weighted = CombineSpec.from_args(y_ND, order_N, K, w_TK)
    unweighted = CombineSpec.from_args(y_ND, order_N, K, None)

    def unfused_combine_backward(grad_TD, y_ND, order_N, w_TK):
        y_TKD = dialect.unpermute_ref(y_ND, order_N, K)
        grad_y_TKD, grad_w_TK = dialect.combine_backward(grad_TD, y_TKD, w_TK)
        return dialect.unpermute_backward(grad_y_TKD, order_N), grad_w_TK

    def unfused_permute_backward(grad_ND, order_N):
        return dialect.permute_backward(grad_ND, order_N, K)

    table = [
        ("route forward", gating_bytes(GatingSpec.from_args(*route_args), T), count_reference(dialect.route_ref,
                                                                                              *route_args)),
        ("permute forward", permute_bytes(PermuteSpec.from_args(x_TD, experts_TK, E), T),
         count_reference(dialect.permute_ref, x_TD, experts_TK, E)),
        ("unpermute+combine forward", combine_bytes(weighted, T),
         count_reference(lambda *a: dialect.combine_ref(dialect.unpermute_ref(*a[:3]), a[3]), y_ND, order_N, K, w_TK)),
        ("unpermute+combine backward", combine_bytes(weighted, T, backward=True),
         count_reference(unfused_combine_backward, grad_TD, y_ND, order_N, w_TK)),
        ("permute backward", combine_bytes(unweighted, T), count_reference(unfused_permute_backward, y_ND, order_N)),
    ]
    out = []
    for op, kernel, ref in table:
        out.append(dict(
            config=name, op=op, T=T, D=D, E=E, K=K, x_dtype=str(X_DTYPE),
            kernel=dict(launches=kernel.launches, read=kernel.read, write=kernel.write, total=kernel.total),
            reference=dict(aten_ops=ref.launches, read=ref.read, write=ref.write, total=ref.total,
                           intermediates=ref.intermediates, intermediate_bytes=ref.intermediate_bytes),
            reference_over_kernel=round(ref.total / kernel.total, 3),
        ))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULT, help="JSON path (default benchmarks/results/kernel_bytes.json)")
    out = parser.parse_args(argv).out.resolve()
    results = [row for name in CONFIGS for row in rows(name)]
    out.parent.mkdir(parents=True, exist_ok=True)
    note = ("Analytic bytes read+written. Kernels: per launch from the generated templates' loads/stores. "
            "Reference: every aten op of the unfused torch reference on meta tensors (a lower bound: "
            "multi-pass internals such as sort passes are not counted). Route backward is not listed: the "
            "lowered op reuses the torch reference (route_backward_ref), so both sides are equal.")
    out.write_text(json.dumps(dict(note=note, results=results), indent=2) + "\n")
    mb = lambda b: f"{b / 2**20:9.2f}"
    print(f"{'config':18s} {'op':28s} {'kernel MiB':>10s} {'launch':>6s} {'ref MiB':>10s} {'ops':>4s} "
          f"{'interm.':>7s} {'interm MiB':>10s} {'ref/kernel':>10s}")
    for r in results:
        k, ref = r["kernel"], r["reference"]
        print(f"{r['config']:18s} {r['op']:28s} {mb(k['total']):>10s} {k['launches']:6d} {mb(ref['total']):>10s} "
              f"{ref['aten_ops']:4d} {ref['intermediates']:7d} {mb(ref['intermediate_bytes']):>10s} "
              f"{r['reference_over_kernel']:10.2f}")
    print(f"written {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
