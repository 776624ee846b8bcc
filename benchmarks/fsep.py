"""FSEP vs EP vs FSDP at W=2: load balance under skewed routing, training-step time, parameter memory (issue 14).

    .venv/bin/python benchmarks/fsep.py                  # full run (~25 min here, plus --wait-load)
    .venv/bin/python benchmarks/fsep.py --quick          # smoke run (< 1 min): a small layer (T=128, D=128,
                                                         # F=256), 2 timed steps; JSON + plot to the temp dir
    .venv/bin/python benchmarks/fsep.py --wait-load 1.0  # first wait for the shared cores to quieten down

Writes benchmarks/results/fsep.json and fsep_load.png (unless --out; the plot goes next to the JSON as
<name>_load.png) and prints tables.

The layer. One Hugging Face `MixtralSparseMoeBlock` (fused gate/up experts, SwiGLU, softmax top-K
router, dropless), fp32, D=256, F=512, E=8, K=2 (issue 12's layer), at W=2 gloo ranks x 1 thread (this
machine's 2 cores), with T = 8192 tokens per rank (the headline) and T = 2048, one launch each
(`--tokens`). Why so many: FSEP's restore brings C*S*b bytes of weights to every device each layer
whatever T is, while a device's forward expert GEMMs do 6*T*K*D*F FLOPs on average, so the FLOPs per
restored byte grow with T: 51 at T=512, 205 at T=2048, 820 at T=8192, ~33000 in the paper's setup (32k
tokens per GPU, K=2, C=2, bf16). This machine does ~55 GFLOP/s per core and a restore all_to_all runs at
0.6-0.85 GB/s on gloo loopback (both measured in the run: `floor`, `collectives`), ~80 FLOPs per byte,
and gloo's transfers run on the same core as the rank's GEMMs (one core per rank), so nothing overlaps
here: every restored byte is paid in full. At T=512 the restore alone costs more than the forward expert
GEMMs; at T=2048 they cost ~2.5x the restore; T=8192 is the smallest regime of the four where the
restore is a small part of the step, still 40x below the paper's. Seeded weights: experts N(0, 1/D) (gate/up) and N(0, 1/F) (down), router
N(0, 1/D). The router is frozen (requires_grad False): the routing skew is the controlled variable and
must not drift while the experts train.

Routing scenarios: the block's own router makes the skew. Every input token has feature 0 equal to 1
(the other features N(0, 1); a pool of 16 seeded batches per rank, cycled step by step), so the
router's weight column 0 is a per-expert logit bias b. b starts at log p and is calibrated
(b += 0.5 (log p - log share), through the block's router module on the whole pool) until the realised
share of each expert in the T*K assignments is within 0.001 of the target p:
  zipf      p_e ~ 1/(E-e)^1.2: expert 7 the hottest, then 6, ... This order is EP's worst split of these
            shares at W=2 (the 4 hottest on rank 1; EP's max/mean over all 35 splits is in the JSON),
            and FSEP's initial table (which replicates experts 0 and 1) is wrong for it, so the
            planner has to move the replicas
  real_l0   a recorded skew: `samples.models.tiny_mixtral` (2 MoE layers, E=8, top-2, vocab 256)
  real_l1   trained for 200 Adam steps (lr 3e-3, 8 x 128 bytes per step, seed 0, 1 thread) on a fixed
            byte stream, the standard library's argparse.py (sha256 in the JSON); each layer's
            per-expert assignment counts over the last 10 steps, replayed with its own expert ids
  balanced  p_e = 1/E
The realised shares are printed and stored twice: on the calibration pool, and in the run (the FSEP
controller's last 5 steps of counts, gathered from both ranks by the FSEP graph itself).

Systems (same weights, same input sequence, Adam lr 1e-4 on the expert weights):
  fsep  moepass.compile(block, Plan(form="fsep", topology=Topology(1, 2), slots_per_device=5,
        planner="auto")): each rank keeps half of every expert and restores C=5 whole experts per step
        (10 slots for 8 experts); the planner re-places them from the last 5 steps' counts, one step late.
  ep    moepass.compile(block, Plan(form="ep", topology=Topology(1, 2))): experts 0-3 on rank 0, 4-7 on 1.
  fsdp  moepass.compile(block, Plan(form="single")) (the same expert kernels), then FSDP2 `fully_shard`
        on it inside a root wrapper (reshard_after_forward=True, as for every layer of a deep model but
        the root): all E experts all-gathered in the forward and again in the backward, their gradients
        reduce-scattered; data parallel (each rank computes its own tokens with every expert).

Load balance. With `controller.track_loads = True` the FSEP controller records, per step, the rows each
device computed under the installed table and the rows plain EP would have computed for the same counts
(`cost_model.fsep.ep_device_rows`); max/mean rows per device per step over the timed steps.

Step time. One step = zero_grad + forward + backward + Adam step; loss = (y * probe).sum(), a fixed
random probe; x requires grad. Every step starts after a barrier; its time is the max over the ranks.
Per scenario: `--warmup` untimed steps of each system in turn (the planner needs its 5-step history and
installs one step late), then `--rounds` rounds of fsep, ep, fsdp, floor (A B C D A B C D ...), `--steps`
timed steps each; a system's round figure is the median of its steps. The JSON holds the median and
range of the round figures, the ratios ep/fsep and fsdp/fsep (of the medians, and the median of the
per-round ratios, which cancels load drift between rounds), per-rank forward / backward / optimizer
medians, and every step's global loss (the three systems run the same math: their losses agree).

Compute floor, timed in the same rounds: a SwiGLU expert step's six GEMMs at the run's sizes, as plain
`torch.mm(out=)` on R rows (forward [R, D]x[D, 2F] and [R, F]x[F, D]; backward dA, dW_down, dX,
dW_gate_up), R = T*K (a perfectly balanced device) and R = the median most-loaded device's rows of EP
and of FSEP. Both ranks run it at once (both cores busy, as in a step); max over the ranks.

Where the time goes, per scenario: the collectives alone at the run's sizes (FSEP's restore
all_to_all, FSDP's all_gather and reduce_scatter of all experts, EP's dispatch of T*K rows; barrier,
max over ranks, bytes and GB/s), and a torch.profiler table (self CPU time per op and step, each rank)
of `--profile-steps` steps per system.

Memory (FSEP, per layer): measured = the local shards of the expert DTensor parameters + the restored
expert tensors of one forward (an `fx.Interpreter` over the block's graph records every node whose name
ends in `_slots`; distinct storages counted once) vs the formula (E*S)/W + C*S, S = 3*D*F elements per
expert (fp32); EP's and FSDP's local expert bytes alongside.

Machine load: the 1-minute load average before and after every scenario (it includes this
benchmark's own 2 busy ranks; the cores are shared with other jobs).

Shape legend: T tokens per rank, D model width, F expert hidden width, E experts, K top-k, W ranks,
C slots per device, S elements per expert, R expert rows, N pool batches.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import fx, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.ep_layer import host_info  # noqa: E402
from benchmarks.ep_step import mixtral_config, summary  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = HERE / "results" / "fsep.json"
W = 2
SYSTEMS = ("fsep", "fsep_keep", "ep", "fsdp")  # order within a round (the floor follows)
SCENARIOS = ("zipf", "real_l0", "real_l1", "balanced")
SKEWED = ("zipf", "real_l0", "real_l1")
LAYERS = {  # C slots per device; T (tokens per rank) from --tokens
    "full": dict(D=256, F=512, E=8, K=2, C=5),
    "quick": dict(D=128, F=256, E=8, K=2, C=5),
}
TOKENS = {"full": (8192, 2048), "quick": (128,)}  # the first is the headline layer (see module doc)
REAL_ROUTER = {  # training of the model whose router skew is recorded
    "full": dict(steps=200, record=10, batch=8, seq=128, lr=3e-3),
    "quick": dict(steps=40, record=10, batch=8, seq=128, lr=3e-3),
}
ZIPF_S = 1.2
POOL = 16  # N input batches per rank, cycled
LR = 1e-4
TOLERANCE = 1e-3  # calibration: |realised share - target| per expert
GOALS = {"fsep_max_over_mean": 1.15, "ep_over_fsep_skewed": 1.2, "fsep_over_ep_balanced": 1.10}
# what the benchmark measures, in its results file
WHAT = ("FSEP vs EP vs FSDP2 on one HF Mixtral MoE layer at W=2 gloo ranks x 1 thread: max/mean rows per "
        "device under skewed routing (Zipf(1.2), two recorded router skews) and balanced routing; train-step "
        "time (fwd + bwd + Adam) in interleaved rounds with the compute floor; FSEP parameter memory per "
        "rank measured vs (E*S)/W + C*S")


# ----------------------------------------------------------------------------------------------
# The layer and its routing (orchestrator; the workers rebuild the block and load its state)
# ----------------------------------------------------------------------------------------------


def make_block(layer: dict) -> nn.Module:
    """The HF MixtralSparseMoeBlock of a 1-layer MixtralForCausalLM (train mode; weights to be set)."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(layer["D"], layer["F"], layer["E"], layer["K"], layers=1, heads=8, kv_heads=4, vocab=64,
                         seq=layer["T"])
    block = MixtralForCausalLM(cfg).model.layers[0].mlp
    block.train()
    return block


