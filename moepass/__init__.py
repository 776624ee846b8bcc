"""moepass: detect the MoE blocks of a PyTorch model, rewrite each into a parallel form, schedule its
all-to-all traffic and lower the hot regions to generated Triton kernels.

    report = moepass.detect(model)
    cm = moepass.compile(model, moepass.Plan(form="single"))
    print(moepass.explain(model, plan))
"""

from moepass import dialect  # noqa: F401  (registers the moe:: ops)
from moepass.api import CompileInfo, compile, explain
from moepass.canonical import MoEGraphModule
from moepass.detect import DetectionReport, detect, register_recogniser
from moepass.errors import DetectionError, MoepassError, PlanError
from moepass.plan import Plan
from moepass.spec import CapacitySpec, ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, TensorSource
from moepass.verify import VerificationError, verify

__all__ = [
    "CapacitySpec", "CompileInfo", "DetectionError", "DetectionReport", "ExpertsSpec", "MoEGraphModule",
    "MoESpec", "MoepassError", "Plan", "PlanError", "RouterSpec", "SharedExpertSpec", "TensorSource",
    "VerificationError", "compile", "detect", "explain", "register_recogniser", "verify",
]
__version__ = "0.1.0"
