"""The seams between first-party packages: no private (underscore) name used across packages. (The
layers and import cycles, counting every import: tests/test_layers.py.)

Packages: moepass, lowering, cost_model, samples, benchmarks, tests. A private name may be used inside
its own package; another package gets a public name (promote what two packages share into a public
helper).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moepass", "lowering", "cost_model", "samples", "benchmarks", "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(extra: dict[str, str] | None = None) -> dict[str, tuple[Path, ast.Module]]:
    """Every first-party module's path and syntax tree; `extra` adds files (repo-relative path: source) that are
    not on disk (the checker's own test: nothing is written into the repository, which other tests read)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    for relative, text in (extra or {}).items():
        path = ROOT / relative
        out[module_name(path)] = (path, ast.parse(text, filename=str(path)))
    return out


def first_party(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imports(tree: ast.Module, module: str):
    """(imported module, imported name or None, alias bound, node) for every import in the file."""
    package = module.rsplit(".", 1)[0] if "." in module else module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, a.asname or a.name.split(".")[0], node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                yield base, a.name, a.asname or a.name, node


def cross_package_private_uses(extra: dict[str, str] | None = None) -> list[str]:
    found = []
    all_sources = sources(extra)
    for module, (path, tree) in all_sources.items():
        top = module.split(".")[0]
        aliases = {}  # local name -> first-party module of another package
        for target, name, alias, node in imports(tree, module):
            if not first_party(target) or target.split(".")[0] == top:
                continue
            full = f"{target}.{name}" if name else target
            if any(private(part) for part in full.split(".")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {full}")
            if name is None or f"{target}.{name}" in all_sources:
                aliases[alias] = f"{target}.{name}" if name else target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and private(node.attr)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_package():
    assert cross_package_private_uses() == []


def test_the_check_sees_a_private_import():
    """The checker itself: a file of one package reaching into another's private names is reported."""
    probe = "from moepass.dialect import _route_bwd\nfrom moepass import checkpoint\ncheckpoint._plain(1)\n"
    found = cross_package_private_uses({"samples/_seam_probe.py": probe})
    assert any("imports moepass.dialect._route_bwd" in f for f in found)
    assert any("uses moepass.checkpoint._plain" in f for f in found)
