"""moepass: detect the MoE blocks of a PyTorch model, rewrite each into a parallel form, schedule its
all-to-all traffic and lower the hot regions to generated Triton kernels.

    report = moepass.detect(model)
    cm = moepass.compile(model, moepass.Plan(form="single"))
    print(moepass.explain(model, plan))
    torch.compile(model, backend="moepass")
"""

# Imported for their registrations with torch: the moe:: ops and the torch.compile backend. The
# passes need none: moepass/pipeline.py imports and orders them.
from cost_model.search import search  # moepass.search: ranked plans from the cost model
from moepass import (
    backend,  # noqa: F401  (the torch.compile backend "moepass")
    dialect,  # noqa: F401  (the moe:: ops)
)
from moepass.api import compile, explain
from moepass.canonical import MoEGraphModule
from moepass.checkpoint import load_logical_state_dict, logical_grads, logical_state_dict
from moepass.detect import DetectionReport, detect, register_recogniser
from moepass.errors import DetectionError, MoepassError, PlanError
from moepass.fsdp import fully_shard
from moepass.inspect import diff, draw, set_debug
from moepass.pipeline import CompileInfo
from moepass.plan import Plan
from moepass.runtime import DataParallel, GradientSync, Topology, comm_stats, reset_comm_stats
from moepass.runtime.grads import clip_grad_norm_
from moepass.runtime.locality import aux_loss
from moepass.spec import CapacitySpec, ExpertsSpec, HeadsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource
from moepass.verify import VerificationError, verify

__all__ = [
    "CapacitySpec", "CompileInfo", "DataParallel", "DetectionError", "DetectionReport", "ExpertsSpec", "GradientSync",
    "HeadsSpec", "MoEGraphModule", "MoESpec", "MoepassError", "Plan", "PlanError", "RouterSpec", "SharedExpertSpec",
    "TensorSource", "Topology", "VerificationError", "aux_loss", "clip_grad_norm_", "comm_stats", "compile", "detect",
    "diff", "draw", "explain", "fully_shard", "load_logical_state_dict", "logical_grads", "logical_state_dict",
    "register_recogniser", "reset_comm_stats", "search", "set_debug", "verify",
]
__version__ = "0.1.0"
