"""The one parser for moepass's boolean environment flags (`MOEPASS_VERIFY`, `MOEPASS_DEBUG`, ...).

    flag("MOEPASS_VERIFY")  # -> bool

Unset, "", "0", "false", "no" and "off" mean off; "1", "true", "yes" and "on" mean on (any case,
surrounding spaces ignored). Anything else raises `ValueError` naming the variable, its value and
the accepted values: a typo never silently turns a flag on (or off).
"""

from __future__ import annotations

import os

OFF = ("", "0", "false", "no", "off")
ON = ("1", "true", "yes", "on")

# Every boolean flag moepass reads, with what it does (docs/ARCHITECTURE.md lists the same).
FLAGS = {
    "MOEPASS_VERIFY": "run the verifier after every pass (the test suite sets it)",
    "MOEPASS_DEBUG": "log every pass and backend decision to stderr from import on (see moepass.set_debug)",
    "MOEPASS_CHECK_COLLECTIVES": "every collective first checks that all ranks agree on its arguments",
    "MOEPASS_ALWAYS_REWRITE": "form='single' always runs its rewritten graph, never timing it against the user's "
                              "block (moepass.runtime.faster; the test suite sets it)",
    "MOEPASS_PLAIN_TRITON_LAUNCH": "launch every Triton kernel through Triton's own path (no cached direct launch, "
                                   "lowering/launcher.py); read when a kernel is first launched",
}


def parse(name: str, value: str | None) -> bool:
    """`value` of environment variable `name` as a flag (None: unset, off)."""
    if value is None:
        return False
    word = value.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise ValueError(f"environment variable {name}={value!r} is not a valid flag: use one of {list(ON)} for on, "
                     f"or one of {list(OFF)} (or leave it unset) for off")


def flag(name: str) -> bool:
    """The boolean environment flag `name`, read now (see the module doc for the accepted values)."""
    return parse(name, os.environ.get(name))


__all__ = ["FLAGS", "OFF", "ON", "flag", "parse"]
