"""Errors moepass raises for bad input.

Every message names *where* (a field or module path), *what* (the value) and *how to fix it*.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MoepassError(ValueError):
    """Base class of moepass's input errors."""


class PlanError(MoepassError):
    """A `Plan` (or a spec it is applied to) holds an impossible or unknown value."""


class DetectionError(MoepassError):
    """A module could not be turned into an `MoESpec`."""


def nearest(value: object, choices: Iterable[str]) -> str:
    """`" Did you mean 'x'?"` for the closest valid name (letter case aside), or "" when nothing is close."""
    by_case = {str(c).lower(): c for c in choices}
    match = difflib.get_close_matches(str(value).lower(), list(by_case), n=1, cutoff=0.5)
    return f" Did you mean {by_case[match[0]]!r}?" if match else ""


def bad_value(field: str, value: object, fix: str, cls: type[MoepassError] = PlanError) -> MoepassError:
    """Build the standard error: `<field>=<value!r> is invalid: <fix>`."""
    return cls(f"{field}={value!r} is invalid: {fix}")
