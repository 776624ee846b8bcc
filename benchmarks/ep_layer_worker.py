"""The worker of `benchmarks/ep_layer.py` (issues 12, 32): one launch of one system at one W (a fresh process or
a torchrun group) times every workload's forward and forward+backward, interleaved with the compute floor, and
writes its result file; the `peers@W2` launch times every W=2 system in one process group. The launch table, the
workloads and the floor's FLOPs live here too, read by the orchestrator. The module doc of ep_layer.py defines
each figure.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common, ep_peers  # noqa: E402
from benchmarks.ep_step import Runner, package_version  # noqa: E402

# ep_step's Runner shards the global batch of W_MAX x `batch` sequences over its W_MAX ranks
W_MAX = 2
PEERS_KEY = "peers@W2"
# launch keys in interleaving order: (system, W) -> the ep_step Runner system that builds it
LAUNCHES = {
    "moepass@W1": ("moepass", 1, "moepass_single"),
    "original@W1": ("original", 1, "original_1t"),
    "moepass@W2": ("moepass", 2, "moepass_ep"),
    "transformers_ep@W2": ("transformers_ep", 2, "transformers_ep"),
    # every W=2 system in one process group, interleaved step by step (issue 32: the headline ratio)
    PEERS_KEY: ("peers", 2, "peers"),
}
WORKLOADS = {
    # batch: sequences per rank at W=2 (the global batch is 2 x batch); tokens = 2 x batch x seq
    "issue": dict(hidden=256, intermediate=512, experts=8, top_k=2, batch=1, seq=256, steps=20),
    "mixtral_proxy": dict(hidden=512, intermediate=1792, experts=8, top_k=2, batch=1, seq=512, steps=10),
}
PHASES = ("fwd", "fwd_bwd")


def tokens(shape: dict) -> int:
    return W_MAX * shape["batch"] * shape["seq"]


def floor_flops(shape: dict, world: int) -> dict[str, float]:
    """FLOPs of one rank's expert GEMMs per step under an even load: 3 GEMMs of 2 x rows x D x F forward,
    3x that for forward+backward."""
    rows = tokens(shape) * shape["top_k"] // world
    fwd = 3 * 2 * rows * shape["hidden"] * shape["intermediate"]
    return {"rows": rows, "fwd": fwd, "fwd_bwd": 3 * fwd}


# ----------------------------------------------------------------------------------------------
# Worker: one launch of one system at one W
# ----------------------------------------------------------------------------------------------


class LayerRunner(Runner):
    """ep_step's layer Runner plus moepass's single form, a fixed probe, and separate fwd / fwd+bwd."""

    def __init__(self, system: str, workload: str, path: str, shape: dict, rank: int, world: int):
        import torch

        super().__init__(system, "layer", path, shape, rank, world)
        self.name = workload
        gen = torch.Generator().manual_seed(2)
        probe = torch.randn(W_MAX * shape["batch"], shape["seq"], shape["hidden"], generator=gen)
        if world > 1:
            probe = probe[rank * shape["batch"]:(rank + 1) * shape["batch"]]
        self.probe = probe.contiguous()
        assert self.probe.shape == self.x.shape, (self.probe.shape, self.x.shape)
        if system == "moepass_single":
            self.info["moepass_rewritten"] = sorted(self.compiled.moepass_info.rewritten)

    def _build(self, path: str):
        if self.system != "moepass_single":
            return super()._build(path)
        from transformers import MixtralForCausalLM

        import moepass

        model = MixtralForCausalLM.from_pretrained(path)
        model.train()
        self.compiled = moepass.compile(model.model.layers[0].mlp, moepass.Plan(form="single"))
        return self.compiled

    def _run(self):
        x = self.x.detach().requires_grad_(True)
        y = self.module(x)
        return x, (y[0] if isinstance(y, tuple) else y)

    def forward(self) -> None:
        self._run()

    def fwd_bwd(self):
        for p in self.params:
            p.grad = None
        x, y = self._run()
        loss = (y * self.probe).sum()
        loss.backward()
        return x, y, loss

    def parity(self) -> dict[str, float]:
        """This rank's loss, sum(y^2), sum(dx^2) and sum(grad^2) of each parameter's local tensor, after one
        forward+backward (float64; the caller sums them over the ranks)."""
        import torch
        from torch.distributed.tensor import DTensor

        x, y, loss = self.fwd_bwd()
        with torch.no_grad():
            out = {"loss": loss.double().item(), "y_sumsq": y.double().pow(2).sum().item(),
                   "dx_sumsq": x.grad.double().pow(2).sum().item()}
            inner = getattr(self.module, "module", self.module)  # DDP
            for name, p in sorted(inner.named_parameters()):
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                out[f"grad_sumsq:{name}"] = float("nan") if g is None else g.double().pow(2).sum().item()
                out[f"numel:{name}"] = float(p.to_local().numel() if isinstance(p, DTensor) else p.numel())
            return out


class Floor:
    """Plain torch.mm calls with the FLOPs of one rank's expert GEMMs (preallocated output)."""

    def __init__(self, shape: dict, world: int):
        import torch

        f = floor_flops(shape, world)
        rows, d, n = f["rows"], shape["hidden"], 3 * shape["intermediate"]
        gen = torch.Generator().manual_seed(3)
        self.b = torch.randn(d, n, generator=gen)
        self.a = torch.randn(rows, d, generator=gen)
        self.c = torch.empty(rows, n)
        self.a3 = torch.randn(3 * rows, d, generator=gen)
        self.c3 = torch.empty(3 * rows, n)
        self.flops = f
        self.shapes = {"fwd": f"[{rows}, {d}] x [{d}, {n}]", "fwd_bwd": f"[{3 * rows}, {d}] x [{d}, {n}]"}

    def fwd(self) -> None:
        import torch

        torch.mm(self.a, self.b, out=self.c)

    def fwd_bwd(self) -> None:
        import torch

        torch.mm(self.a3, self.b, out=self.c3)