def init_block(layer: dict) -> nn.Module:
    """`make_block` with seeded weights (see module doc)."""
    block = make_block(layer)
    gen = torch.Generator().manual_seed(0)
    D, F = layer["D"], layer["F"]
    with torch.no_grad():
        block.gate.weight.normal_(0.0, D ** -0.5, generator=gen)
        block.experts.gate_up_proj.normal_(0.0, D ** -0.5, generator=gen)
        block.experts.down_proj.normal_(0.0, F ** -0.5, generator=gen)
    return block


def input_pool(layer: dict) -> torch.Tensor:
    """[N, W, T, D]: seeded N(0, 1) tokens with feature 0 set to 1 (the router's bias feature)."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(POOL, W, layer["T"], layer["D"], generator=gen)
    pool[..., 0] = 1.0
    return pool


def zipf_shares(E: int, s: float) -> list[float]:
    """p_e ~ 1/(E - e)^s: expert E-1 the hottest (see module doc for why this order)."""
    p = [1.0 / (E - e) ** s for e in range(E)]
    return [v / sum(p) for v in p]


def router_shares(block: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """[E] share of the T*K assignments per expert, through the block's own router module."""
    with torch.no_grad():
        experts_TK = block.gate(x_TD)[2]
    E = block.gate.weight.shape[0]
    return torch.bincount(experts_TK.flatten(), minlength=E).double() / experts_TK.numel()


