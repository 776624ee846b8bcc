"""The eager fast path: a dialect graph run eagerly calls its ops' Python implementations directly.

A `torch.library` custom op called eagerly goes C++ dispatcher -> the op's Python autograd kernel ->
redispatch -> a dynamo-disabled wrapper -> default filling and aliasing checks -> the Python function,
and its backward the same way back: ~30-60 us of host time per call, more than the work of a small
layer. Graphs keep the ops (what `explain`, the verifier, golden tests, Dynamo, AOT and export see);
eagerly, a `MoEGraphModule` runs a second forward generated from the same graph whose registered op
targets are replaced by `EagerOp`s, each running the *same* functions the op runs (its implementation,
its `setup_context` and `backward` in a `torch.autograd.Function`), so eager results and gradients
are the op's bit for bit. The graph's own forward runs instead whenever a caller could observe the
difference:

    torch.compile / export tracing (`torch.compiler.is_compiling()`), FX tracing (proxy inputs),
    a TorchFunctionMode or TorchDispatchMode (make_fx, FakeTensorMode, FlopCounterMode, capture),
    functorch transforms (vmap, grad), autocast (the ops carry autocast policies)
per op: a tensor argument of a subclass (DTensor, FakeTensor, FunctionalTensor): the op is called.

Ops join with `custom_op` / `register_autograd` below (thin wrappers of torch.library's, which record the
functions) or, for an op defined with `torch.library.Library` directly, `register`.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor, fx, nn

PLAIN_TENSORS = (Tensor, nn.Parameter)  # exact types a fast call takes; any subclass goes through the op
PLAIN_INPUTS = frozenset({Tensor, nn.Parameter, type(None), int, float, bool, str})


class EagerOp:
    """Run `op`'s implementation `fn` directly on plain tensors, through `function` (a
    `torch.autograd.Function` taking the same arguments) when a gradient is needed.

    `fn(*args)` is what the op's backend kernel runs; `function` the autograd torch.library would run
    (`autograd_function`). `__call__` takes the op's arguments positionally and complete (the generated
    eager code fills defaults); a tensor argument of a subclass sends the call to the op itself."""

    def __init__(self, op: torch._ops.OpOverload, fn: Callable[..., Any],
                 function: type[torch.autograd.Function] | None = None):
        self.op, self.fn, self.function = op, fn, function
        # `Function.apply` without its Python wrapper (which binds defaults for a `setup_context` style and walks
        # the arguments for dead functorch wrappers): these Functions take their arguments whole, and eager calls
        # run only outside functorch transforms (`eager_mode`)
        self.apply = None if function is None else super(torch.autograd.Function, function).apply  # type: ignore[misc]  # torch._C._FunctionBase.apply: untyped
        self.__name__ = "eager_" + op.name().replace("::", "_").replace(".", "_")
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        grad = False
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in PLAIN_TENSORS:
                    return self.op(*args)
                grad = grad or a.requires_grad
        if grad and self.apply is not None and torch.is_grad_enabled():
            return self.apply(*args)
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"EagerOp({self.op})"


def autograd_function(name: str, fn: Callable[..., Any], backward: Callable[..., Any],
                      setup_context: Callable[..., None] | None) -> type[torch.autograd.Function]:
    """The autograd.Function torch.library builds for a custom op with this autograd, without the dispatch."""

    def forward(ctx: Any, *args: Any) -> Any:
        output = fn(*args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


EAGER: dict[torch._ops.OpOverload, Callable[..., Any]] = {}  # op -> its eager callable (EagerOp or own)
_DEFINED: dict[Any, tuple[torch._ops.OpOverload, Callable[..., Any]]] = {}  # custom_op's result -> (op, function)


def register(op: torch._ops.OpOverload, eager: Callable[..., Any]) -> None:
    """Let generated eager code call `eager` (same arguments, complete and positional) in place of `op`."""
    EAGER[op] = eager


def overload(qualname: str) -> torch._ops.OpOverload:
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def custom_op(qualname: str, *, mutates_args: Any, schema: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """`torch.library.custom_op(qualname, mutates_args=..., schema=...)` that also registers the function as the
    op's eager implementation (no autograd: `register_autograd` adds it)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        op_def = torch.library.custom_op(qualname, fn, mutates_args=mutates_args, schema=schema)
        op = overload(qualname)
        _DEFINED[op_def] = (op, fn)
        register(op, EagerOp(op, fn))
        return op_def

    return wrap