class GroupedFloor:
    """The step's expert GEMMs alone, under an even load: the 6 grouped GEMMs of a gated expert FFN with gate and
    up fused ([E, 2F, D], as HF stores them) — forward gate_up and down, backward the two input gradients and the
    two weight gradients —, `torch._grouped_mm` on precomputed operands (no routing, no elementwise work, hot
    caches), over a rank's E/W local experts with rows/(E/W) rows each, as EP lays them out. The FLOPs equal `Floor.fwd_bwd`'s; the time is what this machine's GEMMs take at the step's
    per-expert shapes: no implementation built on them can beat it, so system/grouped_floor is the overhead
    above the GEMMs and grouped_floor/floor the shape penalty of rows/E-row GEMMs against one large one."""

    def __init__(self, shape: dict, world: int):
        import torch

        f = floor_flops(shape, world)
        rows, d, ffn = f["rows"], shape["hidden"], shape["intermediate"]
        experts = shape["experts"] // world  # a rank's local experts under EP (all of them at W=1)
        gen = torch.Generator().manual_seed(4)
        self.x = torch.randn(rows, d, generator=gen)
        self.dy = torch.randn(rows, d, generator=gen)
        self.act = torch.randn(rows, ffn, generator=gen)
        self.d_gate_up = torch.randn(rows, 2 * ffn, generator=gen)
        self.w_gate_up = torch.randn(experts, 2 * ffn, d, generator=gen)
        self.w_down = torch.randn(experts, d, ffn, generator=gen)
        per = rows // experts
        self.offs = torch.tensor([per * (e + 1) for e in range(experts - 1)] + [rows], dtype=torch.int32)

    def fwd_bwd(self) -> None:
        import torch

        mm, offs = torch._grouped_mm, self.offs
        mm(self.x, self.w_gate_up.transpose(1, 2), offs=offs)  # gate/up [rows, 2F]
        mm(self.act, self.w_down.transpose(1, 2), offs=offs)  # down [rows, D]
        mm(self.dy, self.w_down, offs=offs)  # d act [rows, F]
        mm(self.dy.t(), self.act, offs=offs)  # d w_down [E, D, F]
        mm(self.d_gate_up, self.w_gate_up, offs=offs)  # d x [rows, D]
        mm(self.d_gate_up.t(), self.x, offs=offs)  # d w_gate_up [E, 2F, D]


