"""Operands of a graph node that calls a torch.library op, read and written by name through the op's schema.

An op's schema is the one place its signature is written (the `custom_op` function's parameters, or the
`Library.define` string; for a plain function a graph calls, its signature), and FX keeps a call's operands by position. `operand(node, "experts_TK")` reads
the operand that parameter names, whether the call passed it by position, by keyword, or left the
default; passes use it instead of `node.args[i]`, so an op's signature can change in one place.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _parameters(op: Any) -> list[tuple[str, bool, Any]]:
    """(name, has a default, the default) of each named parameter of a torch.library op overload
    (`torch.ops.moe.route.default`: its schema) or of a Python function a graph calls (its signature)."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return [(a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                for a in schema.arguments]
    if not callable(op):
        raise TypeError(f"{op!r} is neither a torch.library op nor a function: it has no named operands")
    return [(p.name, p.default is not p.empty, None if p.default is p.empty else p.default)
            for p in inspect.signature(op).parameters.values() if p.kind in POSITIONAL]


def argument_names(op: Any) -> tuple[str, ...]:
    """The parameter names of a torch.library op overload, or of a Python function, in order."""
    return tuple(name for name, _, _ in _parameters(op))


def _index(node: fx.Node, name: str) -> int:
    names = argument_names(node.target)
    if name not in names:
        raise KeyError(f"{node.format_node()}: {node.target} has no operand {name!r}; its operands are {list(names)}")
    return names.index(name)


def operand(node: fx.Node, name: str) -> Any:
    """The operand of the call `node` that the op's parameter `name` receives (its default when not passed)."""
    index = _index(node, name)
    if index < len(node.args):
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    _, has_default, default = _parameters(node.target)[index]
    if has_default:
        return default
    raise KeyError(f"{node.format_node()}: operand {name!r} of {node.target} was not passed and has no default")


def set_operand(node: fx.Node, name: str, value: Any) -> None:
    """Make the call `node` pass `value` as the op's parameter `name` (where it passed it: by position or keyword)."""
    index = _index(node, name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)
