"""Each op's one declaration (`OpSchema`), and the operands of a graph node that calls it, read and written by
name through the op's schema.

One declaration per op: its operands, outputs, fake, autograd and autocast policy, from which every
torch.library op with that signature is made.

    ROUTE = OpSchema("route", "Tensor logits_TE, Tensor? selection_bias_E, ...", "(Tensor, Tensor)",
                     fake=..., autograd=(backward, setup_context), autocast="fp32")
    route = ROUTE.define("moe", route_impl)             # the dialect op:  moe::route
    ROUTE.define("moe_lowered", route_kernel)           # its lowering:    moe_lowered::route, same arguments

The operands are written once, in torch's schema syntax (`Tensor? name` for an optional tensor, `SymInt`
for a size, `Tensor(a0!) name` for one the op writes in place); an operand's shape letters are the suffix of
its name (`logits_TE`: T, E; legend in `moepass.spec.SHAPES`). The implementation an op is made from takes
the operands positionally (`def impl(*args)` is fine): `define` hands torch the declared schema rather than
inferring one from the function, so the signature is nowhere else. Passes read a call's operands by these
names (`operand` below).

An op's schema is the one place its signature is written (an `OpSchema`, the `custom_op` function's
parameters, or the `Library.define` string; for a plain function a graph calls, its signature), and FX keeps a
call's operands by position. `operand(node, "experts_TK")` reads
the operand that parameter names, whether the call passed it by position, by keyword, or left the
default; passes use it instead of `node.args[i]`, so an op's signature can change in one place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx

from moepass import eager

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def graph_leaf(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a plain function graphs call), kept as one call node when its graph is traced again (a GraphModule
    unpickled re-traces its code): called on an fx.Proxy it records itself rather than run Python control flow
    on one, as `torch.fx.wrap` does for a traced module's own globals."""

    @functools.wraps(fn)
    def leaf(*args: Any, **kwargs: Any) -> Any:
        proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)), None)
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", leaf, args, kwargs)

    return leaf


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


def operands_from(node: fx.Node, name: str) -> tuple[Any, ...]:
    """The operands the call `node` passed by position from the op's parameter `name` on (the trailing options
    of a call rebuilt with other leading operands; defaults it left out stay out)."""
    return tuple(node.args[_index(node, name):])


def set_operand(node: fx.Node, name: str, value: Any) -> None:
    """Make the call `node` pass `value` as the op's parameter `name` (where it passed it: by position or keyword)."""
    index = _index(node, name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


Autograd = tuple[Callable[..., Any], Callable[..., None]]  # (backward, setup_context)


@dataclass(frozen=True)
class Operand:
    name: str
    type: str  # torch schema type: Tensor, Tensor?, SymInt, float, bool, str, ...
    mutated: bool = False  # the op writes it in place
    default: str | None = None  # the schema's default, as written (e.g. "False")

    @property
    def letters(self) -> str:
        """The shape letters of a tensor operand (`x_TD` -> "TD"); "" for scalars and unlettered names."""
        head, _, tail = self.name.rpartition("_")
        return tail if head and self.type.startswith("Tensor") and tail.isupper() else ""


def parse_operands(text: str) -> tuple[Operand, ...]:
    """`"Tensor x_TD, Tensor(a0!) counter_O, bool recompute=False"` -> the Operand records."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        declaration, _, default = item.partition("=")
        words = declaration.split()
        if len(words) != 2:
            raise ValueError(f"operand declaration {item!r}: expected 'Type name' or 'Type name=default' "
                             f"(torch schema syntax, e.g. 'Tensor? bias_E')")
        type_, name = words
        mutated = "!" in type_
        out.append(Operand(name, "Tensor" if mutated else type_, mutated, default.strip() or None))
    return tuple(out)


@dataclass(frozen=True)
class OpSchema:
    """An op's one declaration. `operands`: torch schema syntax; `returns`: the schema's return type
    (`"Tensor"`, `"(Tensor, Tensor)"`, `"Tensor[]"`, `"()"`); `fake`: the output shapes and checks (a
    function of the operands, registered on every op made from this schema); `autograd`: (backward,
    setup_context) or None; `autocast`: an `AUTOCAST_POLICIES` entry or None."""

    name: str
    operands_text: str
    returns: str
    fake: Callable[..., Any] | None = None
    autograd: Autograd | None = None
    autocast: str | None = None

    @property
    def operands(self) -> tuple[Operand, ...]:
        return parse_operands(self.operands_text)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    @property
    def mutates(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands if o.mutated)

    def signature(self) -> str:
        """The torch schema string (without the op's name): `(Tensor x_TD, ...) -> (Tensor, Tensor)`."""
        parts, alias = [], 0
        for o in self.operands:
            type_ = o.type
            if o.mutated:
                type_, alias = f"Tensor(a{alias}!)", alias + 1
            parts.append(f"{type_} {o.name}" + (f"={o.default}" if o.default is not None else ""))
        return f"({', '.join(parts)}) -> {self.returns}"

    def define(self, namespace: str, impl: Callable[..., Any], *, fake: Callable[..., Any] | None = None,
               autograd: Autograd | None = None) -> Any:
        """`namespace::name`, a torch.library custom op with this signature running `impl` (through
        `moepass.eager.custom_op`), with the schema's fake and autograd unless `fake` / `autograd` replace
        them for this op; the schema's autocast policy (`register_autocast`) when it has one."""
        op_def = eager.custom_op(f"{namespace}::{self.name}", mutates_args=self.mutates,
                                 schema=self.signature())(impl)
        fake = fake or self.fake
        if fake is not None:
            op_def.register_fake(fake)
        autograd = autograd or self.autograd
        if autograd is not None:
            eager.register_autograd(op_def, autograd[0], setup_context=autograd[1])
        if self.autocast is not None:
            register_autocast(eager.overload(f"{namespace}::{self.name}"), self.autocast)
        return op_def


AUTOCAST_POLICIES = ("fp32", "compute", "preserve")
_AUTOCAST_LIBS: dict[str, torch.library.Library] = {}


def register_autocast(op: torch._ops.OpOverload, policy: str) -> None:
    """Declare how `op` (a custom op's OpOverload, any namespace) behaves under autocast on CPU and CUDA.

    "fp32": floating inputs cast to fp32 (routers). "compute": cast to the autocast dtype (expert
    GEMMs). "preserve": inputs keep their dtypes (data movement); declared explicitly so eager and
    compiled runs agree rather than depending on the fallthrough.
    """
    if policy not in AUTOCAST_POLICIES:
        raise ValueError(f"register_autocast: policy {policy!r} is not one of {AUTOCAST_POLICIES}")
    namespace, op_name = op._schema.name.split("::")
    lib = _AUTOCAST_LIBS.get(namespace)
    if lib is None:
        lib = _AUTOCAST_LIBS[namespace] = torch.library.Library(namespace, "IMPL")
    for device_type in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _excluded=keyset):
            if policy == "preserve":
                cast_args = args
            else:
                dtype = torch.float32 if policy == "fp32" else torch.get_autocast_dtype(_device_type)
                cast_args = tuple(
                    a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.device.type == _device_type
                    else a
                    for a in args
                )
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return op(*cast_args)

        lib.impl(op_name, kernel, key, with_keyset=True)
