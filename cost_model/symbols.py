"""The one table of symbols the cost model is written in.

Every formula in `cost_model` takes its quantities as arguments, so the same function serves two
purposes: called with these symbols it returns a `sympy` expression (for derivatives, tests and the
readable formula `search` prints); called with numbers it returns a number.

Assumptions follow torch/utils/_sympy: counts are positive integers, rates and times positive reals,
so sympy can decide signs (e.g. `diff(time, B_inter).is_negative`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class SymbolInfo:
    symbol: sympy.Symbol
    meaning: str
    unit: str
    default: float | None = None  # OPTIONAL symbols: the value a formula takes when a figure dict lacks it


TABLE: dict[str, SymbolInfo] = {}
# Symbols a formula reads with a default (`x.get(name, default)`): a figure dict without them prices a layer
# that has no such feature, so they are kept out of TABLE, whose every symbol a general layer carries.
OPTIONAL: dict[str, SymbolInfo] = {}


def _sym(name: str, meaning: str, unit: str, **assumptions: bool) -> sympy.Symbol:
    s = sympy.Symbol(name, **assumptions)
    TABLE[name] = SymbolInfo(s, meaning, unit)
    return s


def _optional(name: str, meaning: str, unit: str, default: float | None, **assumptions: bool) -> sympy.Symbol:
    s = sympy.Symbol(name, **assumptions)
    OPTIONAL[name] = SymbolInfo(s, meaning, unit, default)
    return s


_count = dict(integer=True, positive=True)
_real = dict(real=True, positive=True)

# model shape
T = _sym("T", "tokens per rank per step (batch x seq of one data-parallel rank)", "tokens", **_count)
D = _sym("D", "model width (elements per routed row)", "elements", **_count)
F = _sym("F", "expert hidden width", "elements", **_count)
E = _sym("E", "experts per MoE layer", "experts", **_count)
K = _sym("K", "experts per token (top-k)", "experts", **_count)
m = _sym("m", "matmuls per expert FFN: 3 gated (SwiGLU/GeGLU), 2 otherwise", "matmuls", **_count)
L = _sym("L", "MoE layers", "layers", **_count)
H = _sym("H", "heads of a Multi-Head LatentMoE layer", "heads", **_count)
h = _sym("h", "head width of a Multi-Head LatentMoE layer", "elements", **_count)
# parallel layout
W = _sym("W", "ranks (world size)", "ranks", **_count)
ep = _sym("ep", "expert-parallel degree (ep_size); data parallel over W/ep", "ranks", **_count)
N = _sym("N", "nodes", "nodes", **_count)
G = _sym("G", "ranks per node", "ranks", **_count)
P = _sym("P", "expert packing: experts per device relative to plain EP", "factor", **_count)
C = _sym("C", "expert slots per device (FSEP): full experts each device restores and computes", "experts", **_count)
S_e = _sym("S_e", "elements of one expert's parameters (m*D*F for an FFN expert)", "elements", **_count)
n = _sym("n", "micro-ops (chunks) per all-to-all", "chunks", **_count)
P_d = _sym("P_d", "dense parameters per MoE layer (attention, norms, its share of the embeddings), "
           "all-reduced over all W ranks", "elements", **_count)
q = _sym("q", "sequence length (the attention scores of the dense part)", "tokens", **_count)
# routing
cf = _sym("c_f", "capacity factor (slots per expert / fair share)", "factor", **_real)
rho = _sym("rho", "load imbalance: max / mean routed rows per rank", "factor", **_real)
Q_intra = _sym("Q_intra", "routed rows sent to another device of the same node, summed over sources", "rows", **_count)
Q_inter = _sym("Q_inter", "routed rows sent to another node, summed over sources", "rows", **_count)
Q_max = _sym("Q_max", "routed rows the busiest device computes", "rows", **_count)
phi = _optional("phi", "fraction of the routed assignments that reach FFN experts (the rest pick zero-compute "
               "experts, identity or zero, which are neither sent nor computed): E/R under uniform routing over "
               "R = E + zero-compute experts", "fraction", 1, **_real)
# hardware
b = _sym("b", "bytes per activation element sent in an all-to-all", "bytes", **_count)
b_grad = _sym("b_g", "bytes per gradient element in the all-reduce", "bytes", **_count)
s_state = _sym("s", "bytes per parameter for weights + grads + optimizer state", "bytes", **_count)
B_intra = _sym("B_intra", "effective intra-node bandwidth per rank", "bytes/s", **_real)
B_inter = _sym("B_inter", "effective inter-node bandwidth per rank", "bytes/s", **_real)
u = _sym("u", "bytes of one gradient all-reduce unit: Plan.micro_op_bytes (priority) or a DDP bucket (fair)",
         "bytes", **_count)
alpha = _sym("alpha", "latency per collective call (per chunk)", "s", **_real)
alpha_r = _optional("alpha_r", "latency per gradient all-reduce call, where calibrated apart (gloo on a CPU: "
                    "`cost_model.calibrate_allreduce`); absent: alpha", "s", None, **_real)
B_r = _optional("B_r", "the gradient all-reduce's own rate, bytes a rank sends per s, which caps the link's "
                "bandwidth for it where calibrated apart", "bytes/s", math.inf, **_real)
R = _sym("R", "device peak FLOP/s", "FLOP/s", **_real)
eta = _sym("eta", "fraction of peak reached by expert GEMMs", "fraction", **_real)


def table() -> str:
    """The symbol table as aligned text (for docs and `python -m cost_model symbols`)."""
    width = max(len(k) for k in (*TABLE, *OPTIONAL))
    lines = []
    for name, info in (*TABLE.items(), *OPTIONAL.items()):
        kinds = "integer" if info.symbol.is_integer else "real"
        default = "" if name in TABLE else " (optional)" if info.default is None else \
            f" (optional, default {info.default:g})"
        lines.append(f"{name:<{width}}  {kinds:<7} > 0  [{info.unit}]  {info.meaning}{default}")
    return "\n".join(lines)


def smax(*args):
    """`max` that stays symbolic: `sympy.Max` when any argument is a sympy expression."""
    return sympy.Max(*args) if any(isinstance(a, sympy.Basic) for a in args) else max(args)


def smin(*args):
    """`min` that stays symbolic: `sympy.Min` when any argument is a sympy expression."""
    return sympy.Min(*args) if any(isinstance(a, sympy.Basic) for a in args) else min(args)


def spositive(x):
    """1 where x > 0, else 0, that stays symbolic: `sympy.Heaviside(x, 0)` for a sympy expression."""
    return sympy.Heaviside(x, 0) if isinstance(x, sympy.Basic) else (1 if x > 0 else 0)


def sceil(x):
    """`ceil` that stays symbolic: `sympy.ceiling` for a sympy expression."""
    return sympy.ceiling(x) if isinstance(x, sympy.Basic) else math.ceil(x)
