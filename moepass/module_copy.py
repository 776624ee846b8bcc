"""`deepcopy_module`: `copy.deepcopy` of an `nn.Module` tree, without its per-object overhead.

`copy.deepcopy` copies a module through the generic pickle protocol: `__reduce_ex__`, a copy of its
`__dict__`, and `copyreg`'s reconstruction of each of the dozen hook dictionaries every module owns
(almost always empty). On the 10.5k modules of 32 layers x 64 experts that is 470k Python calls and
0.8-1.2 s before a single tensor is copied (0.12-0.14 s here, with the collector paused). For a module whose class copies the standard way (it
does not customise `__deepcopy__`, `__reduce_ex__`, `__reduce__`, `__getstate__` or `__setstate__`),
`deepcopy_module` does what that protocol does, directly: a new instance, its state copied value by
value into the same `memo` (children recursively, empty hook containers made new), `__setstate__`.
The result is the one `copy.deepcopy` gives, sharing included: every object copied goes through
`memo`, so a tensor or module referenced twice is copied once, and ids registered in `memo`
beforehand are adopted (`canonical.stacked_copies`). Any other class is handed to `copy.deepcopy`.

What must not be copied is shared: the copy holds the original object (`share_uncopyable`). That is an
object of a known runtime type (a process group, a `DeviceMesh`, a store, a stream or event: `SHARED_TYPES`),
or one that is not plain data (not a tensor, a module or a container) and whose copy raises (a lock, a
file handle, a generator, an object holding one of them). Deep-copying a model that holds a process group
raises `cannot pickle 'ProcessGroup' object` otherwise; a copy of a `DeviceMesh` would be another mesh.

`alias_in_memo` and `unshare` serve a copy whose rewrite replaces some tensors anyway (the expert weights
under EP and FSEP, which keep only their shard): the copy adopts aliases of those tensors instead of copying
them, and `unshare` copies any alias the rewritten result still holds, so it never shares memory with the
original.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import gc
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_EMPTY_CONTAINERS = frozenset((dict, OrderedDict, set))
_ATOMIC = frozenset((type(None), bool, int, float, str))  # what `copy.deepcopy` returns as it is
_CONTAINERS = (list, tuple, dict, set, frozenset)  # walked element by element for what they hold

# Runtime handles a copy shares whether or not their type copies: a copy would be another group, mesh, store
# or queue position, not the one the model's code means (a DeviceMesh deep-copies without an error).
SHARED_TYPES: tuple[type, ...] = (dist.ProcessGroup, DeviceMesh, dist.Store, dist.Work, torch.Stream, torch.Event,
                                  torch._C._CudaStreamBase, torch._C._CudaEventBase)


@cache
def copies_plainly(cls: type) -> bool:
    """True when `copy.deepcopy` of a `cls` instance is the standard `nn.Module` reconstruction."""
    return (issubclass(cls, nn.Module) and not issubclass(cls, (list, dict, set, tuple))
            and cls not in copyreg.dispatch_table
            and getattr(cls, "__deepcopy__", None) is None
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getnewargs_ex__", None) is None and getattr(cls, "__getnewargs__", None) is None
            and cls.__getstate__ is nn.Module.__getstate__ and cls.__setstate__ is nn.Module.__setstate__)


def module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """The modules `model` reaches at several paths (a block two layers share): first path -> the other paths."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return {found[0]: found[1:] for found in paths.values() if len(found) > 1}


