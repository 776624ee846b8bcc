"""What every pass returns, and the signature of a pass (see `moepass/pipeline.py` for the order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, fx, nn

from moepass.canonical import MoEGraphModule
from moepass.plan import Plan


@dataclass
class PassResult:
    """A pass's output graph module, whether it changed anything, and its counters (tests assert them)."""

    gm: MoEGraphModule
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    effects: Effects | None = None  # what the pass changes outside its graph; the pipeline applies it


Pass = Callable[[MoEGraphModule, Plan], PassResult]


@dataclass
class Effects:
    """What a rewrite changes outside its graph, declared rather than done: the pipeline applies them in
    one place (`apply_effects`), after the pass built its graph and before the graph is recompiled.

    Names are relative to the block (dotted: inside one of its children).
    """

    parameters: dict[str, nn.Parameter] = field(default_factory=dict)  # register, or replace in place
    removed: list[str] = field(default_factory=list)  # parameters the graph no longer reads (stacked originals)
    emptied: list[str] = field(default_factory=list)  # child modules to drop once they hold no tensor
    buffers: dict[str, Tensor] = field(default_factory=dict)  # new non-persistent buffers (tables the graph reads)
    replaced_buffers: dict[str, Tensor] = field(default_factory=dict)  # existing buffers' new values (sharded)
    modules: dict[str, nn.Module] = field(default_factory=dict)  # children the graph calls (controllers)
    grad_hooks: list[tuple[str, Callable[[Tensor], Tensor]]] = field(default_factory=list)  # (parameter, hook)
    relaid: dict[str, Tensor] = field(default_factory=dict)  # parameter -> its values' new storage (same object)
    form: str | None = None  # the block's parallel form after the pass (`MoEGraphModule.form`)
    layout: Any = None  # its expert layout (`MoEGraphModule.layout`: the form's own layout object)

    def __bool__(self) -> bool:
        return any((self.parameters, self.removed, self.emptied, self.buffers, self.replaced_buffers, self.modules,
                    self.grad_hooks, self.relaid, self.form is not None, self.layout is not None))


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def apply_effects(gm: fx.GraphModule, effects: Effects) -> None:
    """Apply a rewrite's declared effects to its block (see `Effects`): add what the new graph reads, drop
    the graph's dead nodes (the reads of what is removed), remove, hook; then recompile."""
    for path, param in effects.parameters.items():
        owner, name = _owner(gm, path)
        owner._parameters[name] = param
    for path, tensor in effects.buffers.items():
        owner, name = _owner(gm, path)
        owner.register_buffer(name, tensor, persistent=False)
    for path, tensor in effects.replaced_buffers.items():
        owner, name = _owner(gm, path)
        owner._buffers[name] = tensor  # same name, same persistence
    for path, module in effects.modules.items():
        owner, name = _owner(gm, path)
        owner.add_module(name, module)
    gm.graph.eliminate_dead_code()  # lints too: every get_attr must resolve now
    for path in effects.removed:
        owner, name = _owner(gm, path)
        del owner._parameters[name]
    for path in effects.emptied:
        module = gm.get_submodule(path)
        if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
            owner, name = _owner(gm, path)
            del owner._modules[name]
    for path, hook in effects.grad_hooks:
        gm.get_parameter(path).register_hook(hook)
    for path, storage in effects.relaid.items():  # the same Parameter object (and name, value) in new storage
        gm.get_parameter(path).data = storage
    if effects.form is not None:
        gm.form = effects.form  # type: ignore[assignment]
    if effects.layout is not None:
        gm.layout = effects.layout  # type: ignore[assignment]
    gm.recompile()
