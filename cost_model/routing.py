"""The routing of a scenario case as a process over steps (`RoutingTrace`): what every plan of a case is priced
on (`cost_model.systems.price`), so a system and the search's plan of the same form see the same rows.

A recorded trace ([steps, source ranks, E]), recorded counts ([source ranks, E], static), a Zipf popularity
(given, or fitted to a max/mean figure at the case's EP degree) that drifts as AR(1) over steps, the hash
router's uniform routing, or the switch router's measured skew. Planners (FSEP's, FlexMoE's) see the steps
before the priced one, never the priced step.

Shape letters: `moepass.spec.SHAPES` (here a: history steps, P: source ranks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_model import ep as ep_formulas
from cost_model.scenarios import Case

# The switch router's per-device max/mean rows measured in this project's own training run
# (benchmarks/results/locality.json, by_data.iid.per_system.switch: top-1 learned gate with aux loss 0.01,
# E = 8 experts on 2 ranks, 200 steps, dropless: the median over steps of max/mean of the rows each rank
# computes, local + received). The same run kept every assignment (kept_fraction 1.0: no drops).
MEASURED_SWITCH_MAX_MEAN = 1.194
MEASURED_SWITCH_SHAPE = (8, 2)  # (experts, ranks) it was measured at
# Routing drift when the set-up gives skewed routing but no trace: each expert's log-popularity follows
# an AR(1) process around its Zipf value, z_{t+1} = rho z_t + sigma sqrt(1 - rho^2) eps (stationary std sigma).
# No published figure: assumed, stated in the output, overridable by routing.drift {"sigma", "rho"}.
DRIFT_SIGMA = 0.2
DRIFT_RHO = 0.9
DRIFT_SEED = 0
HISTORY = 5  # steps the FSEP / replication planners see (LAER's note's "5-step history"; the same for every system)



@dataclass(frozen=True)
class RoutingTrace:
    """[steps, W, E] routed rows (every source rank of the cluster), and the step priced: `current`;
    the steps before it are what a planner sees (`history`)."""

    steps_aWE: np.ndarray
    description: str

    @property
    def current(self) -> np.ndarray:
        return self.steps_aWE[-1]

    @property
    def history(self) -> np.ndarray:
        return self.steps_aWE[:-1]


def _drift_steps(base_E: np.ndarray, T: int, K: int, W: int, steps: int, sigma: float, rho: float,
                 seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    E = len(base_E)
    z = rng.standard_normal(E) * sigma
    out = np.empty((steps, W, E))
    for t in range(steps):
        p = base_E * np.exp(z)
        out[t] = np.tile(T * K * p / p.sum(), (W, 1))
        z = rho * z + sigma * math.sqrt(1 - rho**2) * rng.standard_normal(E)
    return out


def routing_trace(routing: dict[str, Any], case: Case, router: str, assumptions: list[str],
                  history: int = HISTORY) -> RoutingTrace:
    """The routed rows of `case` over `history` + 1 steps, from the set-up's routing: a recorded
    [src rank, expert] matrix (`counts`: static), else a Zipf popularity (`zipf_s`, or fitted to `max_mean` /
    the note's max/mean figure at the case's EP degree) that drifts (`DRIFT_*`, `routing.drift`); none given:
    uniform and static. `router` "hash": uniform whatever the set-up (hashing ignores the token's content);
    "switch" in a set-up without routing figures: the measured `MEASURED_SWITCH_MAX_MEAN`."""
    T, K, E, W = case.tokens, case.K, case.E, case.nodes * case.per_node
    steps = history + 1

    def note(text: str) -> None:
        if text not in assumptions:
            assumptions.append(text)

    def static(counts_WE: np.ndarray, text: str) -> RoutingTrace:
        return RoutingTrace(np.repeat(counts_WE[None], steps, axis=0), text)

    uniform = ep_formulas.zipf_counts(T, K, E, W, 0.0)
    if router == "hash":
        return static(uniform, "hash: uniform")
    if routing.get("trace") is not None:
        steps_aPE = np.asarray(routing["trace"], dtype=np.float64)
        steps_aPE = steps_aPE[None] if steps_aPE.ndim == 2 else steps_aPE
        if steps_aPE.ndim != 3 or steps_aPE.shape[-1] != E or (steps_aPE.sum(axis=2) <= 0).any():
            raise ValueError(f"routing trace of shape {steps_aPE.shape} is invalid for {case.label}: give routed rows "
                             f"[steps, source ranks, E={E}] (or [source ranks, E]), every row with some tokens")
        steps_aPE = steps_aPE * (T * K / steps_aPE.sum(axis=2, keepdims=True))  # rescaled to this case's tokens
        steps_aWE = steps_aPE[-steps:][:, np.arange(W) % steps_aPE.shape[1]]
        if len(steps_aWE) == 1:
            return static(steps_aWE[0], "recorded counts (one step: the planner sees it as its history)")
        note(f"routing: a recorded trace of {len(steps_aPE)} steps; the last priced, the {len(steps_aWE) - 1} before "
             f"it are the planners' history")
        return RoutingTrace(steps_aWE, f"recorded trace ({len(steps_aWE)} steps)")
    if routing.get("counts") is not None:
        counts = np.asarray(routing["counts"], dtype=np.float64)
        counts = counts * (T * K / counts.sum(axis=1, keepdims=True))  # rescaled to this case's tokens
        return static(counts[np.arange(W) % len(counts)], "recorded counts")
    s = routing.get("zipf_s")
    target = routing.get("max_mean")
    if s is None and target is None and routing.get("note"):
        found = re.search(r"max/mean[^0-9]*([0-9]+(?:\.[0-9]+)?)", routing["note"])
        target = float(found.group(1)) if found else None
    if s is None and target is None and router == "switch":
        e0, r0 = MEASURED_SWITCH_SHAPE
        s = ep_formulas.zipf_for_imbalance(MEASURED_SWITCH_MAX_MEAN, T, K, E, case.ep)
        note(f"learned top-1 routers (switch, LocMoE): Zipf popularity fitted per case to the max/mean "
             f"{MEASURED_SWITCH_MAX_MEAN} of rows per device measured in this project's training run "
             f"(benchmarks/results/locality.json: E={e0} on {r0} ranks, top-1, aux loss 0.01, no drops), at the "
             f"case's EP degree, static; the hash router uniform")
        return static(ep_formulas.zipf_counts(T, K, E, W, s), f"switch: measured max/mean {MEASURED_SWITCH_MAX_MEAN}")
    if s is None and target is None:
        note("routing not given: uniform (max/mean 1), static")
        return static(uniform, "uniform")
    if s is None and target is not None:
        s = ep_formulas.zipf_for_imbalance(float(target), T, K, E, case.ep)
        note(f"routing: Zipf s fitted to max/mean {target} at each case's EP degree (from the set-up's routing figure)")
    assert s is not None  # a figure was given: zipf_s, or max_mean fitted above
    drift = routing.get("drift") or {}
    sigma, rho = float(drift.get("sigma", DRIFT_SIGMA)), float(drift.get("rho", DRIFT_RHO))
    note(f"routing moves: each expert's log-popularity drifts as AR(1) around its Zipf value (std sigma={sigma:g}, "
         f"step correlation rho={rho:g}, seed {DRIFT_SEED}; assumed, routing.drift overrides); planners see the "
         f"{history} steps before the priced one, never the priced step")
    p = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** float(s)
    p = p[np.random.default_rng(0).permutation(E)]  # zipf_counts' placement of the popularity ranks
    return RoutingTrace(_drift_steps(p, T, K, W, steps, sigma, rho, DRIFT_SEED), f"Zipf s={float(s):.3g} drifting")
