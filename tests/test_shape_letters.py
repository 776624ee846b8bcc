"""One legend of shape letters (`moepass.spec.SHAPES`): no file defines its own, and every shape suffix
(`x_TD`, `w_up_EFD`, `ids_R1`) in moepass, lowering, cost_model and samples uses only its letters."""

import re
from pathlib import Path

from moepass.spec import SHAPES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moepass", "lowering", "cost_model", "samples")
LEGEND_BLOCK = re.compile(r"^\s*(?:#\s*)?(?:(?i:(?:shape\s+)?legend)|Shapes)\b[^\n]*:", re.M)
SUFFIX = re.compile(r"(?<![A-Za-z0-9_])[a-z][a-z0-9]*(?:_[a-z0-9]+)*_([A-Z][A-Za-z0-9]*)(?![A-Za-z0-9_])")
# Files whose variables still give S, R, G, N, B, X, Y or H another meaning (source / destination ranks,
# global slots, shard elements, history steps, exchange rows), with their own legend until they are renamed
# (the map: U global slots, P ranks as sources and as destinations, ...). The test fails when one is fixed
# and still listed, so the list only shrinks.
PENDING: set[str] = set()


def sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_the_legend_has_one_meaning_per_letter():
    assert all(len(letter) == 1 and meaning for letter, meaning in SHAPES.items())
    meanings = [meaning.split(":")[0].split(",")[0] for meaning in SHAPES.values()]
    assert len(set(meanings)) == len(meanings), "two letters say the same thing"


def test_no_file_defines_its_own_legend():
    own = sorted(name for name, text in sources() if name != "moepass/spec.py" and LEGEND_BLOCK.search(text))
    assert sorted(set(own) - PENDING) == [], (
        f"{sorted(set(own) - PENDING)} define their own shape legend: use moepass.spec.SHAPES's letters "
        f"(add a letter there, with one meaning, if none fits)")
    assert sorted(PENDING - set(own)) == [], f"{sorted(PENDING - set(own))} no longer have one: drop them from PENDING"


def test_every_shape_suffix_uses_the_legends_letters():
    unknown = {}
    for name, text in sources():
        for m in SUFFIX.finditer(text):
            letters = {ch for ch in m.group(1) if not ch.isdigit()} - set(SHAPES)
            if letters:
                line = text[: m.start()].count("\n") + 1
                unknown.setdefault(f"{name}:{line}", (m.group(0), sorted(letters)))
    assert not unknown, f"shape letters not in moepass.spec.SHAPES: {unknown}"


def test_the_checks_catch_a_legend_and_an_unknown_letter():
    assert LEGEND_BLOCK.search('"""Kernel.\n\nShape legend: T tokens, Q queries.\n"""')
    assert LEGEND_BLOCK.search("# Legend: W ranks") and LEGEND_BLOCK.search("Shapes: T tokens")
    assert not LEGEND_BLOCK.search("Shape letters: `moepass.spec.SHAPES` (here G = T*H sub-tokens)")
    assert not LEGEND_BLOCK.search('legend = pydot.Cluster("legend")')
    (suffix,) = SUFFIX.findall("x_TQ = y_TD")[:1]
    assert suffix == "TQ" and [m.group(1) for m in SUFFIX.finditer("ids_R1, E_PAD, x_Gh")] == ["R1", "Gh"]
