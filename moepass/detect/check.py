"""The semantic check: a spec is accepted only if its canonical graph reproduces the block.

On a probe copy of the block (fp32, eval mode, zero-initialised buffers and biases randomised so
that a forgotten bias shows), random inputs go through the original block and through the spec's
canonical graph. First the selected experts must agree exactly (tokens whose k-th and (k+1)-th
scores are a near-tie are re-probed, not compared), then the outputs must agree within tolerance.
The original's selection is observed by intercepting its last `topk` over E scores.

The user's block is never touched: everything runs on the copy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from moepass import canonical
from moepass.spec import MoESpec

TIE_EPS = 1e-5  # score margins below this are near-ties: re-probed, not compared


@dataclass
class CheckResult:
    spec: MoESpec
    accepted: bool
    max_error: float = float("nan")
    mismatched_tokens: int = 0
    compared_tokens: int = 0
    reason: str = ""
    selection_observed: bool = True

    def describe(self) -> str:
        verdict = "accepted" if self.accepted else f"rejected: {self.reason}"
        return f"{verdict} (max error {self.max_error:.2e}, {self.compared_tokens} tokens compared)"


@dataclass
class _Selection:
    """The original block's top-k call: its input scores and chosen indices."""

    scores: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    calls: list[tuple[int, int]] = field(default_factory=list)


class _TopkSpy(TorchFunctionMode):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k, self.seen = num_experts, top_k, _Selection()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            k = args[1] if len(args) > 1 else (kwargs or {}).get("k")
            if isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.shape[-1] == self.num_experts \
                    and k == self.top_k:
                self.seen.scores, self.seen.indices = scores.detach(), out[1].detach()
        return out


class _Capture(fx.Interpreter):
    """Runs a graph and keeps the values of the named nodes."""

    def __init__(self, gm: fx.GraphModule, names: tuple[str, ...]):
        super().__init__(gm)
        self.names, self.values = names, {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n.name in self.names:
            self.values[n.name] = value
        return value


def probe_copy(block: nn.Module, seed: int = 0) -> nn.Module:
    """An fp32, eval-mode copy whose all-zero floating parameters and buffers are randomised."""
    probe = copy.deepcopy(block).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(probe.parameters()) + list(probe.buffers()):
            if tensor.is_floating_point() and tensor.numel() and not tensor.any():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
    return probe


def _outputs(value):
    return value if isinstance(value, tuple) else (value,)


def check(spec: MoESpec, probe: nn.Module, inputs: list[torch.Tensor], originals: list, selections: list[_Selection],
          atol: float = 1e-5, rtol: float = 1e-4) -> CheckResult:
    """Compare `spec`'s canonical graph with the recorded behaviour of the original on `inputs`."""
    try:
        gm = canonical.build(spec, probe)
    except Exception as err:  # a hypothesis that does not even build is just a wrong hypothesis
        return CheckResult(spec, False, reason=f"canonical graph does not build: {err}")
    result = CheckResult(spec, True, max_error=0.0)
    for x, original, seen in zip(inputs, originals, selections):
        cap = _Capture(gm, ("experts_TK", "logits_TE"))
        try:
            with torch.no_grad():
                ours = cap.run(x)
        except Exception as err:
            return CheckResult(spec, False, reason=f"canonical graph fails on a probe input: {err}")
        if seen.indices is not None and "experts_TK" in cap.values:
            mine = cap.values["experts_TK"].sort(dim=-1).values
            theirs = seen.indices.sort(dim=-1).values
            if mine.shape != theirs.shape:
                return CheckResult(spec, False, reason=f"selects {mine.shape[-1]} experts per token, block selects "
                                                       f"{theirs.shape[-1]}")
            sorted_scores = seen.scores.float().sort(dim=-1, descending=True).values
            k = theirs.shape[-1]
            margin = sorted_scores[:, k - 1] - (sorted_scores[:, k] if k < sorted_scores.shape[-1] else -torch.inf)
            clear = margin.abs() > TIE_EPS * (1 + sorted_scores[:, k - 1].abs())
            mismatched = ((mine != theirs).any(dim=-1) & clear).sum().item()
            result.compared_tokens += int(clear.sum().item())
            if mismatched:
                result.accepted = False
                result.mismatched_tokens += int(mismatched)
        else:
            result.selection_observed = False
        for a, b in zip(_outputs(ours), _outputs(original)):
            if a.shape != b.shape:
                return CheckResult(spec, False, reason=f"output shape {tuple(a.shape)} != block's {tuple(b.shape)}")
            err = (a - b).abs().max().item() if a.numel() else 0.0
            result.max_error = max(result.max_error, err)
            if not torch.allclose(a, b, atol=atol, rtol=rtol):
                result.accepted = False
    if not result.accepted:
        parts = []
        if result.mismatched_tokens:
            parts.append(f"{result.mismatched_tokens}/{result.compared_tokens} tokens select different experts")
        parts.append(f"outputs differ by up to {result.max_error:.2e}")
        result.reason = "; ".join(parts)
    return result


def semantic_check(block: nn.Module, hypotheses: list[MoESpec], probes: int = 3, tokens: int = 24,
                   seed: int = 0) -> tuple[CheckResult | None, list[CheckResult]]:
    """The first hypothesis that reproduces `block`, and every result tried (for the report)."""
    if not hypotheses:
        return None, []
    probe = probe_copy(block, seed)
    D = hypotheses[0].experts.hidden_dim
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(2, tokens // 2, D, generator=gen) for _ in range(probes)]
    originals, selections = [], []
    for x in inputs:
        spy = _TopkSpy(hypotheses[0].num_experts, hypotheses[0].top_k)
        with torch.no_grad(), spy:
            originals.append(_outputs(probe(x)))
        selections.append(spy.seen)
    tried = []
    for spec in hypotheses:
        if spec.top_k != hypotheses[0].top_k:  # the spy watched for another k: observe again
            selections = []
            for x in inputs:
                spy = _TopkSpy(spec.num_experts, spec.top_k)
                with torch.no_grad(), spy:
                    probe(x)
                selections.append(spy.seen)
        result = check(spec, probe, inputs, originals, selections)
        tried.append(result)
        if result.accepted:
            return result, tried
    return None, tried
