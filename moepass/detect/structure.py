"""A block's structural key: two modules with equal keys run the same code on tensors of the same shapes.

Detection checks the first block of a structure on probe inputs and reuses its verdict (spec or reason)
for every later block with an equal key (a deep model repeats one MoE block per layer: 32 identical
checks become one). The key holds, recursively: the module's class (the object itself: two classes of
one name never collide), its plain attributes (numbers, strings, flags, dtypes, tuples of them,
function names, configs with `to_dict`), its parameters and buffers (name, shape, dtype, device type,
requires_grad / persistent) and its children's keys, in order. A module with hooks, or with an
attribute of another kind (something whose effect on `forward` the key cannot see), has no key
(None): it is always checked on its own. The weights' values are not in the key: they do not change
what the code computes, only its numbers.
"""

from __future__ import annotations

import types
from collections.abc import Hashable

import torch
from torch import nn

_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")


class _NoKey(Exception):
    pass


def _value(value: object) -> Hashable:
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _value(v)) for k, v in value.items())))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return ("function", value.__module__, value.__qualname__)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # a configuration object (Hugging Face PretrainedConfig and the like)
        return (type(value).__qualname__, _value(to_dict()))
    raise _NoKey(type(value).__qualname__)


def _key(module: nn.Module) -> Hashable:
    if any(getattr(module, name, None) for name in _HOOKS):
        raise _NoKey("hooks")
    attrs = tuple(sorted((k, _value(v)) for k, v in vars(module).items() if not k.startswith("_")
                         and k != "training"))
    params = tuple((n, tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad)
                   for n, p in module._parameters.items() if p is not None)
    buffers = tuple((n, tuple(b.shape), str(b.dtype), b.device.type, n not in module._non_persistent_buffers_set)
                    for n, b in module._buffers.items() if b is not None)
    children = tuple((n, _key(c)) for n, c in module._modules.items() if c is not None)
    return (id(type(module)), type(module).__qualname__, attrs, params, buffers, children)


def structural_key(module: nn.Module) -> Hashable | None:
    """The module's structural key (see module doc), or None when it has none."""
    try:
        return _key(module)
    except (_NoKey, TypeError):  # TypeError: an unorderable or unhashable attribute value
        return None
