"""Numerics of every kernel family in `lowering/` against its torch reference, forward and backward, in
fp32 and 16-bit, on one device. `tests/test_kernels_gpu.py` and `python -m moepass selfcheck` both run it,
in a process of its own:

    TRITON_INTERPRET=0 python -m lowering.numerics cuda      # compiled kernels on the GPU
    TRITON_INTERPRET=1 python -m lowering.numerics cpu       # the same checks interpreted, small shapes

The last line of stdout is JSON: {"device", "interpret", "families": {family: {"ok": bool, "checks": int,
"seconds": float, "error": str | None}}}; a family's failure is reported there, not raised, so each family
shows its own. A process of its own because Triton reads TRITON_INTERPRET when it is imported.

Every check first makes sure the Triton path runs, not the torch fallback: the registry's `eligible`
must accept the arguments and the family's fallback counters must not move. References run on the
same device (fp32); 16-bit kernels are compared with the fp32 reference of the same rounded inputs.

`--fault FAMILY` plants a wrong result on purpose (the family's kernel output is offset before it is
compared): how the callers' tests prove that a wrong kernel is reported as a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from lowering import FAMILIES, codegen, registry
from moepass import dialect
from moepass.activations import ACTIVATIONS, GATED_ACTIVATIONS
from moepass.process_state import KERNEL_FAULTS

# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------


def _entry(family: str):
    (entry,) = [r for r in registry() if r.family == family]
    if family in KERNEL_FAULTS:
        return dataclasses.replace(entry, lowered_op=_offset(entry.lowered_op))
    return entry


def _offset(op: Callable) -> Callable:
    """`op` with its first floating-point output moved by 0.5 (a planted fault, `--fault`)."""

    def wrong(*args):
        out = op(*args)
        outputs = list(out) if isinstance(out, tuple) else [out]
        first = next(i for i, t in enumerate(outputs) if t.is_floating_point())
        outputs[first] = outputs[first] + 0.5
        return tuple(outputs) if isinstance(out, tuple) else outputs[0]

    return wrong


@contextlib.contextmanager
def _triton_path(family: str, args: tuple) -> Iterator[None]:
    """Fails unless the arguments are eligible and no launch of the family falls back to torch."""
    reason = _entry(family).eligible(*args)
    assert reason is None, f"{family}: not eligible, the torch fallback would run: {reason}"
    before = dict(codegen.FALLBACKS)
    yield
    assert dict(codegen.FALLBACKS) == before, f"{family}: fell back to the torch reference: {before} -> {dict(codegen.FALLBACKS)}"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, fp32_tol: float = 1e-5) -> None:
    """fp32: rtol = atol = fp32_tol; 16-bit results: 1e-2, atol relative to the reference's scale."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected.float(), rtol=fp32_tol, atol=fp32_tol, msg=lambda m: f"{what}: {m}")
    else:
        scale = max(expected.abs().max().item(), 1e-6) if expected.numel() else 1.0
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=1e-2 * scale,
                                   msg=lambda m: f"{what}: {m}")


