"""The plain-torch row functions the canonical graph calls between its dialect ops: zero-compute experts'
slots and rows, and the per-row routing weights of weights applied on the experts' input."""

from __future__ import annotations

import torch

from moepass.operands import graph_leaf


def expert_slots(experts_TK: torch.Tensor, ffn_ids: tuple[int, ...], identity_ids: tuple[int, ...],
                 num_routed: int) -> torch.Tensor:
    """Each assignment's permute slot when some experts are zero-compute: the i-th FFN expert's router id
    is slot i, identity experts slot E, zero experts slot E + 1 (so their rows sort after every FFN row)."""
    E = len(ffn_ids)
    table = [E + 1] * num_routed
    for slot, r in enumerate(ffn_ids):
        table[r] = slot
    for r in identity_ids:
        table[r] = E
    return torch.tensor(table, dtype=experts_TK.dtype, device=experts_TK.device)[experts_TK]


@graph_leaf  # reads a count on the host: not on a traced value (an unpickled graph is traced again)
def ffn_rows(x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The leading rows of the slot-sorted rows that FFN experts compute (a view). Reads their count on the
    host (the single form's one sync for zero-compute experts; EP sends `x_ND` whole and skips this).
    Under fake tensors the count is unknown: all rows stand in (shape propagation only)."""
    if isinstance(counts_E, torch._subclasses.FakeTensor):
        return x_ND
    return x_ND[:int(counts_E.sum())]


def zero_compute_rows(y_MD: torch.Tensor, x_ND: torch.Tensor, counts_J: torch.Tensor) -> torch.Tensor:
    """Every slot-sorted row's expert output: the FFN experts' `y_MD` (its first rows; rows past them are
    zero padding), the row's input for identity experts (slot E), zero for zero experts (slot E + 1).
    Device-side only: the rows' slots follow from the counts."""
    N = x_ND.shape[0]
    y_MD = padded_rows(y_MD, x_ND)
    E = counts_J.shape[0] - 2
    row_N = torch.arange(N, device=x_ND.device)
    ffn_count = counts_J[:E].sum()
    identity_N = (row_N >= ffn_count) & (row_N < ffn_count + counts_J[E])
    return torch.where(identity_N.unsqueeze(1), x_ND, y_MD)


@graph_leaf
def padded_rows(y_MD: torch.Tensor, x_ND: torch.Tensor) -> torch.Tensor:
    """`y_MD` followed by zero rows up to `x_ND`'s rows: `zero_compute_rows` where no row is an identity row
    (the capacity-dropped rows of `rewrite.dropped`); `y_MD` itself where nothing was dropped. Its backward is a
    slice."""
    missing = x_ND.shape[0] - y_MD.shape[0]
    return y_MD if missing == 0 else torch.nn.functional.pad(y_MD, (0, 0, 0, missing))


def row_weights(weights_TK: torch.Tensor, order_N: torch.Tensor) -> torch.Tensor:
    """Each permuted row's routing weight: `order_N[n]` is the row's flat (token, choice) index."""
    return weights_TK.reshape(-1)[order_N]


def weighted_rows(x_ND: torch.Tensor, w_N: torch.Tensor) -> torch.Tensor:
    """The rows times their weights, in the rows' dtype (`MoESpec.weights_on="input"`)."""
    return x_ND * w_N.to(x_ND.dtype).unsqueeze(-1)
