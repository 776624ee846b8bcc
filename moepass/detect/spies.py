"""What the semantic check watches while a block runs: its selection (`TopkSpy`, the last top-k / argmax / descending
sort over E scores, with the tokens free of near-ties) and the values of a graph's named nodes (`Capture`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from moepass.detect.capture import SORT

TIE_EPS = 1e-5  # score margins below this are near-ties: re-probed, not compared
SORTED = 0  # `TopkSpy.calls` k of a descending sort: every index, in order


@dataclass
class Selection:
    """The original block's selection: its final top-k scores/indices and which tokens are tie-free."""

    scores: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    clear: torch.Tensor | None = None  # [T] bool: no near-tie in the final or a group top-k
    calls: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)
    other_k: int | None = None  # no top-k over E with the spec's k, but one with this k


def margin_clear(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: the k-th and (k+1)-th largest scores are not a near-tie."""
    s = scores.float().sort(dim=-1, descending=True).values
    if k >= s.shape[-1]:
        return torch.ones(s.shape[0], dtype=torch.bool)
    kth, nxt = s[:, k - 1], s[:, k]
    margin = torch.where(torch.isinf(nxt) & (nxt < 0), torch.full_like(kth, torch.inf), kth - nxt)
    return margin.abs() > TIE_EPS * (1 + kth.abs().nan_to_num(posinf=0.0, neginf=0.0))


class TopkSpy(TorchFunctionMode):
    """Records every last-dim top-k / argmax call; `seen` picks the selection over E scores."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.calls: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        scores = args[0] if args else None
        if not isinstance(scores, torch.Tensor) or scores.dim() < 2:
            return out
        last = (-1, scores.dim() - 1)
        if func in (torch.topk, torch.Tensor.topk) and kwargs.get("largest", True):
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if isinstance(k, int) and dim in last:
                X = scores.shape[-1]
                self.calls.append((scores.detach().reshape(-1, X), k, out[1].detach().reshape(-1, k)))
        elif func in (torch.argmax, torch.Tensor.argmax, torch.max, torch.Tensor.max):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and dim in last:  # max(x, dim) returns (values, indices); max(x, y) is no selection
                indices = out if func in (torch.argmax, torch.Tensor.argmax) else out[1]
                X = scores.shape[-1]
                self.calls.append((scores.detach().reshape(-1, X), 1, indices.detach().reshape(-1, 1)))
        elif func in SORT:  # a descending sort: its leading k indices are a top-k (`seen` takes K of them)
            full = list(args) + [None] * 3
            dim = kwargs.get("dim", full[1] if full[1] is not None else -1)
            if kwargs.get("descending", full[2] or False) and dim in last:
                indices = out if func in SORT[2:] else out[1]
                X = scores.shape[-1]
                self.calls.append((scores.detach().reshape(-1, X), SORTED, indices.detach().reshape(-1, X)))
        return out

    @property
    def seen(self) -> Selection:
        E, K = self.num_experts, self.top_k
        final = [(s, K, i[:, :K]) if k == SORTED else (s, k, i) for s, k, i in self.calls
                 if s.shape[-1] == E and k in (K, SORTED)]
        if not final:
            other = [c[1] for c in self.calls if c[0].shape[-1] == E and c[1] != SORTED]
            return Selection(calls=self.calls, other_k=other[-1] if other else None)
        scores, _, indices = final[-1]
        clear = margin_clear(scores, K)
        for g_scores, g_k, _ in self.calls:  # group top-k (group-limited: best topk_group of G groups)
            G = g_scores.shape[-1]
            if G < E and E % G == 0 and g_scores.shape[0] == scores.shape[0] and 0 < g_k < G:
                clear &= margin_clear(g_scores, g_k)
        return Selection(scores, indices, clear, self.calls)


class Capture(fx.Interpreter):
    """Runs a graph and keeps the values of the named nodes."""

    def __init__(self, gm: fx.GraphModule, names: tuple[str, ...]):
        super().__init__(gm)
        self.names = names
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n.name in self.names:
            self.values[n.name] = value
        return value