def worker(args) -> int:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a C++ abort (SIGABRT) then dumps every thread's Python stack to stderr
    torch.set_num_threads(1)
    name, world, runner_system = LAUNCHES[args.worker]
    if world > 1:
        dist.init_process_group("gloo")
        assert dist.get_world_size() == world
    rank = dist.get_rank() if world > 1 else 0
    paths = json.loads(args.paths)
    if args.worker == PEERS_KEY:
        return peers_worker(args, paths, rank, world)

    def timed(fn) -> float:
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        if world > 1:
            mx = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            elapsed = mx.item()
        return elapsed

    out: dict = {"key": args.worker, "system": name, "world": world, "threads": torch.get_num_threads(),
                 "workloads": {}}
    for workload in args.workloads:
        shape = WORKLOADS[workload]
        t_build = time.perf_counter()
        runner = LayerRunner(runner_system, workload, paths[workload], shape, rank, world)
        build_s = time.perf_counter() - t_build
        floor, grouped = Floor(shape, world), GroupedFloor(shape, world)
        par = runner.parity()
        if world > 1:  # every rank has the same parameter names
            summed = torch.tensor(list(par.values()), dtype=torch.float64)
            dist.all_reduce(summed)
            par = dict(zip(par, summed.tolist()))
        fns = {"fwd": runner.forward, "fwd_bwd": runner.fwd_bwd, "floor_fwd": floor.fwd,
               "floor_fwd_bwd": floor.fwd_bwd, "grouped_floor_fwd_bwd": grouped.fwd_bwd}
        times: dict[str, list[float]] = {k: [] for k in fns}
        steps = args.steps or shape["steps"]
        for i in range(args.warmup + steps):
            for k, fn in fns.items():
                elapsed = timed(fn)
                if i >= args.warmup:
                    times[k].append(elapsed)
            print(f"[ep_layer rank {rank}] {args.worker} {workload} iteration {i} done", file=sys.stderr, flush=True)
        out["workloads"][workload] = {
            "step_s": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "parity": par, "build_s": build_s,
            "floor_shapes": floor.shapes, "floor_flops": floor.flops, **runner.info}
        del runner, floor, grouped
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print(f"[ep_layer] {args.worker} worker finished", file=sys.stderr, flush=True)
    return 0


def peers_worker(args, paths: dict, rank: int, world: int) -> int:
    """One launch of every W=2 system in one process group (`PEER_SYSTEMS`), timed forward+backward step by
    step in rotating order (iteration i starts with system i mod n), so load changes hit them alike."""
    import torch
    import torch.distributed as dist
    from transformers import MixtralForCausalLM

    out: dict = {"key": args.worker, "system": "peers", "world": world, "threads": torch.get_num_threads(),
                 "workloads": {}}
    for workload in args.workloads:
        shape = WORKLOADS[workload]
        model = MixtralForCausalLM.from_pretrained(paths[workload])
        model.train()
        block = model.model.layers[0].mlp
        modules = {name: ep_peers.build(name, block, world) for name in ("moepass", *ep_peers.PEERS)}
        if package_version("accelerate"):  # transformers' DistributedConfig path needs it
            modules["transformers_ep"] = LayerRunner("transformers_ep", workload, paths[workload], shape, rank,
                                                     world).module  # issue 12's documented configuration (FSDP)
        else:
            out["skipped"] = {"transformers_ep": "accelerate is not installed (from_pretrained(distributed_config=...) "
                                                "needs it)"}
        mine = slice(rank * shape["batch"], (rank + 1) * shape["batch"])  # this rank's sequences, as LayerRunner's
        x = torch.randn(W_MAX * shape["batch"], shape["seq"], shape["hidden"],
                        generator=torch.Generator().manual_seed(1))[mine].contiguous()
        probe = torch.randn(W_MAX * shape["batch"], shape["seq"], shape["hidden"],
                            generator=torch.Generator().manual_seed(2))[mine].contiguous()

        def step(module) -> tuple:
            for p in module.parameters():
                p.grad = None
            xi = x.detach().requires_grad_(True)
            y = module(xi)
            y = y[0] if isinstance(y, tuple) else y
            loss = (y * probe).sum()
            loss.backward()
            return loss.detach(), xi.grad

        parity = {}
        for name, module in modules.items():
            loss, dx = step(module)
            both = torch.stack([loss.double(), dx.double().pow(2).sum()])
            dist.all_reduce(both)
            parity[name] = {"loss": both[0].item(), "dx_sumsq": both[1].item()}
        names = list(modules)
        times: dict[str, list[float]] = {n: [] for n in names}
        steps = args.steps or shape["steps"]
        for i in range(args.warmup + steps):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                elapsed = common.timed_max(lambda m=modules[name]: step(m))
                if i >= args.warmup:
                    times[name].append(elapsed)
            print(f"[ep_layer rank {rank}] peers {workload} iteration {i} done", file=sys.stderr, flush=True)
        out["workloads"][workload] = {"step_s": times, "median_s": {n: statistics.median(v) for n, v in times.items()},
                                      "parity": parity}
        del modules
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    print(f"[ep_layer] {args.worker} worker finished", file=sys.stderr, flush=True)
    return 0


PEER_SYSTEMS = ("moepass", "transformers_a2a", "torchtitan_ep", "transformers_ep")
