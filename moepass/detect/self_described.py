"""Recogniser: blocks that describe themselves, with a `moepass_spec(path) -> MoESpec` method.

The protocol any user module may implement ("I am an MoE block, here is my spec"): detection takes
the spec as the one hypothesis and, like every other recogniser's, the semantic check must reproduce
the block's forward with it (selection, outputs, train-mode behaviour and buffer updates) before it
is accepted. A spec that lies is rejected with the reason; a method that raises, or returns anything
but an MoESpec for this path, is a decline. Nothing here reads class names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

from moepass.detect.candidates import SELF_DESCRIBED, SPEC_METHOD, Candidate
from moepass.spec import MoESpec

NAME = "self-described"


@runtime_checkable
class DescribesMoE(Protocol):
    """A module that says what MoE block it is: `moepass_spec(path)` returns its MoESpec, whose weight
    sources are relative to the module itself and whose `path` is the `path` given."""

    def moepass_spec(self, path: str) -> MoESpec: ...


def recognise(c: Candidate) -> list[MoESpec] | str:
    if c.experts_kind != SELF_DESCRIBED:
        return f"the block has no {SPEC_METHOD}(path) method"
    try:
        spec = getattr(c.module, SPEC_METHOD)(c.path)
    except Exception as err:  # the user's description itself fails: decline with why, never raise
        return f"{SPEC_METHOD}({c.path!r}) raised {type(err).__name__}: {err}"
    if not isinstance(spec, MoESpec):
        return f"{SPEC_METHOD}({c.path!r}) returned {type(spec).__name__}, not a moepass.MoESpec"
    if spec.path != c.path:
        return f"{SPEC_METHOD}({c.path!r}) returned a spec for path {spec.path!r}; it must describe the block at {c.path!r}"
    return [replace(spec, recogniser=NAME)]