def _stable_topk(input, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties broken by the lowest index, as the gating kernel does."""
    indices = torch.sort(input, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((input.gather(dim, indices), indices))


@contextlib.contextmanager
def _stable_reference() -> Iterator[None]:
    original = torch.topk
    torch.topk = _stable_topk
    try:
        yield
    finally:
        torch.topk = original


# ----------------------------------------------------------------------------------------------
# gating: moe_lowered::route against dialect.route_ref.
# ----------------------------------------------------------------------------------------------


def _without_near_ties(args: tuple) -> tuple:
    """Keep the token rows whose choice of experts no perturbation of 1e-5 changes (fp64 reference):
    there the kernel's and torch's last-bit differences in scores (exp, sigmoid) cannot pick another
    expert, so the experts must agree exactly."""
    logits_TE, bias_E, *rest = args
    gen = torch.Generator().manual_seed(7)
    base = logits_TE.double().cpu()
    bias = None if bias_E is None else bias_E.double().cpu()
    with _stable_reference():
        _, chosen = dialect.route_ref(base, bias, *rest)
        keep = torch.ones(base.shape[0], dtype=torch.bool)
        for _ in range(6):
            noise = (torch.rand(base.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 1e-5
            keep &= (dialect.route_ref(base + noise, bias, *rest)[1] == chosen).all(1)
    assert keep.float().mean() > 0.9, f"gating: {int((~keep).sum())} of {len(keep)} rows have near-ties"
    return (logits_TE[keep.to(logits_TE.device)].contiguous(), bias_E, *rest)


def check_gating(device: str, small: bool) -> int:
    T = 64 if small else 2048
    gen = torch.Generator().manual_seed(0)
    #        E   K  score      before renorm G  TG group       scale bias   dtype           grid
    cases = [
        (8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float32, False),  # Mixtral
        (60, 4, "softmax", True,  False, 1, 1, "top2_sum", 1.0, False, torch.float32, False),  # Qwen
        (10, 3, "softmax", False, True,  1, 1, "top2_sum", 1.0, True,  torch.float32, False),  # softmax after top-k
        (64, 8, "sigmoid", True,  True,  8, 4, "top2_sum", 2.5, True,  torch.float32, False),  # DeepSeek-V3
        (12, 3, "sigmoid", True,  True,  4, 2, "max",      1.5, True,  torch.float32, False),
        (8,  2, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.bfloat16, True),
        (16, 4, "softmax", True,  True,  1, 1, "top2_sum", 1.0, False, torch.float16, True),
    ]
    checks = 0
    for E, K, score, before, renorm, G, TG, group_score, scale, has_bias, dtype, grid in cases:
        what = f"route E={E} K={K} {score} groups={G}/{TG} {dtype}"
        if grid:  # logits 1/8 apart: distinct ones stay distinct after rounding, equal ones tie exactly
            logits = (torch.randint(-32, 33, (T, E), generator=gen) / 8).to(dtype)
        else:
            logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
        bias = torch.randn(E, generator=gen).to(device) if has_bias else None
        args = (logits.to(device), bias, score, before, K, renorm, G, TG, group_score, scale)
        if not grid:
            args = _without_near_ties(args)
        with _triton_path("gating", args):
            weights, experts = _entry("gating").lowered_op(*args)
        with _stable_reference():
            want_weights, want_experts = dialect.route_ref(*args)
        assert experts.device.type == device and weights.dtype == dtype, what
        assert torch.equal(experts, want_experts), f"{what}: experts differ in {(experts != want_experts).any(1).sum()} rows"
        _close(weights, want_weights, what)
        # backward: the weights' gradient through the lowered op (its autograd wiring) and the dialect op
        grad_TK = torch.randn(weights.shape, generator=gen).to(dtype).to(device)
        grads = []
        for op in (_entry("gating").lowered_op, dialect.ROUTE):
            leaf = args[0].detach().clone().requires_grad_()
            with _triton_path("gating", args) if op is not dialect.ROUTE else _stable_reference():
                (grad,) = torch.autograd.grad(op(leaf, *args[1:])[0], leaf, grad_TK)
            grads.append(grad)
        _close(grads[0], grads[1], f"{what}: grad_logits")
        checks += 1
    return checks


# ----------------------------------------------------------------------------------------------
# permute: moe_lowered::permute (and its backward kernel) against dialect.permute_ref / moe.permute.
# ----------------------------------------------------------------------------------------------


def check_permute(device: str, small: bool) -> int:
    gen = torch.Generator().manual_seed(1)
    #         T     D    E    K  dtype           routing
    cases = [(4096, 256, 64,  4, torch.float32,  "random"),
             (3001, 200, 8,   2, torch.bfloat16, "random"),
             (1024, 64,  1000, 8, torch.float16, "random"),
             (2048, 128, 16,  2, torch.float32,  "skewed")]
    if small:
        cases = [(40, 24, 8, 2, torch.float32, "random"), (33, 20, 6, 3, torch.bfloat16, "skewed")]
    checks = 0
    for T, D, E, K, dtype, routing in cases:
        what = f"permute T={T} D={D} E={E} K={K} {dtype} {routing}"
        x = torch.randn(T, D, generator=gen).to(dtype).to(device)
        if routing == "skewed":  # heavily skewed, the same expert twice in a token allowed
            experts = (torch.rand(T, K, generator=gen) ** 4 * E).long().clamp(max=E - 1)
        else:
            experts = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
        experts = experts.to(device)
        args = (x, experts, E)
        with _triton_path("permute", args):
            x_ND, counts_E, order_N = _entry("permute").lowered_op(*args)
        want_x, want_counts, want_order = dialect.permute_ref(*args)
        assert torch.equal(order_N, want_order), f"{what}: order"  # data movement: bit for bit
        assert torch.equal(counts_E, want_counts), f"{what}: counts"
        assert torch.equal(x_ND, want_x), f"{what}: rows"
        grad_ND = torch.randn(T * K, D, generator=gen).to(dtype).to(device)
        grads = []
        for op in (_entry("permute").lowered_op, torch.ops.moe.permute):
            leaf = x.clone().requires_grad_()
            with _triton_path("permute", args) if op is not torch.ops.moe.permute else contextlib.nullcontext():
                (grad,) = torch.autograd.grad(op(leaf, experts, E)[0], leaf, grad_ND)
            grads.append(grad)
        _close(grads[0], grads[1], f"{what}: grad_x", fp32_tol=1e-6)
        checks += 1
    return checks


# ----------------------------------------------------------------------------------------------
# combine: moe_lowered::unpermute_combine against combine_ref(unpermute_ref(...)) and the dialect ops.
# ----------------------------------------------------------------------------------------------


def check_combine(device: str, small: bool) -> int:
    gen = torch.Generator().manual_seed(2)
    #         T     D    K  E   y dtype         weights dtype
    cases = [(4096, 256, 2, 8,  torch.float32,  torch.float32),
             (3001, 200, 4, 16, torch.bfloat16, torch.float32),
             (1024, 512, 8, 64, torch.float16,  torch.float16),
             (777,  96,  1, 4,  torch.bfloat16, torch.bfloat16)]
    if small:
        cases = [(24, 32, 2, 8, torch.float32, torch.float32), (13, 20, 3, 6, torch.bfloat16, torch.float32)]
    checks = 0
    for T, D, K, E, y_dtype, w_dtype in cases:
        what = f"unpermute_combine T={T} D={D} K={K} {y_dtype}/{w_dtype}"
        experts = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
        order_N = dialect.permute_ref(torch.zeros(T, 1), experts, E)[2].to(device)  # what a real permute gives
        y_ND = torch.randn(T * K, D, generator=gen).to(y_dtype).to(device)
        weights = torch.rand(T, K, generator=gen).to(w_dtype).to(device)
        args = (y_ND, order_N, K, weights)
        with _triton_path("combine", args):
            out = _entry("combine").lowered_op(*args)
        assert out.dtype == y_dtype, what
        _close(out, dialect.combine_ref(dialect.unpermute_ref(y_ND, order_N, K), weights), what)
        grad_TD = torch.randn(T, D, generator=gen).to(y_dtype).to(device)
        grads = []
        for fused in (True, False):
            y, w = y_ND.clone().requires_grad_(), weights.clone().requires_grad_()
            if fused:
                with _triton_path("combine", args):
                    grads.append(torch.autograd.grad(_entry("combine").lowered_op(y, order_N, K, w), (y, w), grad_TD))
            else:
                out = torch.ops.moe.combine(torch.ops.moe.unpermute(y, order_N, K), w)
                grads.append(torch.autograd.grad(out, (y, w), grad_TD))
        _close(grads[0][0], grads[1][0], f"{what}: grad_y")
        _close(grads[0][1], grads[1][1], f"{what}: grad_weights", fp32_tol=1e-4)  # sums over D
        checks += 1
    return checks


# ----------------------------------------------------------------------------------------------
# grouped_gemm: moe_lowered::expert_ffn forward and backward against dialect.expert_ffn_ref.
# ----------------------------------------------------------------------------------------------


def _ffn_args(device, gen, activation, counts, D, F, dtype, bias, fused_gate_up=False):
    E, gated = len(counts), activation in GATED_ACTIVATIONS

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rand(sum(counts), D)
    if fused_gate_up:  # w_gate/w_up as views of one [E, 2F, D] tensor, w_down stored transposed
        gate_up = rand(E, 2 * F, D, scale=D ** -0.5)
        w_gate, w_up = gate_up[:, :F], gate_up[:, F:]
        w_down = rand(E, F, D, scale=F ** -0.5).transpose(1, 2)
    else:
        w_gate, w_up, w_down = rand(E, F, D, scale=D ** -0.5), rand(E, F, D, scale=D ** -0.5), rand(E, D, F, scale=F ** -0.5)
    return (x, torch.tensor(counts, dtype=torch.int64, device=device), w_gate, w_up if gated else None, w_down,
            rand(E, F) if bias else None, rand(E, F) if bias and gated else None, rand(E, D) if bias else None,
            activation, 1.5, 1.702)


def _ffn_run(fn, args, grad_y):
    """[y, grad x, grad w_gate, grad w_up, grad w_down, grad b_gate, grad b_up, grad b_down] (None: absent)."""
    y = fn(*args)
    inputs = [args[i] for i in dialect.FFN_DIFFERENTIABLE]
    present = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(y, present, grad_y.to(y.dtype), allow_unused=True))
    return [y.detach()] + [None if t is None else next(grads) for t in inputs]


def _leaves(args, dtype=None):
    return tuple(a.detach().to(dtype or a.dtype).requires_grad_(True)
                 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def check_grouped_gemm(device: str, small: bool) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32, in the kernel and in the reference
    gen = torch.Generator().manual_seed(3)
    ragged = (0, 1, 300, 64, 129, 7) if not small else (0, 1, 7, 3)
    D, F = (256, 200) if not small else (24, 40)  # F not a multiple of the column block
    cases = [(a, ragged, D, F, torch.float32, True, False) for a in ACTIVATIONS]
    if small:
        cases += [("swiglu", (5, 0, 20, 9), 32, 80, torch.bfloat16, False, False),
                  ("geglu", (3, 9, 4), 24, 40, torch.float32, True, True)]
    else:
        cases += [("swiglu", (700, 0, 37, 211, 1, 64), 512, 768, torch.bfloat16, False, False),
                  ("gelu", (128, 255, 3, 0), 384, 320, torch.float16, True, False),
                  ("clamped_swiglu", (90, 0, 410), 256, 192, torch.bfloat16, True, True),
                  ("geglu", (33, 129, 64), 128, 136, torch.float32, True, True),
                  ("swiglu", (0, 0, 0), 64, 64, torch.float32, True, False)]  # no rows: zero weight gradients
    names = ["y", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down", "grad_b_gate", "grad_b_up", "grad_b_down"]
    checks = 0
    for activation, counts, D_, F_, dtype, bias, fused in cases:
        what = f"expert_ffn {activation} counts={counts} D={D_} F={F_} {dtype} bias={bias} fused={fused}"
        args = _ffn_args(device, gen, activation, counts, D_, F_, dtype, bias, fused)
        grad_y = torch.randn(sum(counts), D_, generator=gen).to(device)
        with _triton_path("grouped_gemm", args):
            got = _ffn_run(_entry("grouped_gemm").lowered_op, _leaves(args), grad_y)
        want = _ffn_run(dialect.expert_ffn_ref, _leaves(args, torch.float32), grad_y)
        for name, g, w in zip(names, got, want):
            assert (g is None) == (w is None), f"{what}: {name}"
            if g is not None:
                assert g.dtype == dtype, f"{what}: {name} is {g.dtype}"
                _close(g, w, f"{what}: {name}", fp32_tol=1e-4)  # sums of up to 300 products of width <= 512
        checks += 1
    return checks


CHECKS: dict[str, Callable[[str, bool], int]] = {
    "gating": check_gating,
    "permute": check_permute,
    "grouped_gemm": check_grouped_gemm,
    "combine": check_combine,
}


def run(device: str, small: bool, faults: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every family's checks on `device`: {family: {"ok", "checks", "seconds", "error"}}; never raises for
    a family's failure (its traceback is its "error")."""
    unknown = sorted(set(faults) - set(CHECKS))
    if unknown:
        raise ValueError(f"lowering.numerics: --fault {unknown} names no kernel family: choose from {list(CHECKS)}")
    KERNEL_FAULTS.clear()
    KERNEL_FAULTS.update(faults)
    torch.manual_seed(0)
    report = {}
    # small shapes check that every specialisation builds and is right, not which block sizes are fastest:
    # the grouped GEMM launches with `pick_config`'s config (FfnSpec.fixed_configs) instead of autotuning
    # each small case (137 s of a 190 s selfcheck on an H100 before)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    if small:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's own deterministic mode
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _run_families(device, small, report)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
    return report


def _run_families(device: str, small: bool, report: dict[str, dict]) -> None:
    for family in FAMILIES:
        check = CHECKS[family]
        start = time.perf_counter()
        try:
            checks, error = check(device, small), None
        except Exception:  # reported per family; the caller shows it as that family's failure
            checks, error = 0, traceback.format_exc()[-6000:]
        report[family] = {"ok": error is None, "checks": checks, "seconds": time.perf_counter() - start,
                          "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowering.numerics", description=__doc__.split("\n\n")[0])
    parser.add_argument("device", nargs="?", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true",
                        help="the small shapes on CUDA too (fewer specialisations to compile; CPU always uses them)")
    parser.add_argument("--fault", action="append", default=[], metavar="FAMILY",
                        help="offset this family's kernel output on purpose (tests of the callers)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("lowering.numerics cuda: torch.cuda.is_available() is False: run it on a machine "
                             "with a CUDA GPU, or run `TRITON_INTERPRET=1 python -m lowering.numerics cpu`")
        if codegen.is_interpreted():
            raise SystemExit("lowering.numerics cuda: TRITON_INTERPRET is set: unset it (or set it to 0) for the "
                             "compiled kernels")
    elif not codegen.is_interpreted():
        raise SystemExit("lowering.numerics cpu: the kernels run interpreted on CPU: set TRITON_INTERPRET=1")
    families = run(args.device, small=args.small or args.device == "cpu", faults=tuple(args.fault))
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                      "interpret": os.environ.get("TRITON_INTERPRET"), "families": families}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
