"""The worker of `benchmarks/fsep.py` (issue 14): one torchrun launch of W ranks runs every scenario —
the systems (FSEP, FSEP keeping its restored experts, EP, FSDP2) stepped in interleaved rounds with the
compute floor, the collectives alone, a profile, loads, memory and parity. The module doc of fsep.py
defines each figure.

Shape legend: T tokens per rank, D model width, F expert hidden width, E experts, K top-k, W ranks,
C slots per device, S elements per expert, R expert rows.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import fx, nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.fsep_layer import POOL, W, make_block  # noqa: E402

SYSTEMS = ("fsep", "fsep_keep", "ep", "fsdp")  # order within a round (the floor follows)
LR = 1e-4

class Root(nn.Module):
    """A parameterless root for the FSDP system, so the block is a non-root FSDP unit (it reshards)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class System:
    """One system's module and optimizer; `step(x)` is one training step (phases timed on this rank)."""

    def __init__(self, name: str, state: dict, layer: dict, probe_TD: torch.Tensor):
        import moepass
        from moepass.rewrite.fsep import controllers

        self.name = name
        block = make_block(layer)
        block.load_state_dict(state)
        block.gate.weight.requires_grad_(False)
        topology = moepass.Topology(1, W)
        self.controller = None
        if name.startswith("fsep"):
            self.module = moepass.compile(block, moepass.Plan(form="fsep", topology=topology,
                                                              slots_per_device=layer["C"], planner="auto",
                                                              keep_restored=name == "fsep_keep"))
            (self.controller,) = controllers(self.module).values()
            self.controller.track_loads = name == "fsep"
        elif name == "ep":
            self.module = moepass.compile(block, moepass.Plan(form="ep", topology=topology))
        else:
            from torch.distributed.fsdp import fully_shard

            inner = moepass.compile(block, moepass.Plan(form="single", keep_original_if_slower=False))
            self.module = Root(inner)
            fully_shard(inner)  # reshard_after_forward=True: all-gathered again for the backward
            fully_shard(self.module)
        self.opt = torch.optim.Adam([p for p in self.module.parameters() if p.requires_grad], lr=LR)
        self.probe = probe_TD.unsqueeze(0)
        self.steps = 0
        self.losses: list[float] = []
        self.phases: list[tuple[float, float, float]] = []  # this rank's (forward, backward, optimizer) s

    def step(self, x: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        y = self.module(x)
        loss = (y * self.probe).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.steps += 1
        self.losses.append(loss.item())
        self.phases.append((t1 - t0, t2 - t1, t3 - t2))

    def expert_bytes(self) -> int:
        """Local bytes of the expert parameters (DTensor shards; the router is excluded)."""
        from torch.distributed.tensor import DTensor

        return sum(p.to_local().numel() * p.element_size() for n, p in self.module.named_parameters()
                   if isinstance(p, DTensor) and "gate.weight" not in n)


class Floor:
    """The six expert GEMMs of one SwiGLU forward+backward on R rows (`torch.mm(out=)`, preallocated)."""

    def __init__(self, rows: int, D: int, F: int):
        gen = torch.Generator().manual_seed(3)
        r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        self.x_RD, self.w_gu_DF2, self.w_d_FD = r(rows, D), r(D, 2 * F), r(F, D)
        self.a_RF, self.dy_RD, self.dh_RF2 = r(rows, F), r(rows, D), r(rows, 2 * F)
        self.h_RF2, self.y_RD, self.da_RF = torch.empty(rows, 2 * F), torch.empty(rows, D), torch.empty(rows, F)
        self.dwd_FD, self.dx_RD, self.dwgu_DF2 = torch.empty(F, D), torch.empty(rows, D), torch.empty(D, 2 * F)
        self.flops = 18 * rows * D * F

    def __call__(self) -> None:
        torch.mm(self.x_RD, self.w_gu_DF2, out=self.h_RF2)  # forward: gate and up
        torch.mm(self.a_RF, self.w_d_FD, out=self.y_RD)  # forward: down
        torch.mm(self.dy_RD, self.w_d_FD.t(), out=self.da_RF)  # backward: dA
        torch.mm(self.a_RF.t(), self.dy_RD, out=self.dwd_FD)  # dW_down
        torch.mm(self.dh_RF2, self.w_gu_DF2.t(), out=self.dx_RD)  # dX
        torch.mm(self.x_RD.t(), self.dh_RF2, out=self.dwgu_DF2)  # dW_gate_up


def restored_tensors(gm: fx.GraphModule, x: torch.Tensor) -> dict:
    """One eval forward through an fx.Interpreter: shapes of the `*_slots` nodes and their distinct bytes."""
    seen: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            value = super().run_node(n)
            if n.name.endswith("_slots") and isinstance(value, torch.Tensor):
                seen[n.name] = value
            return value

    gm.eval()  # the controller neither steps nor plans; the restore runs as in training
    with torch.no_grad():
        Recorder(gm).run(x)
    gm.train()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in seen.values()}
    return {"nodes": {n: list(t.shape) for n, t in seen.items()}, "bytes": sum(storages.values()),
            "storages": len(storages)}


