"""Runtime: topology and process groups, issue/wait collectives, communication counters, gradients."""

from moepass.runtime.grad_sync import DataParallel, GradientSync
from moepass.runtime.stats import comm_stats, reset_comm_stats
from moepass.runtime.topology import Topology

__all__ = ["DataParallel", "GradientSync", "Topology", "comm_stats", "reset_comm_stats"]