def register_autograd(op_def: Any, backward: Callable[..., Any], *, setup_context: Callable[..., None]) -> None:
    """`op_def.register_autograd(backward, setup_context=...)`, and for an op defined with `custom_op` above
    the same autograd for its eager calls."""
    op_def.register_autograd(backward, setup_context=setup_context)
    if op_def in _DEFINED:
        op, fn = _DEFINED[op_def]
        register(op, EagerOp(op, fn, autograd_function(f"Eager_{op.name()}", fn, backward, setup_context)))


def function_of(op: Any) -> Callable[..., Any] | None:
    """The Python function behind an op defined with `custom_op` (an OpOverload or its packet), else None."""
    found = EAGER.get(getattr(op, "default", op))
    return found.fn if isinstance(found, EagerOp) else None


def call(op: torch._ops.OpOverload, *args: Any) -> Any:
    """`op(*args)`, through its eager implementation when nothing could observe the difference (for code
    that runs both eagerly and under tracing, e.g. a backward that calls another op)."""
    eager = EAGER.get(op)
    if eager is None or not eager_mode():
        return op(*args)
    return eager(*args)


def watched() -> bool:
    """A compiler, tracer, function or dispatch mode, or functorch transform is active: it must see the graph's ops."""
    return (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() > 0 or torch._C._are_functorch_transforms_active())


def eager_mode() -> bool:
    """Nothing watching (`watched`) and no autocast (the ops carry autocast policies): see the module docstring."""
    return not (watched() or torch._C._is_any_autocast_enabled())


def plain_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return all(type(a) in PLAIN_INPUTS for a in args) and all(type(a) in PLAIN_INPUTS for a in kwargs.values())


def complete_args(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A node's arguments to `op` as one complete positional tuple (defaults filled from the schema)."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise TypeError(f"{op}: no value for argument {arg.name!r}")
    return tuple(out)


def eager_graph(graph: fx.Graph) -> tuple[fx.Graph, int]:
    """A copy of `graph` whose registered ops call their `EAGER` entries; and how many nodes were swapped."""
    copy = deepcopy(graph)  # nodes copied, their meta shared (fx.Graph.__deepcopy__); the same codegen
    swapped = 0
    for node in copy.nodes:
        if node.op == "call_function" and node.target in EAGER:
            node.args, node.kwargs = complete_args(node.target, node.args, node.kwargs), {}
            node.target = EAGER[node.target]
            swapped += 1
    return copy, swapped


def build_forward(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """The eager forward of `gm`'s current graph (a function of (self, *inputs)), or None when no node
    runs an op with an eager implementation."""
    graph, swapped = eager_graph(gm.graph)
    if not swapped:
        return None
    code = graph.python_code(root_module="self")
    scope = dict(code.globals)
    exec(compile(code.src, f"<moepass eager {type(gm).__name__}>", "exec"), scope)  # noqa: S102 (FX's codegen)
    return scope["forward"]


def dispatching_forward(graph_forward: Callable[..., Any],
                        check: Callable[[Any, tuple[Any, ...]], None] | None = None) -> Callable[..., Any]:
    """A GraphModule forward that runs `check(self, args)` first (if given), then the eager forward (built on
    first use from the graph as it is now) when `eager_mode()` and its inputs are plain, else `graph_forward`
    (the graph's own code)."""
    built: list[Callable[..., Any] | None] = []

    def forward(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            check(self, args)
        if eager_mode() and plain_inputs(args, kwargs):
            if not built:
                built.append(build_forward(self))
            if built[0] is not None:
                return built[0](self, *args, **kwargs)
        return graph_forward(self, *args, **kwargs)

    forward.__wrapped__ = graph_forward  # type: ignore[attr-defined]  # inspect.signature sees the graph's inputs
    return forward


def install(gm: fx.GraphModule, check: Callable[[Any, tuple[Any, ...]], None] | None = None) -> None:
    """Make `gm`'s forward run `check(gm, args)` and dispatch between the eager and the graph code (call after
    every recompile: GraphModule.recompile sets the forward of gm's own class)."""
    cls = type(gm)
    cls.forward = dispatching_forward(cls.forward, check)


__all__ = ["EAGER", "EagerOp", "autograd_function", "call", "custom_op", "dispatching_forward", "eager_mode",
           "function_of", "install", "register", "register_autograd", "watched"]
