"""The verifier: invariants every moepass graph keeps, checked after every pass in tests.

Rules (each violation names the rule, the node and what is wrong):

  V1 provenance   every node records the pass that made it: node.meta["moepass"]["pass"].
  V2 shapes       FakeTensor propagation succeeds from the block's input; every dialect op's fake
                  implementation validates its operands, so a wrong shape fails "while executing <node>".
                  A user's module the graph runs as it is (a router module) whose own forward reads data
                  (`.tolist()`, `.item()`: no fake value) ends the propagation there without a violation:
                  what is past it is not checked by this rule.
  V3 pairing      every `moe.permute` (or `moe_lowered.permute`) has its order consumed by exactly
                  one inverse (`moe.unpermute`, or a lowered op fusing it) with the same top_k, and
                  every inverse's order comes from a permute (or a communication op).
  V4 split sums   split sizes that are Python ints add up to the rows they split (torch.split,
                  all_to_all_single input/output splits).
  V5 placement    dialect ops appear only in graphs marked as MoE dialect graphs; communication ops
                  only in distributed forms; lowered ops only after the lower pass.
  V6 outputs      the graph returns the hidden states plus exactly the spec's side outputs.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from moepass import dialect
from moepass.operands import argument_names, operand


class VerificationError(AssertionError):
    """A moepass graph broke an invariant: a bug in a pass, not bad user input."""


@dataclass(frozen=True)
class Violation:
    rule: str
    node: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] at node {self.node!r}: {self.message}"


COMM_NAMESPACES = ("_c10d_functional", "c10d", "moe_comm")
LOWERED_NAMESPACE = "moe_lowered"
SPLIT_OPERANDS = {"input", "input_split_sizes", "output_split_sizes"}  # an all-to-all with host split sizes
SPLIT_TARGETS = {torch.split, torch.Tensor.split, torch.ops.aten.split_with_sizes.default}


def _namespace(target) -> str | None:
    return target.namespace if isinstance(target, torch._ops.OpOverload) else None


def _getitem_user(node: fx.Node, index: int) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]


def _unpermute_top_k(node: fx.Node) -> int | None:
    """The top_k an inverse restores: the `top_k` operand of moe.unpermute and of the lowered ops fusing it."""
    top_k = operand(node, "top_k") if "top_k" in argument_names(node.target) else None
    return top_k if isinstance(top_k, int) else None


def check_provenance(gm: fx.GraphModule) -> list[Violation]:
    return [Violation("V1 provenance", n.name, "no node.meta['moepass']['pass']: the pass that made it is unknown")
            for n in gm.graph.nodes if not isinstance(n.meta.get("moepass"), dict) or "pass" not in n.meta["moepass"]]


def check_shapes(gm: fx.GraphModule, example_inputs: list[torch.Tensor] | None) -> list[Violation]:
    spec = getattr(gm, "spec", None)
    if example_inputs is None:
        if spec is None:
            return []
        device = next((p.device for p in gm.parameters()), None)  # a meta model's graph: meta hidden states
        example_inputs = [torch.empty(2, 3, spec.model_dim, device=device)]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) for x in example_inputs]
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # the violation below reports the failure once, readably
    try:
        FakeTensorProp(gm, mode).propagate(*fake_inputs)
    except Exception as err:
        node = getattr(err, "node", None)
        msg = str(err).split("\n\nWhile executing")[0].strip()
        where = _failing_node(err) or (node.name if node is not None else "<graph>")
        failing = next((n for n in gm.graph.nodes if n.name == where), None)
        if failing is not None and failing.op == "call_module" and _data_dependent(err):
            return []  # the user's module reads data as it runs: not fake-propagatable (module doc)
        return [Violation("V2 shapes", where, msg)]
    finally:
        fake_log.setLevel(level)
    return []


def _data_dependent(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) is fake propagation meeting a value read as data."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, DataDependentOutputException) or "_local_scalar_dense" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _failing_node(err: BaseException) -> str | None:
    text = str(err)
    marker = "While executing %"
    if marker in text:
        return text.split(marker, 1)[1].split(" ", 1)[0].strip(":")
    return None


def check_pairing(gm: fx.GraphModule) -> list[Violation]:
    out = []
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if _is_permute(n):
            orders = _getitem_user(n, 2)
            inverses = [u for o in orders for u in o.users if _is_inverse(u)]
            if len(inverses) != 1:
                out.append(Violation("V3 pairing", n.name, f"permute's order_N feeds {len(inverses)} inverse ops "
                                     f"(moe.unpermute or a fused lowering); exactly 1 is required"))
                continue
            k = _unpermute_top_k(inverses[0])
            experts_TK = operand(n, "experts_TK")
            experts_val = experts_TK.meta.get("val") if isinstance(experts_TK, fx.Node) else None
            if k is not None and experts_val is not None and experts_val.shape[-1] != k:
                out.append(Violation("V3 pairing", inverses[0].name,
                                     f"unpermute top_k={k} but its permute routed {experts_val.shape[-1]} choices"))
        if n.op == "call_function" and _is_inverse(n):
            order = operand(n, "order_N")
            src = order.args[0] if isinstance(order, fx.Node) and order.target is operator.getitem else None
            if not (_is_permute(src) or _is_comm(src)):
                out.append(Violation("V3 pairing", n.name, f"its order argument {getattr(order, 'name', order)!r} "
                                     "does not come from a moe.permute"))
    return out


def _is_permute(node) -> bool:
    """`moe.permute` or its lowering `moe_lowered.permute` (same outputs: x_ND, counts_E, order_N)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is dialect.PERMUTE:
        return True
    return _namespace(node.target) == LOWERED_NAMESPACE and node.target._opname == "permute"