def collectives(layer: dict, reps: int) -> dict:
    """The collectives of the three systems alone, at the run's sizes (median of `reps`, max over ranks)."""
    import torch.distributed as dist

    T, D, F, E, K, C = (layer[k] for k in ("T", "D", "F", "E", "K", "C"))
    S = 3 * D * F
    restore_send, restore_recv = torch.randn(W * C, S // W), torch.empty(W * C, S // W)
    shard, full = torch.randn(E * S // W), torch.empty(E * S)
    grad_full, grad_shard = torch.randn(E * S), torch.empty(E * S // W)
    tokens, tokens_out = torch.randn(T * K, D), torch.empty(T * K, D)
    ops = {
        "fsep_restore": (lambda: dist.all_to_all_single(restore_recv, restore_send), C * S // W * 4),
        "fsdp_all_gather": (lambda: dist.all_gather_into_tensor(full, shard), E * S // W * 4),
        "fsdp_reduce_scatter": (lambda: dist.reduce_scatter_tensor(grad_shard, grad_full), E * S // W * 4),
        "ep_dispatch": (lambda: dist.all_to_all_single(tokens_out, tokens), T * K * D // W * 4),
    }
    out = {}
    for name, (fn, sent) in ops.items():
        fn()
        t = statistics.median(common.timed_max(fn) for _ in range(reps))
        out[name] = {"ms": 1e3 * t, "bytes_to_each_peer": sent, "GB_per_s": sent / t / 1e9}
    return out


def profile(system: System, inputs, steps: int) -> dict:
    """Self CPU time per step on this rank over `steps` steps of `system`: the top ops by (name, input
    shapes), and totals of the GEMMs and of the collective waits by waited shape."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            x = inputs(system)
            common.timed_max(lambda: system.step(x))
    events = prof.key_averages(group_by_input_shape=True)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::bmm", "aten::addmm"))
    waits: dict[str, float] = {}
    for e in events:
        if e.key == "_c10d_functional::wait_tensor":
            waits[str(e.input_shapes)] = waits.get(str(e.input_shapes), 0.0) + e.self_cpu_time_total / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:16]
    return {"step_self_ms": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
            "gemm_self_ms": gemm / 1e3 / steps, "wait_self_ms_by_shape": waits,
            "top": [{"op": e.key, "shapes": str(e.input_shapes), "self_ms": e.self_cpu_time_total / 1e3 / steps,
                     "calls": e.count / steps} for e in top]}


def run_scenario(name: str, data: dict, args, rank: int) -> dict:
    import torch.distributed as dist

    layer = data["layer"]
    T, D, F, E, K, C = (layer[k] for k in ("T", "D", "F", "E", "K", "C"))
    load_before = os.getloadavg()[0]
    pool_NTD = data["pool"][:, rank]
    systems = {s: System(s, data["states"][name], layer, data["probe"][rank]) for s in SYSTEMS}
    fsep = systems["fsep"]

    def inputs(system: System) -> torch.Tensor:
        return pool_NTD[system.steps % POOL].unsqueeze(0).clone().requires_grad_(True)

    def run(system: System) -> float:
        x = inputs(system)
        return common.timed_max(lambda: system.step(x))

    for _ in range(args.warmup):
        for system in systems.values():
            run(system)
    warm = fsep.steps
    # rows of the most-loaded device since the planner's table settled (the last warm-up steps)
    settled = [r for r in fsep.controller.loads if r["step"] > warm // 2] or fsep.controller.loads
    max_rows = {k: int(statistics.median(max(r[k]) for r in settled)) for k in ("ep", "fsep")}
    floors = {"balanced": Floor(T * K, D, F), "ep_max_rows": Floor(max_rows["ep"], D, F),
              "fsep_max_rows": Floor(max_rows["fsep"], D, F)}
    times: dict[str, list[list[float]]] = {k: [] for k in [*SYSTEMS, *(f"floor_{f}" for f in floors)]}
    for _ in range(args.rounds):
        for s, system in systems.items():
            times[s].append([run(system) for _ in range(args.steps)])
        for f, floor in floors.items():
            times[f"floor_{f}"].append([common.timed_max(floor) for _ in range(args.steps)])
    timed_steps = (warm + 1, fsep.steps)  # FSEP controller steps of the timed rounds (1-based)
    prof = {s: profile(system, inputs, args.profile_steps) for s, system in systems.items()} \
        if args.profile_steps else {}
    comms = collectives(layer, args.comm_reps)
    memory = {"fsep_local_expert_bytes": fsep.expert_bytes(),
              "ep_local_expert_bytes": systems["ep"].expert_bytes(),
              "fsdp_local_expert_bytes": systems["fsdp"].expert_bytes(),
              "fsep_restored": restored_tensors(fsep.module, inputs(fsep).detach())}
    deadline = time.perf_counter() + 5.0  # the planner thread records the last step's loads
    while len(fsep.controller.loads) < fsep.controller.step and time.perf_counter() < deadline:
        time.sleep(0.01)
    counts_WE = fsep.controller.history.total()
    per_rank = {"phases": {s: system.phases for s, system in systems.items()}, "profile": prof,
                "memory": memory, "losses": {s: system.losses for s, system in systems.items()}}
    gathered: list = [None] * W
    dist.all_gather_object(gathered, per_rank)
    c = fsep.controller
    decisions = [{"step": d.step, "source": d.source, "table": list(d.table), "wait_ms": 1e3 * d.wait_s,
                  "solve_ms": 1e3 * d.solve_s} for d in c.decisions]
    result = {
        "times_s": times, "floor_rows": {"balanced": T * K, **{f"{k}_max_rows": v for k, v in max_rows.items()}},
        "floor_flops": {f: floor.flops for f, floor in floors.items()},
        "timed_fsep_steps": list(timed_steps), "warmup_steps": warm,
        "loads": c.loads, "decisions": decisions, "planner_config": {k: getattr(c.config, k) for k in (
            "E", "W", "C", "ranks_per_node", "history", "bytes_per_token", "time_per_token", "intra_bw", "inter_bw",
            "recompute")},
        "run_counts_last_5_steps": counts_WE.tolist(),
        "collectives": comms, "ranks": gathered,
        "load1_before": load_before, "load1_after": os.getloadavg()[0],
    }
    del systems, fsep
    return result


def worker(args) -> int:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a C++ abort dumps every thread's Python stack to stderr
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == W
    rank = dist.get_rank()
    data = torch.load(args.data, weights_only=False)
    out = {"threads": torch.get_num_threads(), "scenarios": {}}
    for name in args.scenarios:
        t = time.perf_counter()
        out["scenarios"][name] = run_scenario(name, data, args, rank)
        out["scenarios"][name]["wall_s"] = time.perf_counter() - t
        print(f"[fsep rank {rank}] scenario {name} done", file=sys.stderr, flush=True)
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    print("[fsep] worker finished", file=sys.stderr, flush=True)
    return 0
