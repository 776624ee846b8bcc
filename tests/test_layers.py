"""The layers of moepass, lowering and cost_model (`moepass.layers.LAYERS`): every import, at module level,
inside a function or under TYPE_CHECKING, goes to the importer's own layer or to a layer it uses, and the
imports between first-party modules form no cycle. docs/ARCHITECTURE.md shows the same table."""

import ast
from pathlib import Path

import pytest

from moepass import layers

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(packages=layers.PACKAGES) -> dict[str, Path]:
    return {module_name(path): path for package in packages for path in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(first-party module, line) for every import in the file, wherever it is. `from pkg import name` is an
    import of `pkg.name` when that is a module, else of `pkg`; `import a.b.c` of the longest known prefix."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def known_prefix(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [known_prefix(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else known_prefix(base) for a in node.names]
        out += [(t, node.lineno) for t in targets if t is not None and t != module]
    return out


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported first-party module: the first line importing it}."""
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        graph[module] = {}
        for target, line in imported_modules(path, module, known):
            graph[module].setdefault(target, line)
    return graph


def cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def upward_imports(graph) -> list[str]:
    return [f"{files_path(m)}:{line} imports {t} ({layers.layer_of(m).name} -> {layers.layer_of(t).name})"
            for m, targets in graph.items() for t, line in targets.items() if not layers.may_import(m, t)]


def files_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def test_every_module_has_a_layer():
    assert [m for m in sources() if layers.layer_of(m) is None] == []


def test_every_table_entry_names_a_module():
    files = set(sources())
    stale = [e for layer in layers.LAYERS for e in layer.modules
             if (e[:-2] if e.endswith(".*") else e) not in files]
    assert stale == []


def test_layers_use_only_layers_below_them():
    seen = set()
    for layer in layers.LAYERS:
        assert set(layer.uses) <= seen, f"layer {layer.name} uses a layer above it: {set(layer.uses) - seen}"
        seen.add(layer.name)


def test_no_import_goes_up_a_layer():
    assert upward_imports(import_graph(sources())) == []


def test_no_import_cycle():
    # a package's __init__ re-exporting its modules is not a cycle of design: drop package -> child edges
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in import_graph(sources()).items()}
    assert cycles(graph) == []


def test_architecture_shows_the_table():
    assert layers.markdown() in (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("where", ["def f():\n    {imp}\n", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {imp}\n",
                                   "{imp}\n"])
def test_the_check_reads_imports_anywhere(tmp_path, where):
    """An upward import is found at module level, inside a function and under TYPE_CHECKING."""
    probe = tmp_path / "moepass" / "errors.py"
    probe.parent.mkdir()
    probe.write_text(where.format(imp="from moepass.api import compile"))
    found = imported_modules(probe, "moepass.errors", {"moepass.errors", "moepass.api"})
    assert [t for t, _ in found] == ["moepass.api"]
    assert not layers.may_import("moepass.errors", "moepass.api")


def test_public_names_are_imported_when_first_read():
    """`moepass/__init__` imports its public names lazily (PEP 562): the cost-model CLI's planner import costs neither
    the passes nor Dynamo (installed: the backend comes from the entry point); every name in `__all__` resolves, and
    `moepass.detect` / `moepass.verify` are the functions even though modules of those names exist."""
    import subprocess
    import sys

    probe = (
        "import sys, importlib.metadata\n"
        "import moepass.runtime.placement\n"
        "installed = any(ep.name == 'moepass' for ep in importlib.metadata.entry_points(group='torch_dynamo_backends'))\n"
        "print(int('moepass.api' in sys.modules), int(installed and 'torch._dynamo' in sys.modules))\n"
        "import moepass, moepass.detect, moepass.verify, inspect\n"
        "assert inspect.isfunction(moepass.detect) and inspect.isfunction(moepass.verify)\n"
        "assert all(getattr(moepass, name) is not None for name in moepass.__all__)\n"
        "import torch\n"
        "assert 'moepass' in torch._dynamo.list_backends()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0"], out.stdout
