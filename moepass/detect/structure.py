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
_PLAIN_TYPES = frozenset(_PLAIN)  # the common case, an exact type: one set lookup instead of isinstance
# what every module holds (`training`, its tables and hooks): never a plain attribute of the key
_MODULE_STATE = frozenset(k for k in vars(nn.Module()) if k.startswith("_")) | {"training"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")
_HOOK_SET = frozenset(_HOOKS)  # all in the instance dict (as nn.Module.__init__ makes them): read from there


class _NoKey(Exception):
    pass


def _value(value: object) -> Hashable:
    if type(value) in _PLAIN_TYPES or isinstance(value, _PLAIN):
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
    state = vars(module)
    hooks = map(state.get, _HOOKS) if state.keys() >= _HOOK_SET else (getattr(module, n, None) for n in _HOOKS)
    if any(hooks):
        raise _NoKey("hooks")
    names = state.keys() - _MODULE_STATE
    attrs = tuple([(k, _value(state[k])) for k in sorted(names) if not k.startswith("_")]) if names else ()
    params = tuple([(n, p.shape, p.dtype, p.device.type, p.requires_grad)
                    for n, p in module._parameters.items() if p is not None]) if module._parameters else ()
    buffers = tuple([(n, b.shape, b.dtype, b.device.type, n not in module._non_persistent_buffers_set)
                     for n, b in module._buffers.items() if b is not None]) if module._buffers else ()
    children = tuple([(n, _key(c)) for n, c in module._modules.items() if c is not None]) if module._modules else ()
    return (type(module), attrs, params, buffers, children)


def structural_key(module: nn.Module) -> Hashable | None:
    """The module's structural key (see module doc), or None when it has none."""
    try:
        return _key(module)
    except (_NoKey, TypeError):  # TypeError: an unorderable or unhashable attribute value
        return None
