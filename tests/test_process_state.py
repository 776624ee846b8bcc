"""No mutable module-global state outside `moepass.process_state` (issue 28, Build item 2).

Every module of moepass, lowering and cost_model is read with `ast`. A module-level assignment fails when its
value is state:
  - a stateful object: a call of `STATEFUL_CALLS` (collections, weakref, threading, queues...) or an instance of
    a class the module itself defines (unless a frozen dataclass, a NamedTuple or an Enum);
  - a container (list / dict / set display or comprehension, `list()` / `dict()` / `set()`) that some module
    mutates: `X[k] = v`, `X[k] += v`, `del X[k]`, `X.append(...)` and the other in-place methods, a second
    assignment at module level. A container nothing mutates is a read-only table and passes.
A `global` statement anywhere fails. `moepass/process_state.py` is where such state lives; `REGISTRIES` names the
few registries built in one visible place, each with its reason. Mutation is found by name (`X` in its module
and in modules that import it by name, `.X` anywhere): a mutation through another alias is not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from moepass import layers, process_state

ROOT = Path(__file__).resolve().parents[1]
STATE_MODULE = "moepass/process_state.py"

STATEFUL_CALLS = frozenset({
    "Counter", "deque", "defaultdict", "OrderedDict", "ChainMap", "WeakKeyDictionary", "WeakValueDictionary",
    "WeakIdKeyDictionary", "WeakSet", "Lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore",
    "Barrier", "local", "Queue", "SimpleQueue", "LifoQueue", "PriorityQueue", "ThreadPoolExecutor", "bytearray",
})
CONTAINER_CALLS = frozenset({"list", "dict", "set"})
MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
    "appendleft", "extendleft", "popleft", "sort", "reverse", "difference_update", "intersection_update",
    "symmetric_difference_update",
})

# (file, name) -> why it may stay where it is: registries filled in one visible place, never emptied.
REGISTRIES = {
    ("moepass/eager.py", "EAGER"): "op -> eager callable, filled by `register` when an op is defined (mirrors "
                                   "torch.library's own process-wide registration)",
    ("moepass/eager.py", "_DEFINED"): "custom_op result -> (op, function), filled by `custom_op` as the op is made",
    ("moepass/operands.py", "_AUTOCAST_LIBS"): "namespace -> its torch.library IMPL Library, made once per namespace",
    ("moepass/dialect_ffn.py", "_FFN_LIBS"): "keeps the torch.library Libraries of the expert-FFN ops alive",
    ("cost_model/symbols.py", "TABLE"): "the symbol legend, filled by the `_sym` calls right below it",
    ("cost_model/symbols.py", "OPTIONAL"): "the optional symbols, filled by the `_optional` calls right below it",
    ("moepass/detect/__init__.py", "RECOGNISERS"): "the recogniser registry, built in one statement from the "
                                                  "built-in recognisers; `register_recogniser` adds a user's own",
    ("moepass/plan.py", "_PLAN_DEFAULTS"): "built in two statements next to each other, read-only afterwards",
}


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _immutable_classes(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {_name(b) for b in node.bases}
        frozen = any(isinstance(d, ast.Call) and _name(d.func) == "dataclass"
                     and any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                             for k in d.keywords) for d in node.decorator_list)
        if frozen or bases & {"NamedTuple", "Enum", "IntEnum", "StrEnum", "Flag"}:
            out.add(node.name)
    return out


def _module_statements(tree: ast.Module):
    """Module-level statements, those under module-level if / try / with included."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, block, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body


def _assigned(tree: ast.Module):
    """(name, line, value) of each module-level assignment to a plain name."""
    for node in _module_statements(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id, node.lineno, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            yield node.target.id, node.lineno, node.value
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node.lineno, node.value


def _mutated(tree: ast.Module, names: set[str], attributes_only: bool) -> set[str]:
    """The names of `names` this tree mutates in place (module doc)."""

    def base(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name) and not attributes_only:
            return expr.id
        return expr.attr if isinstance(expr, ast.Attribute) else None

    out = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and base(t.value) in names:
                out.add(base(t.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if base(node.func.value) in names:
                out.add(base(node.func.value))
    return out


def violations(sources: dict[str, str], registries: dict[tuple[str, str], str] | None = None) -> list[str]:
    """`file:line: name: why` for each piece of mutable module-global state in `sources` ({file: source})."""
    registries = REGISTRIES if registries is None else registries
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    found: list[str] = []
    containers: dict[str, list[tuple[str, int]]] = {}  # name -> (file, line) of a module-level container
    for path, tree in trees.items():
        if path == STATE_MODULE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{path}:{node.lineno}: {', '.join(node.names)}: a `global` statement")
        immutable = _immutable_classes(tree)
        own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)} - immutable
        seen: dict[str, int] = {}
        for name, line, value in _assigned(tree):
            if name == "__all__" or (path, name) in registries:
                continue
            if name in seen:
                found.append(f"{path}:{line}: {name}: assigned again at module level (first at line {seen[name]})")
            seen.setdefault(name, line)
            called = _name(value.func) if isinstance(value, ast.Call) else None
            if called in STATEFUL_CALLS or called in own:
                found.append(f"{path}:{line}: {name}: a module-level {called}() is process-wide state")
            elif called in CONTAINER_CALLS or isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp,
                                                                   ast.DictComp, ast.SetComp)):
                containers.setdefault(name, []).append((path, line))
    for path, tree in trees.items():
        for name in sorted(_mutated(tree, set(containers), attributes_only=False)):
            importers = {p for p, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.ImportFrom)
                         and any(a.name == name and a.asname in (None, name) for a in n.names)}
            for where, line in containers[name]:
                if path == where or path in importers:
                    found.append(f"{where}:{line}: {name}: a module-level container mutated in {path}")
        for name in sorted(_mutated(tree, set(containers), attributes_only=True)):
            for where, line in containers[name]:
                found.append(f"{where}:{line}: {name}: a module-level container mutated in {path}")
    return sorted(set(found))


