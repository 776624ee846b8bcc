"""moepass: detect the MoE blocks of a PyTorch model, rewrite each into a parallel form, schedule its
all-to-all traffic and lower the hot regions to generated Triton kernels.

    report = moepass.detect(model)
    cm = moepass.compile(model, moepass.Plan(form="single"))
    print(moepass.explain(model, plan))
    torch.compile(model, backend="moepass")
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

# Imported for its registrations with torch: the moe:: ops (a graph that holds them needs them registered).
from moepass import dialect  # noqa: F401

# Named like their modules: imported now, so that `moepass.detect` is the function whichever import loads the
# module (Python binds a submodule to its package's attribute when it loads it).
from moepass.detect import detect
from moepass.verify import verify

# The public names, each imported from its module when first read (PEP 562): `import moepass.runtime.placement`
# (the cost-model CLI's planner) then costs the planner's imports, not the passes', the backend's and Dynamo's.
_PUBLIC = {
    "search": "cost_model.search",
    "compile": "moepass.api", "explain": "moepass.api",
    "MoEGraphModule": "moepass.canonical",
    "load_logical_state_dict": "moepass.checkpoint", "logical_grads": "moepass.checkpoint",
    "logical_state_dict": "moepass.checkpoint",
    "DetectionReport": "moepass.detect", "register_recogniser": "moepass.detect",
    "DetectionError": "moepass.errors", "MoepassError": "moepass.errors", "PlanError": "moepass.errors",
    "fully_shard": "moepass.fsdp",
    "diff": "moepass.inspect", "draw": "moepass.inspect", "set_debug": "moepass.inspect",
    "CompileInfo": "moepass.pipeline",
    "Plan": "moepass.plan",
    "DataParallel": "moepass.runtime", "GradientSync": "moepass.runtime", "Topology": "moepass.runtime",
    "comm_stats": "moepass.runtime", "reset_comm_stats": "moepass.runtime",
    "clip_grad_norm_": "moepass.runtime.grads",
    "aux_loss": "moepass.runtime.locality",
    "CapacitySpec": "moepass.spec", "ExpertsSpec": "moepass.spec", "HeadsSpec": "moepass.spec",
    "MoESpec": "moepass.spec", "RouterSpec": "moepass.spec", "SharedExpertSpec": "moepass.spec",
    "TensorSource": "moepass.spec",
    "VerificationError": "moepass.verify",
}
__all__ = [
    "CapacitySpec", "CompileInfo", "DataParallel", "DetectionError", "DetectionReport", "ExpertsSpec", "GradientSync",
    "HeadsSpec", "MoEGraphModule", "MoESpec", "MoepassError", "Plan", "PlanError", "RouterSpec", "SharedExpertSpec",
    "TensorSource", "Topology", "VerificationError", "aux_loss", "clip_grad_norm_", "comm_stats", "compile", "detect",
    "diff", "draw", "explain", "fully_shard", "load_logical_state_dict", "logical_grads", "logical_state_dict",
    "register_recogniser", "reset_comm_stats", "search", "set_debug", "verify",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # read once: later reads are plain attribute reads
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule not imported yet
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'moepass' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


# The torch.compile backend "moepass": an installed moepass (`pip install -e .`, the README's way) declares it as a
# `torch_dynamo_backends` entry point, which torch.compile loads when it first looks a backend name up; from a
# source tree on PYTHONPATH (no entry point) it is registered now, which imports Dynamo (~0.8 s).
if not any(ep.name == "moepass" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")):
    from moepass import backend  # noqa: F401

if TYPE_CHECKING:  # the names above, for type checkers and editors
    from cost_model.search import search
    from moepass.api import compile, explain
    from moepass.canonical import MoEGraphModule
    from moepass.checkpoint import load_logical_state_dict, logical_grads, logical_state_dict
    from moepass.detect import DetectionReport, register_recogniser
    from moepass.errors import DetectionError, MoepassError, PlanError
    from moepass.fsdp import fully_shard
    from moepass.inspect import diff, draw, set_debug
    from moepass.pipeline import CompileInfo
    from moepass.plan import Plan
    from moepass.runtime import DataParallel, GradientSync, Topology, comm_stats, reset_comm_stats
    from moepass.runtime.grads import clip_grad_norm_
    from moepass.runtime.locality import aux_loss
    from moepass.spec import CapacitySpec, ExpertsSpec, HeadsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource
    from moepass.verify import VerificationError
