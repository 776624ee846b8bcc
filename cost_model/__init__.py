"""cost_model: the symbolic cost model, plan search, calibration and cluster simulator of moepass.

symbols    one table of sympy symbols with assumptions
ep         EP formulas: compute, all-to-all bytes (uniform and exact), memory
fsep       FSEP formulas: the placement planner's step cost, the restore all_to_all, parameter memory
hp         head-parallel formulas: the two equal-split token exchanges (flat in top-k), projections, memory
locality   LocMoE: the capacity floor (Theorem 1) and the intra/inter-node byte split of top-1 routing as a
           function of the locality ratio, per router (hash, switch, LocMoE)
schedule   Lina's chunked / prioritised pipeline time as a function of the chunk count
presets    hardware figures with their sources; `this_machine()` reads a calibration profile;
           `resolve_hardware()` turns Plan.hardware / search(profile=) into figures
scenarios  published set-ups (shared/scenarios) read into cases; imported by search and simulate
search     ranked plans with a cost breakdown and the winner's formula
calibrate  gloo all-to-all and matmul microbenchmarks -> JSON profile
timeline   per-step compute / all-to-all / other-communication streams
simulate   published set-ups (shared/scenarios) -> predicted step time per compared system (EP, FSDP+EP,
           FSEP with the planner of moepass.runtime.placement, HP, and hash / switch / LocMoE routers)

Entry points: `cost_model.search.search`, `cost_model.simulate.simulate`, `cost_model.calibrate.main`
(not re-exported here: the functions would shadow their modules).
"""