def tree_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for package in layers.PACKAGES
            for p in sorted((ROOT / package).rglob("*.py"))}


def test_no_mutable_module_globals_outside_process_state():
    found = violations(tree_sources())
    assert not found, ("mutable module-global state outside moepass/process_state.py (declare it there, with who "
                       "owns it and when it is emptied):\n" + "\n".join(found))


def test_every_registry_allowed_still_exists():
    sources = tree_sources()
    for (path, name), why in REGISTRIES.items():
        assert path in sources and any(n == name for n, _, _ in _assigned(ast.parse(sources[path]))), (path, name, why)


def test_the_check_reports_each_kind_of_state():
    source = '''
import collections, threading
from dataclasses import dataclass

TABLE = {"a": 1}            # read-only: fine
CACHE = {}                  # mutated below
HITS = collections.Counter()
LOCK = threading.Lock()
__all__ = ["f"]


class Box:
    pass


@dataclass(frozen=True)
class Point:
    x: int


BOX = Box()
ORIGIN = Point(0)           # frozen: fine
COUNT = 0


def f(k):
    global COUNT
    CACHE[k] = TABLE["a"]
    COUNT += 1
'''
    other = "from pkg.mod import TABLE\nimport pkg.mod\n\ndef g():\n    pkg.mod.LIST.append(1)\n"
    third = "LIST = []\n"
    found = violations({"pkg/mod.py": source, "pkg/other.py": other, "pkg/third.py": third}, registries={})
    assert found == sorted([
        "pkg/mod.py:6: CACHE: a module-level container mutated in pkg/mod.py",
        "pkg/mod.py:7: HITS: a module-level Counter() is process-wide state",
        "pkg/mod.py:8: LOCK: a module-level Lock() is process-wide state",
        "pkg/mod.py:21: BOX: a module-level Box() is process-wide state",
        "pkg/mod.py:27: COUNT: a `global` statement",
        "pkg/third.py:1: LIST: a module-level container mutated in pkg/other.py",
    ]), found
    assert violations({STATE_MODULE: source}, registries={}) == []  # the state module is where state lives


def test_a_table_mutated_through_an_import_is_reported():
    found = violations({"a.py": "NAMES = {}\n", "b.py": "from a import NAMES\nNAMES['x'] = 1\n"}, registries={})
    assert found == ["a.py:1: NAMES: a module-level container mutated in b.py"]


def test_reset_empties_the_caches_and_records():
    t = torch.ones(1)
    process_state.BACKEND.counters["graphs"] += 1
    process_state.BACKEND.reports.append("report")
    process_state.BACKEND.graphs = 3
    process_state.COMM_STATS["dispatch"] = {"intra": 1}
    process_state.KERNEL_FALLBACKS["route"] += 1
    process_state.GRAD_BUFFERS[t] = {}
    process_state.WORLD_GROUPS.set(object())
    module = torch.nn.Linear(1, 1)
    process_state.DETECTED[module] = "report"
    process_state.reset()
    assert not process_state.BACKEND.counters and not process_state.BACKEND.reports
    assert process_state.BACKEND.graphs == 0 and process_state.BACKEND.reports.maxlen == 64
    assert not process_state.COMM_STATS and not process_state.KERNEL_FALLBACKS and len(process_state.GRAD_BUFFERS) == 0
    assert process_state.WORLD_GROUPS.value is None and module not in process_state.DETECTED


def test_a_slot_makes_its_object_once():
    slot: process_state.Slot[list[int]] = process_state.Slot()
    made = slot.get(list)
    assert slot.get(lambda: [1]) is made and slot.value is made
    slot.clear()
    assert slot.value is None and slot.get(lambda: [1]) == [1]


def test_owners_share_the_state_objects():
    from lowering import codegen
    from moepass import backend, inspect
    from moepass.runtime import fsep

    assert codegen.FALLBACKS is process_state.KERNEL_FALLBACKS
    assert backend.COUNTERS is process_state.BACKEND.counters and backend.MAX_REPORTS == 64
    assert inspect.COMM_ANNOTATORS is process_state.COMM_ANNOTATORS
    assert fsep.deferred() is fsep.deferred() is process_state.FSEP_DEFERRED.value
