"""The built-in demo: a small Mixtral-like LM → detect → compile → parity and a few training steps.

Run with `python -m moepass demo`. Exits non-zero if the compiled model does not match the original.
"""

from __future__ import annotations

import copy
import time

import torch

import moepass
from samples.models import SampleConfig, TinyMoELM

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


def _max_grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, str]:
    worst, name = 0.0, ""
    grads_b = dict(b.named_parameters())
    for n, p in a.named_parameters():
        d = (p.grad - grads_b[n].grad).abs().max().item()
        if d > worst:
            worst, name = d, n
    return worst, name


def run(style: str = "mixed", steps: int = 3, show_graph: bool = True) -> int:
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: the parity check needs 1 or more training steps")
    torch.manual_seed(0)
    cfg = SampleConfig(style=style, layers=4, dense_layers=1)
    model = TinyMoELM(cfg)
    print(f"moepass {moepass.__version__} demo: TinyMoELM(layers={cfg.layers}, dim={cfg.dim}, experts="
          f"{cfg.num_experts}, top_k={cfg.top_k}, style={style!r}, dense_layers={cfg.dense_layers})\n")

    start = time.perf_counter()
    report = moepass.detect(model)
    print(f"detect ({(time.perf_counter() - start) * 1e3:.0f} ms):\n{report.summary()}\n")

    start = time.perf_counter()
    # the demo checks the rewritten graphs themselves; by default form="single" runs your block instead wherever
    # that was timed faster at the first call (docs/USER_GUIDE.md, section 3)
    compiled = moepass.compile(model, moepass.Plan(form="single", keep_original_if_slower=False))
    print(f"compile (form='single', {(time.perf_counter() - start) * 1e3:.0f} ms): "
          f"{len(compiled.moepass_info.rewritten)} block(s) rewritten as MoE-dialect graphs\n")

    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    ok = True
    reference, candidate = copy.deepcopy(model), compiled
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt_cm = torch.optim.AdamW(candidate.parameters(), lr=1e-3)
    print(f"{'step':>4} {'loss (original)':>16} {'loss (moepass)':>16} {'|Δloss|':>9} {'max |Δgrad|':>12}")
    for step in range(steps):
        losses = []
        for m, opt in ((reference, opt_ref), (candidate, opt_cm)):
            opt.zero_grad()
            loss = m.loss(tokens)
            loss.backward()
            losses.append(loss)
        diff, where = _max_grad_diff(reference, candidate)
        dl = (losses[0] - losses[1]).abs().item()
        print(f"{step:>4} {losses[0].item():>16.6f} {losses[1].item():>16.6f} {dl:>9.1e} {diff:>12.1e}")
        ok &= torch.allclose(losses[0], losses[1], rtol=FP32_RTOL, atol=FP32_ATOL) and diff < 1e-4
        opt_ref.step()
        opt_cm.step()
    same_names = list(model.state_dict()) == list(compiled.state_dict())
    print(f"\nstate_dict keys unchanged: {same_names}; original model untouched: "
          f"{all(type(m).__name__ != 'MoEGraphModule' for m in model.modules())}")
    ok &= same_names
    if show_graph and compiled.moepass_info.rewritten:
        path, gm = next(iter(compiled.moepass_info.rewritten.items()))
        print(f"\nrewritten graph of {path}:")
        print(gm.print_readable(print_output=False))
    print("\nPARITY OK" if ok else "\nPARITY FAILED")
    return 0 if ok else 1