def deepcopy_module(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """`copy.deepcopy(module, memo)`, faster on large module trees (see the module docstring)."""
    memo = {} if memo is None else memo
    with gc_paused():
        return _copy(module, memo)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a large object graph is built (a model copy makes
    ~20 objects per module, each allocation counting towards a collection that then walks every object
    alive: on 10k modules the collections cost 2-5x the copy itself); restored as it was, even on error."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _copy(module: nn.Module, memo: dict[int, Any]) -> Any:
    done = memo.get(id(module), memo)  # `memo` itself as the not-found marker: never a copied value
    if done is not memo:
        return done
    cls = type(module)
    if not copies_plainly(cls):  # type: ignore[arg-type]  # classes are hashable
        return _deepcopy_sharing(module, memo, f"a {cls.__name__} module")
    new = cls.__new__(cls)
    memo[id(module)] = new
    state = module.__getstate__()  # a new dict: its entries are replaced by their copies in place
    for name, value in state.items():
        kind = type(value)
        if kind in _ATOMIC:
            continue
        if name == "_modules":
            state[name] = _copy_children(value, memo)
        elif kind in _EMPTY_CONTAINERS and not value and id(value) not in memo:
            state[name] = memo[id(value)] = kind()
        elif kind is dict and id(value) not in memo:  # _parameters, _buffers: tensors, mostly memoised already
            state[name] = memo[id(value)] = {key if type(key) is str else copy.deepcopy(key, memo): _copy_value(v, memo)
                                             for key, v in value.items()}
        else:
            state[name] = _deepcopy_sharing(value, memo, f"attribute {name!r} of a {cls.__name__} module")
    new.__setstate__(state)
    return new


def _deepcopy_sharing(value: Any, memo: dict[int, Any], what: str) -> Any:
    """`copy.deepcopy(value, memo)`, sharing what `share_uncopyable` shares: the known runtime types first
    (cheap: the value and its containers); on a copy that raises, `memo` is put back as it was (a failed
    copy leaves half-built objects in it) and every uncopyable object inside is shared, then copied again."""
    _share_known(value, memo)
    mark = len(memo)
    try:
        return copy.deepcopy(value, memo)
    except Exception as err:
        for key in list(memo)[mark:]:  # a dict keeps insertion order: the failed copy's entries are the last
            del memo[key]
        if not share_uncopyable(value, memo):
            raise TypeError(f"deep-copying {what} failed: {type(err).__name__}: {err}. Give its class a "
                            f"__deepcopy__, or hold the object somewhere a copy of the model need not reach.") from err
        return copy.deepcopy(value, memo)


def _share_known(value: Any, memo: dict[int, Any]) -> None:
    """Register every `SHARED_TYPES` object in `value` (itself, or inside plain containers) in `memo` as
    itself."""
    if isinstance(value, SHARED_TYPES):
        memo[id(value)] = value
    elif isinstance(value, _CONTAINERS):
        for item in [*value.keys(), *value.values()] if isinstance(value, dict) else value:
            if type(item) not in _ATOMIC:
                _share_known(item, memo)


def share_uncopyable(value: Any, memo: dict[int, Any]) -> int:
    """Register in `memo`, as itself, every object inside `value` (through containers, modules and their
    state) that a copy must share: a `SHARED_TYPES` object, or one that is not plain data (not a tensor, a
    module or a container) and whose `copy.deepcopy` raises. Tensors, modules and containers are never
    shared (a copy sharing them would alias the original's state). Returns how many were registered."""
    shared = 0
    seen: set[int] = set()
    todo = [value]
    while todo:
        obj = todo.pop()
        if type(obj) in _ATOMIC or id(obj) in seen or id(obj) in memo or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            todo.extend(vars(obj).values())
        elif isinstance(obj, _CONTAINERS):  # a dict's keys and values (not item tuples: `seen` holds lasting ids)
            todo.extend([*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj)
        elif isinstance(obj, SHARED_TYPES) or not _copies(obj):
            memo[id(obj)] = obj
            shared += 1
    return shared


def _copies(obj: Any) -> bool:
    """Whether `copy.deepcopy(obj)` succeeds (on a memo of its own: the trial copy is dropped)."""
    try:
        copy.deepcopy(obj, {})
    except Exception:
        return False
    return True


def _copy_value(value: Any, memo: dict[int, Any]) -> Any:
    done = memo.get(id(value), memo)
    return copy.deepcopy(value, memo) if done is memo else done


def _copy_children(children: dict[str, nn.Module | None], memo: dict[int, Any]) -> dict[str, nn.Module | None]:
    done = memo.get(id(children), memo)
    if done is not memo:
        return done
    copied = memo[id(children)] = type(children)()
    for name, child in children.items():
        copied[name] = None if child is None else _copy(child, memo)
    return copied


def storage_counts(module: nn.Module) -> Counter[int]:
    """How many parameter and buffer entries of `module` lie in each storage (by its data pointer; a tied
    tensor counts once per entry). Tensors without data (meta, fake) are left out."""
    counts: Counter[int] = Counter()
    entries = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for _, t in entries:
        ptr = data_pointer(t)
        if ptr:
            counts[ptr] += 1
    return counts


def alias_in_memo(tensors: Sequence[torch.Tensor], memo: dict[int, Any], counts: Counter[int]) -> int:
    """Before a deep copy whose rewrite replaces `tensors` anyway (EP and FSEP copy only their own shard): a
    new Parameter over each one's storage goes into `memo`, so the copy adopts it instead of copying it. Only a
    plain Parameter alone in its storage (`counts`, from `storage_counts`) and spanning it whole is aliased: no
    other tensor can see the difference. `unshare` then copies whatever alias the result still holds, so the
    result never shares memory with the original. Returns how many were aliased."""
    aliased = 0
    for t in tensors:
        ptr = data_pointer(t)
        if (type(t) is not nn.Parameter or id(t) in memo or not ptr or counts[ptr] != 1
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            continue
        memo[id(t)] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
        aliased += 1
    return aliased


def unshare(copied: nn.Module, original: nn.Module) -> int:
    """Give every parameter and buffer of `copied` that shares a storage with `original` its own copy (same
    Parameter object, `.data` replaced; same values). Returns how many were copied."""
    shared = set(storage_counts(original))
    copies = 0
    for module in copied.modules():
        for p in module._parameters.values():
            if p is not None and data_pointer(p) in shared:
                p.data = p.detach().clone()
                copies += 1
        for name, b in module._buffers.items():
            if b is not None and data_pointer(b) in shared:
                module._buffers[name] = b.clone()
                copies += 1
    return copies


def data_pointer(t: torch.Tensor) -> int:
    """The data pointer of `t`'s storage; 0 for tensors without one (meta, fake, DTensor wrappers)."""
    if isinstance(t, DTensor) or t.is_meta:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