def calibrate(block: nn.Module, pool: torch.Tensor, target_E: list[float], iterations: int = 300) -> dict:
    """Set the router's bias column (feature 0) so that the pool's per-expert shares match `target_E`."""
    x_TD = pool.reshape(-1, pool.shape[-1])
    target = torch.tensor(target_E, dtype=torch.float64)
    weight = block.gate.weight
    with torch.no_grad():
        log_target = target.clamp(min=1e-6).log()  # a share of 0: a bias that never wins
        weight[:, 0] = log_target.float()
        best = None
        for it in range(iterations):
            share = router_shares(block, x_TD)
            err = float((share - target).abs().max())
            if best is None or err < best[0]:
                best = (err, weight[:, 0].clone(), share, it)
            if err <= TOLERANCE:
                break
            weight[:, 0] += (0.5 * (log_target - share.clamp(min=1e-6).log())).float()
        err, bias, share, it = best
        weight[:, 0] = bias
    return {"target": target_E, "realised": share.tolist(), "max_abs_error": err, "iterations": it + 1,
            "bias": bias.tolist(), "assignments": int(x_TD.shape[0] * block.gate.top_k)}


def ep_split_spread(shares_E: list[float]) -> dict:
    """EP's max/mean rows per device at W=2 for every split of the experts into two halves (35 for E=8)."""
    E = len(shares_E)
    values = []
    for half in itertools.combinations(range(1, E), E // 2 - 1):  # expert 0 on rank 0: each split once
        first = shares_E[0] + sum(shares_E[e] for e in half)
        values.append(W * max(first, 1.0 - first))
    identity = W * max(sum(shares_E[:E // 2]), sum(shares_E[E // 2:]))
    return {"identity_order": identity, "splits": len(values), **summary(values)}


def record_real_router(cfg: dict) -> dict:
    """Train `tiny_mixtral` on a fixed byte stream; each MoE layer's per-expert assignment counts over the
    last `record` steps (its router's top-k, computed as LoopMoE.forward computes it)."""
    import torch.nn.functional as F

    from samples.models import LoopMoE, tiny_mixtral

    path = Path(argparse.__file__)
    raw = path.read_bytes()
    data = torch.tensor(list(raw), dtype=torch.int64)
    torch.manual_seed(0)
    model = tiny_mixtral()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    blocks = [m for m in model.modules() if isinstance(m, LoopMoE)]
    E = blocks[0].gate.weight.shape[0]
    counts_LE = torch.zeros(len(blocks), E, dtype=torch.int64)
    recording = [False]

    def recorder(i: int):
        def pre_hook(block: nn.Module, args: tuple) -> None:
            if recording[0]:
                x_TD = args[0].reshape(-1, args[0].shape[-1])
                logits_TE = F.linear(x_TD.float(), block.gate.weight.float())
                counts_LE[i] += torch.bincount(logits_TE.topk(block.top_k, dim=-1).indices.flatten(), minlength=E)
        return pre_hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(recorder(i))
    B, S = cfg["batch"], cfg["seq"]
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        starts = ((torch.arange(B) * 9973 + step * B * S) % (len(data) - S - 1)).tolist()
        tokens_BS = torch.stack([data[s:s + S + 1] for s in starts])
        recording[0] = step >= cfg["steps"] - cfg["record"]
        opt.zero_grad()
        loss = model.loss(tokens_BS)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shares = (counts_LE.double() / counts_LE.sum(dim=1, keepdim=True)).tolist()
    return {"model": "samples.models.tiny_mixtral() (dim 64, ffn 128, E=8, top-2, 2 LoopMoE layers, vocab 256)",
            "token_stream": {"path": str(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()},
            **cfg, "loss_first": losses[0], "loss_last": losses[-1], "train_s": time.perf_counter() - t0,
            "counts": counts_LE.tolist(), "shares": shares,
            "max_over_mean": [max(s) * E for s in shares]}


# ----------------------------------------------------------------------------------------------
# Worker: one torchrun launch, W ranks, every scenario
# ----------------------------------------------------------------------------------------------


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

            inner = moepass.compile(block, moepass.Plan(form="single"))
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


# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def prepare(layer: dict, real: dict, directory: Path) -> tuple[Path, dict]:
    """Calibrate the router of every scenario; save states, pool and probe for the workers."""
    block = init_block(layer)
    pool = input_pool(layer)
    probe = torch.randn(W, layer["T"], layer["D"], generator=torch.Generator().manual_seed(2))
    E = layer["E"]
    targets = {"zipf": zipf_shares(E, ZIPF_S), "real_l0": real["shares"][0], "real_l1": real["shares"][1],
               "balanced": [1.0 / E] * E}
    states, scenarios = {}, {}
    for name in SCENARIOS:
        cal = calibrate(block, pool, targets[name])
        states[name] = {k: v.clone() for k, v in block.state_dict().items()}
        scenarios[name] = {"calibration": cal, "ep_max_over_mean_by_split": ep_split_spread(cal["realised"])}
        print(f"{name:9s} target   " + " ".join(f"{v:.3f}" for v in cal["target"]), flush=True)
        print(f"{'':9s} realised " + " ".join(f"{v:.3f}" for v in cal["realised"])
              + f"   (max |diff| {cal['max_abs_error']:.4f}, {cal['iterations']} iterations, "
              f"EP max/mean {scenarios[name]['ep_max_over_mean_by_split']['identity_order']:.3f})", flush=True)
    path = directory / "fsep_data.pt"
    torch.save({"layer": layer, "pool": pool, "probe": probe, "states": states}, path)
    return path, scenarios


def launch(data: Path, args, directory: Path) -> tuple[dict | None, str]:
    """One torchrun launch of W ranks running every scenario; (result or None, log tail if it failed)."""
    result = directory / "result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={W}",
           str(Path(__file__).resolve()), "--worker", "--data", str(data), "--result", str(result),
           "--scenarios", *args.scenarios, "--warmup", str(args.warmup), "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--profile-steps", str(args.profile_steps), "--comm-reps", str(args.comm_reps)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    text = proc.stdout + proc.stderr
    lines = [ln for ln in text.splitlines() if ln.strip() and "returned a view tensor" not in ln
             and not ln.startswith(("  output = self._register", "[fsep rank"))]
    log = f"exit code {proc.returncode}\n" + "\n".join(lines[-60:])
    if result.exists() and text.count("worker finished") == W:
        return json.loads(result.read_text()), ("" if proc.returncode == 0 else log)
    return None, log


def ms(values: list[float]) -> dict:
    s = summary([1e3 * v for v in values])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def aggregate(name: str, res: dict, layer: dict) -> dict:
    """Per scenario: loads, step times and ratios, floors, phases, memory, collectives, profile, parity."""
    T, D, F, E, K, C = (layer[k] for k in ("T", "D", "F", "E", "K", "C"))
    first, last = res["timed_fsep_steps"]
    timed_loads = [r for r in res["loads"] if first <= r["step"] <= last]

    def balance(key: str) -> dict:
        values = [max(r[key]) / (sum(r[key]) / len(r[key])) for r in timed_loads]
        return {**summary(values), "per_step": values}

    rounds = {k: [statistics.median(v) for v in per_round] for k, per_round in res["times_s"].items()}
    step = {s: {**ms(rounds[s]), "round_medians_ms": [1e3 * v for v in rounds[s]],
                "all_steps_ms": [1e3 * v for r in res["times_s"][s] for v in r]} for s in SYSTEMS}
    floors = {k[len("floor_"):]: {**ms(v), "rows": res["floor_rows"][k[len("floor_"):]]}
              for k, v in rounds.items() if k.startswith("floor_")}
    ratios = {}
    for fsep in ("fsep", "fsep_keep"):
        for other in ("ep", "fsdp"):
            ratios[f"{other}/{fsep}"] = step[other]["median_ms"] / step[fsep]["median_ms"]
            ratios[f"{other}/{fsep}_per_round_median"] = statistics.median(
                a / b for a, b in zip(rounds[other], rounds[fsep]))
    for s in SYSTEMS:
        ratios[f"{s}/floor_balanced"] = step[s]["median_ms"] / floors["balanced"]["median_ms"]
    warm = res["warmup_steps"]
    phases = {}
    for s in SYSTEMS:
        window = slice(warm, warm + len(step[s]["all_steps_ms"]))  # the timed steps
        phases[s] = [{p: 1e3 * statistics.median(ph[i] for ph in rank["phases"][s][window])
                      for i, p in enumerate(("forward_ms", "backward_ms", "optimizer_ms"))} for rank in res["ranks"]]
    losses = {s: [sum(v) / W for v in zip(*(rank["losses"][s] for rank in res["ranks"]))] for s in SYSTEMS}
    n = min(len(v) for v in losses.values())
    parity = {s: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[s][:n], losses["ep"][:n]))
              for s in ("fsep", "fsep_keep", "fsdp")}
    S = 3 * D * F
    mem = res["ranks"][0]["memory"]
    measured = mem["fsep_local_expert_bytes"] + mem["fsep_restored"]["bytes"]
    formula = (E * S // W + C * S) * 4
    counts = torch.tensor(res["run_counts_last_5_steps"], dtype=torch.float64)
    sources = {}
    solves = [d["solve_ms"] for d in res["decisions"][1:]]
    for d in res["decisions"][1:]:
        sources[d["source"]] = sources.get(d["source"], 0) + 1
    restore_shape = str([[W * C, S // W]])  # the restore's [W*C, S/W] buffer, as the profiler prints it
    own_floor = {"fsep": floors["fsep_max_rows"], "fsep_keep": floors["fsep_max_rows"], "ep": floors["ep_max_rows"],
                 "fsdp": floors["balanced"]}
    where = {
        "step_minus_own_floor_ms": {s: step[s]["median_ms"] - own_floor[s]["median_ms"] for s in SYSTEMS},
        "own_floor": "the GEMMs alone on the system's most-loaded device rows (fsdp: T*K, data parallel)",
        "fsep_restore_bytes_to_each_peer": C * S // W * 4,
        "fsep_restore_alone_fwd_plus_bwd_ms": 2 * res["collectives"]["fsep_restore"]["ms"],
        "fsep_restore_wait_in_step_ms_per_rank": [rank["profile"]["fsep"]["wait_self_ms_by_shape"].get(restore_shape)
                                                  for rank in res["ranks"] if rank["profile"]],
    }
    return {
        "max_over_mean": {"ep": balance("ep"), "fsep": balance("fsep"),
                          "timed_steps": len(timed_loads)},
        "run_shares_last_5_steps": (counts.sum(0) / counts.sum()).tolist(),
        "step_ms": step, "ratios": ratios, "floor": floors, "where_time_goes": where, "phases_per_rank": phases,
        "parity_max_rel_loss_diff_vs_ep": parity, "losses_first_steps": {s: v[:3] for s, v in losses.items()},
        "memory_per_layer": {
            "fsep_measured_bytes": measured, "fsep_formula_bytes": formula, "measured/formula": measured / formula,
            "fsep_local_shards_bytes": mem["fsep_local_expert_bytes"],
            "fsep_restored_bytes": mem["fsep_restored"]["bytes"],
            "fsep_restored_nodes": mem["fsep_restored"]["nodes"],
            "formula": f"(E*S)/W + C*S = ({E}*{S})/{W} + {C}*{S} elements x 4 bytes (S = 3*D*F)",
            "ep_local_expert_bytes": mem["ep_local_expert_bytes"],
            "fsdp_local_expert_bytes": mem["fsdp_local_expert_bytes"],
            "fsdp_gathered_bytes_during_layer": E * S * 4,
        },
        "planner": {"decisions_by_candidate": sources, "final_table": res["decisions"][-1]["table"],
                    "initial_table": res["decisions"][0]["table"],
                    "solve_ms": summary(solves) if solves else None,
                    "max_wait_ms": max((d["wait_ms"] for d in res["decisions"][1:]), default=0.0),
                    "config": res["planner_config"]},
        "collectives": res["collectives"],
        "profile_per_rank": [rank["profile"] for rank in res["ranks"]],
        "load1": {"before": res["load1_before"], "after": res["load1_after"]},
        "wall_s": res["wall_s"],
        "loads_per_step": res["loads"],
    }


def goals(results: dict) -> dict:
    """Each issue-14 goal per scenario: the measured figure and whether it is met."""
    out: dict = {"fsep_max_over_mean<=1.15": {}, "ep/fsep>=1.2 (skewed)": {}}
    for s, r in results.items():
        if s not in SKEWED:
            continue
        mm = r["max_over_mean"]
        out["fsep_max_over_mean<=1.15"][s] = {"fsep": mm["fsep"]["median"], "ep": mm["ep"]["median"],
                                             "met": mm["fsep"]["median"] <= GOALS["fsep_max_over_mean"]}
        ratio = r["ratios"]
        out["ep/fsep>=1.2 (skewed)"][s] = {
            fsep: {"ratio": ratio[f"ep/{fsep}"], "per_round_median": ratio[f"ep/{fsep}_per_round_median"],
                   "met": ratio[f"ep/{fsep}"] >= GOALS["ep_over_fsep_skewed"]} for fsep in ("fsep", "fsep_keep")}
    if "balanced" in results:
        ratio = results["balanced"]["ratios"]
        out["fsep/ep<=1.10 (balanced)"] = {
            fsep: {"ratio": 1 / ratio[f"ep/{fsep}"], "per_round_median": 1 / ratio[f"ep/{fsep}_per_round_median"],
                   "met": 1 / ratio[f"ep/{fsep}"] <= GOALS["fsep_over_ep_balanced"]} for fsep in ("fsep", "fsep_keep")}
    return out


def run_layer(layer: dict, real: dict, args) -> tuple[dict | None, list[dict], dict]:
    """Calibrate, launch (one retry) and aggregate one layer size; (results or None, failures, load info)."""
    waited = common.wait_for_load(args.wait_load, args.wait_max) if args.wait_load else 0.0
    load = {"waited_s": waited, "load1_start": os.getloadavg()[0]}
    failures: list[dict] = []
    res = None
    with tempfile.TemporaryDirectory(prefix="fsep_") as tmpdir:
        tmp = Path(tmpdir)
        data, routing = prepare(layer, real, tmp)
        for attempt in range(2):  # one retry: a failed launch is recorded, not hidden
            t = time.perf_counter()
            res, log = launch(data, args, tmp)
            load["launch_wall_s"] = time.perf_counter() - t
            if res is not None:
                if log:
                    failures.append({"T": layer["T"], "attempt": attempt, "measured": True, "log": log})
                break
            failures.append({"T": layer["T"], "attempt": attempt, "measured": False, "log": log})
            print(f"T={layer['T']}: launch FAILED (attempt {attempt}):\n{log[-3000:]}", flush=True)
    load["load1_end"] = os.getloadavg()[0]
    if res is None:
        return None, failures, load
    results = {name: aggregate(name, r, layer) for name, r in res["scenarios"].items()}
    for name, r in results.items():
        r["routing"] = routing[name]
    return results, failures, load


def orchestrate(args) -> int:
    mode = "quick" if args.quick else "full"
    base = LAYERS[mode]
    t0 = time.perf_counter()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    torch.set_num_threads(1)
    real = record_real_router(REAL_ROUTER[mode])
    print(f"real router ({real['steps']} steps, loss {real['loss_first']:.2f} -> {real['loss_last']:.2f}): "
          + "; ".join(f"layer {i} shares " + " ".join(f"{v:.3f}" for v in s) for i, s in enumerate(real["shares"])),
          flush=True)
    by_tokens, failures, loads = {}, [], {}
    for T in args.tokens:
        layer = {**base, "T": T}
        print(f"\n== T={T} tokens per rank ==", flush=True)
        results, fails, load = run_layer(layer, real, args)
        failures += fails
        loads[f"T={T}"] = load
        if results is not None:
            by_tokens[f"T={T}"] = {"layer": {**layer, "W": W, "S": 3 * layer["D"] * layer["F"]},
                                   "goals": goals(results), "results": results}
            table(f"T={T}", by_tokens[f"T={T}"], args)
    during = [v for entry in by_tokens.values() for r in entry["results"].values() for v in r["load1"].values()]
    doc = {
        **common.results_header("fsep", WHAT, args.argv, started),
        "quick": args.quick,
        "layer_common": {**base, "W": W, "dtype": "float32", "block": "transformers MixtralSparseMoeBlock",
                         "router": "frozen; feature 0 of every token = 1, its weight column the calibrated "
                                   "per-expert bias", "optimizer": f"Adam lr {LR} on the expert weights",
                         "pool_batches": POOL, "tokens_per_rank": list(args.tokens),
                         "headline": f"T={args.tokens[0]}"},
        "systems": {
            "fsep": f"moepass Plan(form='fsep', topology=Topology(1, 2), slots_per_device={base['C']}, planner='auto')",
            "fsep_keep": f"moepass Plan(form='fsep', topology=Topology(1, 2), slots_per_device={base['C']}, "
                         f"planner='auto', keep_restored=True): the backward reuses the forward's restored experts",
            "ep": "moepass Plan(form='ep', topology=Topology(1, 2))",
            "fsdp": "moepass Plan(form='single') + FSDP2 fully_shard (non-root unit, reshard_after_forward=True)",
        },
        "step_definition": "zero_grad + forward + backward + Adam step; barrier before each step, time = max over "
                           "ranks",
        "warmup_steps": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps,
        "interleaved": "per round: " + ", ".join([*SYSTEMS, "floors"]) + f", {args.steps} steps each",
        "goals_targets": GOALS,
        "real_router": real,
        "by_tokens": by_tokens,
        "failures": failures,
        "load_average": {"wait_load": args.wait_load, "per_launch": loads,
                         "load1_during": summary(during) if during else None,
                         "note": "sampled before/after each scenario; includes this benchmark's own 2 busy ranks; "
                                 "2 cores shared with other jobs"},
        "machine": host_info(),
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "fsep_quick.json" if args.quick else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    png = out.with_name(out.stem + "_load.png")
    if by_tokens:
        plot(doc, next(iter(by_tokens)), png)
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0 if len(by_tokens) == len(args.tokens) else 1


def table(key: str, entry: dict, args) -> None:
    lay, results = entry["layer"], entry["results"]
    loads = [v for r in results.values() for v in r["load1"].values()]
    print(f"\nFSEP benchmark {key}: D={lay['D']} F={lay['F']} E={lay['E']} K={lay['K']} W={lay['W']} C={lay['C']}; "
          f"{args.rounds} rounds x {args.steps} steps; load1 {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'scenario':9s} {'max/mean EP':>11s} {'FSEP':>6s} | {'fsep ms':>17s} {'fsep_keep ms':>17s} {'ep ms':>17s} "
          f"{'fsdp ms':>17s} | {'ep/fsep':>7s} {'ep/keep':>7s} {'fsdp/fsep':>9s} | {'floor bal':>9s} {'ep max':>6s} "
          f"{'fsep max':>8s}")
    for name, r in results.items():
        mm, st, fl = r["max_over_mean"], r["step_ms"], r["floor"]
        cell = lambda s: f"{st[s]['median_ms']:6.1f} [{st[s]['min_ms']:.0f},{st[s]['max_ms']:.0f}]"  # noqa: E731
        print(f"{name:9s} {mm['ep']['median']:11.3f} {mm['fsep']['median']:6.3f} | {cell('fsep'):>17s} "
              f"{cell('fsep_keep'):>17s} {cell('ep'):>17s} {cell('fsdp'):>17s} | {r['ratios']['ep/fsep']:7.2f} "
              f"{r['ratios']['ep/fsep_keep']:7.2f} {r['ratios']['fsdp/fsep']:9.2f} | "
              f"{fl['balanced']['median_ms']:9.1f} {fl['ep_max_rows']['median_ms']:6.1f} "
              f"{fl['fsep_max_rows']['median_ms']:8.1f}")
    print("max/mean: rows per device per timed step (median); ms: median [range] of round medians; floor: the "
          "expert GEMMs alone on T*K rows (bal) and on the most-loaded device's rows")
    for name, r in results.items():
        m, c = r["memory_per_layer"], r["collectives"]
        print(f"{name:9s} memory measured {m['fsep_measured_bytes'] / 2**20:.2f} MiB vs formula "
              f"{m['fsep_formula_bytes'] / 2**20:.2f} MiB; alone: restore {c['fsep_restore']['ms']:.1f} ms, all_gather "
              f"{c['fsdp_all_gather']['ms']:.1f} ms, reduce_scatter {c['fsdp_reduce_scatter']['ms']:.1f} ms, dispatch "
              f"{c['ep_dispatch']['ms']:.1f} ms; planner {r['planner']['decisions_by_candidate']}; loss vs EP "
              + ", ".join(f"{k} {v:.1e}" for k, v in r["parity_max_rel_loss_diff_vs_ep"].items()))
    for goal, v in entry["goals"].items():
        print(f"goal {goal}: {v}")


def plot(doc: dict, key: str, path: Path) -> None:
    """Rows per device per step, EP (dashed) vs FSEP (solid), one panel per scenario, for layer `key`."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entry = doc["by_tokens"][key]
    results, lay = entry["results"], entry["layer"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False, sharey=True)
    for ax, (name, r) in zip(axes[0], results.items()):
        loads = r["loads_per_step"]
        steps = [x["step"] for x in loads]
        for rank, color in zip(range(lay["W"]), ("tab:blue", "tab:orange")):
            ax.plot(steps, [x["ep"][rank] for x in loads], "--", color=color, label=f"EP device {rank}")
            ax.plot(steps, [x["fsep"][rank] for x in loads], "-", color=color, label=f"FSEP device {rank}")
        ax.axhline(lay["T"] * lay["K"], color="black", lw=0.8, ls=":", label="mean (T*K)")
        ax.axvspan(0, doc["warmup_steps"] + 0.5, color="0.9", label="warm-up (untimed)")
        mm = r["max_over_mean"]
        ax.set_title(f"{name}: max/mean EP {mm['ep']['median']:.2f}, FSEP {mm['fsep']['median']:.2f}", fontsize=9)
        ax.set_xlabel("FSEP training step")
    axes[0][0].set_ylabel("expert rows computed per device")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(f"Per-device expert rows per step, W={lay['W']}, E={lay['E']}, K={lay['K']}, C={lay['C']}, "
                 f"T={lay['T']} per rank ({doc['started'][:10]})", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


COUNTS = {"--rounds": (10, 1, "interleaved rounds per scenario"), "--steps": (3, 2, "timed steps per system per round"),
          "--warmup": (10, 7, "untimed steps per system"), "--profile-steps": (3, 0, "profiled steps per system"),
          "--comm-reps": (10, 3, "repetitions per collective")}


def main(argv: list[str] | None = None) -> int:
    p = common.benchmark_parser(__doc__, "small layer, 1 round of 2 steps, JSON to the temp dir", COUNTS)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="tokens per rank, one launch each; the first is the headline (default 8192 2048; --quick 128)")
    p.add_argument("--out", default=None, help=f"JSON path (default {OUT.relative_to(ROOT)})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the launch")
    common.add_wait_options(p)
    # internal: the worker of the launch
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = common.parse_args(p, argv, COUNTS)
    args.tokens = args.tokens or list(TOKENS["quick" if args.quick else "full"])
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
