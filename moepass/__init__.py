"""moepass: detect the MoE blocks of a PyTorch model, rewrite each into a parallel form, schedule its
all-to-all traffic and lower the hot regions to generated Triton kernels.

    report = moepass.detect(model)
    cm = moepass.compile(model, moepass.Plan(form="single"))
    print(moepass.explain(model, plan))
"""

from moepass import dialect  # noqa: F401  (registers the moe:: ops)
from moepass import lower  # noqa: F401  (registers the lower pass into pipeline.LOWER)
from moepass import rewrite  # noqa: F401  (registers the parallel forms into pipeline.REWRITES)
from moepass.api import CompileInfo, compile, explain
from moepass.canonical import MoEGraphModule
from moepass.checkpoint import load_logical_state_dict, logical_state_dict
from moepass.detect import DetectionReport, detect, register_recogniser
from moepass.errors import DetectionError, MoepassError, PlanError
from moepass.plan import Plan
from moepass.runtime import Topology, comm_stats, reset_comm_stats
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource
from moepass.verify import VerificationError, verify
from cost_model.search import search  # noqa: E402  (moepass.search: ranked plans from the cost model)

__all__ = [
    "CapacitySpec", "CompileInfo", "DetectionError", "DetectionReport", "ExpertsSpec", "MoEGraphModule",
    "MoESpec", "MoepassError", "Plan", "PlanError", "RouterSpec", "SharedExpertSpec", "TensorSource",
    "Topology", "VerificationError", "comm_stats", "compile", "detect", "explain", "load_logical_state_dict",
    "logical_state_dict", "register_recogniser", "reset_comm_stats", "search", "verify",
]
__version__ = "0.1.0"