def _is_inverse(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is dialect.UNPERMUTE:
        return True
    return _namespace(node.target) == LOWERED_NAMESPACE and "unpermute" in str(node.target)


def _is_comm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and _namespace(node.target) in COMM_NAMESPACES


def _rows(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None


def check_splits(gm: fx.GraphModule) -> list[Violation]:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        pairs = []
        if n.target in SPLIT_TARGETS and len(n.args) > 1 and isinstance(n.args[1], (list, tuple)):
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
            if val is not None:
                pairs.append(("split sizes", n.args[1], int(val.shape[dim])))
        if _namespace(n.target) in COMM_NAMESPACES and SPLIT_OPERANDS <= set(argument_names(n.target)):
            out_splits, in_splits = operand(n, "output_split_sizes"), operand(n, "input_split_sizes")
            in_rows, out_rows = _rows(operand(n, "input")), _rows(n)
            if isinstance(in_splits, (list, tuple)) and in_rows is not None:
                pairs.append(("input splits", in_splits, in_rows))
            if isinstance(out_splits, (list, tuple)) and out_rows is not None:
                pairs.append(("output splits", out_splits, out_rows))
        for what, sizes, rows in pairs:
            if all(isinstance(s, int) for s in sizes) and sum(sizes) != rows:
                out.append(Violation("V4 split sums", n.name, f"{what} {list(sizes)} sum to {sum(sizes)}, "
                                     f"but the tensor has {rows} rows"))
    return out


def check_placement(gm: fx.GraphModule) -> list[Violation]:
    out = []
    is_dialect_graph = bool(gm.meta.get("moepass_dialect"))
    form = getattr(gm, "form", "single")
    lowered = any(h.get("pass") == "lower" for h in getattr(gm, "history", []))
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ns = _namespace(n.target)
        if ns == dialect.NAMESPACE and not is_dialect_graph:
            out.append(Violation("V5 placement", n.name, f"dialect op {n.target} in a graph not marked as an MoE "
                                 "dialect graph (gm.meta['moepass_dialect'])"))
        if ns in COMM_NAMESPACES and form == "single":
            out.append(Violation("V5 placement", n.name, f"communication op {n.target} in a single-device graph"))
        if ns == LOWERED_NAMESPACE and not lowered:
            out.append(Violation("V5 placement", n.name, f"lowered op {n.target} before the lower pass ran"))
    return out


def check_outputs(gm: fx.GraphModule) -> list[Violation]:
    spec = getattr(gm, "spec", None)
    if spec is None:
        return []
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    value = out_node.args[0]
    count = len(value) if isinstance(value, (tuple, list)) else 1
    expected = 1 + len(spec.side_outputs)
    if count != expected:
        return [Violation("V6 outputs", out_node.name, f"returns {count} values; the spec needs {expected} "
                          f"(hidden states + side outputs {list(spec.side_outputs)})")]
    return []


def violations(gm: fx.GraphModule, example_inputs: list[torch.Tensor] | None = None) -> list[Violation]:
    """Every broken rule (shape propagation first: the other rules read its meta['val'])."""
    found = check_shapes(gm, example_inputs)
    for rule in (check_provenance, check_pairing, check_splits, check_placement, check_outputs):
        found.extend(rule(gm))
    return found


def verify(gm: fx.GraphModule, after: str = "", example_inputs: list[torch.Tensor] | None = None) -> None:
    """Raise VerificationError listing every violation."""
    found = violations(gm, example_inputs)
    if found:
        where = f" after pass {after!r}" if after else ""
        block = getattr(getattr(gm, "spec", None), "path", "")
        raise VerificationError(f"moepass graph of block {block or '<root>'!r} is invalid{where}:\n  "
                                + "\n  ".join(str(v) for v in found))
