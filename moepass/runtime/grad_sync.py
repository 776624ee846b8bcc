"""Gradient synchronisation under the priority rule of `moepass.runtime.scheduler` (Lina, ATC'23): dense
gradients averaged and, with `expert_replicas=True`, the gradients of experts several replicas hold summed,
all as micro-ops of one `PriorityScheduler` queue; what `compile` installs with `Plan(grad_sync="scheduler")`.

Ways in:
    model = moepass.DataParallel(cm)                                    # wrapper; grads averaged after backward
    sync = GradientSync(cm, expert_replicas=True)                       # the same on cm's parameters, no wrapper;
                                                                        # + expert replicas summed as micro-ops
    ddp.register_comm_hook(PriorityScheduler(...), priority_hook)        # DDP communication hook (per-tensor cuts)
    fully_shard(...); schedule_fsdp(cm)                                 # FSDP2: its all-gathers and reduce-scatters
                                                                        # as micro-ops, launched from FSDP's thread
                                                                        # under the rule (`launch_now`)
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moepass.runtime.layout import block_expert_parameter_names, expert_layouts, local_part
from moepass.runtime.scheduler import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, MicroOp, PriorityScheduler

# ----------------------------------------------------------------------------------------------
# Way 1: GradientSync on the parameters (DataParallel: the same as a wrapper).
# ----------------------------------------------------------------------------------------------


def replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters that every rank holds in full (expert DTensors are excluded)."""
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]


def expert_replica_parameters(model: nn.Module) -> dict[str, dist.ProcessGroup]:
    """Expert parameters several data-parallel replicas hold (packing, ep_size < world) -> the group of
    their replicas: their gradients are summed over it (the 1/W is already in them, `exchange.grad_scale`)."""
    out = {}
    for path, layout in expert_layouts(model):
        if layout.groups.dp_size > 1:
            out.update({n: layout.groups.dp_group for n in block_expert_parameter_names(model, path, layout)})
    return out


@dataclass(frozen=True)
class Reduced:
    """A parameter `DataParallel` reduces: over `group` (None: the scheduler's own), averaged or summed."""

    param: nn.Parameter
    group: dist.ProcessGroup | None
    average: bool


def plan_micro_op_bytes(model: nn.Module) -> int:
    """`Plan.micro_op_bytes` of the plan `moepass.compile` rewrote `model` with, else the default."""
    from moepass.plan import DEFAULT_MICRO_OP_BYTES

    info = getattr(model, "moepass_info", None)
    return info.plan.micro_op_bytes if info is not None else DEFAULT_MICRO_OP_BYTES


class GradientSync:
    """The priority scheduler's gradient synchronisation, installed on a model's parameters (no wrapper).

    After `loss.backward()` returns, every replicated gradient is the mean over the ranks (DDP's
    convention); expert gradients are handled by the EP pass, or, with `expert_replicas=True`, the
    gradients of experts held by several replicas (packing, ep_size < world) are summed over their
    replicas here, as micro-ops of the same queue (the block's own blocking reduction must then be off:
    the EP pass installs it as a gradient hook on those parameters). Micro-ops launch in reverse parameter
    order (the order backward produces them); a parameter whose gradient is late only delays the
    ones after it. A parameter that got no gradient is reduced as zeros (every rank reduces the same
    list). Construct on every rank in the same order (it creates a process group).
    """

    def __init__(self, model: nn.Module, micro_op_bytes: int | None = None, group: dist.ProcessGroup | None = None,
                 priority: bool = True, timeout: float = 600.0, expert_replicas: bool = False):
        micro_op_bytes = plan_micro_op_bytes(model) if micro_op_bytes is None else micro_op_bytes
        self.scheduler = PriorityScheduler(micro_op_bytes, group, timeout, enabled=priority)
        replicated = {n for n, _ in replicated_parameters(model)}
        experts = expert_replica_parameters(model) if expert_replicas else {}
        self._reduced = [Reduced(p, experts.get(n), n in replicated) for n, p in reversed(list(model.named_parameters()))
                         if p.requires_grad and (n in replicated or n in experts)]
        self._params = [r.param for r in self._reduced]
        self._slots: dict[int, list[MicroOp]] = {}
        self._ops: list[MicroOp] = []
        self._step_open = False
        self._hooks = [p.register_post_accumulate_grad_hook(lambda p, index=index: self._ready(index))
                       for index, p in enumerate(self._params)]
        # gradient accumulation: a summed replica's gradient from the last backward is already the sum over its
        # replicas; divided by their count before the new gradient adds to it, the sum restores it
        self._hooks += [r.param.register_hook(functools.partial(share_before_accumulating, r.param, r.group))
                        for r in self._reduced if not r.average]

    def _open_step(self) -> None:
        """First gradient of a backward: reserve every micro-op slot in the fixed order."""
        self._step_open = True
        self._slots, self._ops = {}, []
        for index, p in enumerate(self._params):
            per = max(1, self.scheduler.micro_op_bytes // p.element_size())  # as `cut` splits
            count = -(-local_part(p).numel() // per)
            self._slots[index] = [self.scheduler.placeholder(self._reduced[index].group) for _ in range(count)]
            self._ops += self._slots[index]
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _ready(self, index: int) -> None:
        if not self._step_open:
            self._open_step()
        p = self._params[index]
        if not self._slots.get(index) or p.grad is None:
            return
        slots = self._slots.pop(index)
        for op, piece in zip(slots, self.scheduler.cut(local_part(p.grad).view(-1))):
            self.scheduler.fill(op, piece)

    def _finish(self) -> None:
        """End of backward: parameters without a gradient reduce zeros; wait; average (replicated ones)."""
        for index in list(self._slots):
            p = self._params[index]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._ready(index)
        self.scheduler.end_backward()
        self.scheduler.wait(self._ops)
        for r in self._reduced:
            if r.average and r.param.grad is not None:
                r.param.grad.div_(self.scheduler.world)
        self._step_open = False

    def close(self) -> None:
        """Stop the scheduler and take the parameter hooks off (the model is as before)."""
        for hook in self._hooks:
            hook.remove()
        self.scheduler.close()


def share_before_accumulating(param: nn.Parameter, group: dist.ProcessGroup | None, grad: Tensor) -> None:
    """Tensor hook of a summed replica (it runs before the new gradient accumulates into `param.grad`): an
    accumulated gradient, summed over the replicas after the last backward, becomes its share (1/replicas), so
    that this backward's sum gives the earlier sum plus the sum of the new gradients, not replicas x the earlier.
    (An averaged gradient needs nothing: the mean of the earlier mean plus the new is the earlier plus the mean.)"""
    if param.grad is not None:
        local_part(param.grad).div_(dist.get_world_size(group))


class DataParallel(nn.Module):
    """`GradientSync` as a wrapper module: `DataParallel(cm)(x)` runs `cm(x)`; same arguments."""

    def __init__(self, module: nn.Module, micro_op_bytes: int | None = None, group: dist.ProcessGroup | None = None,
                 priority: bool = True, timeout: float = 600.0, expert_replicas: bool = False):
        super().__init__()
        self.module = module
        self.sync = GradientSync(module, micro_op_bytes, group, priority, timeout, expert_replicas)
        self.scheduler = self.sync.scheduler

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def close(self) -> None:
        self.sync.close()


# ----------------------------------------------------------------------------------------------
# Way 2: a DDP communication hook.
# ----------------------------------------------------------------------------------------------


def priority_hook(state: PriorityScheduler, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """`ddp.register_comm_hook(PriorityScheduler(bytes), priority_hook)`: every gradient of the bucket
    is cut into micro-ops on its own (Lina: no micro-op spans two tensors; DDP's bucket is only the
    unit it hands over) and averaged under the priority rule on the scheduler's own group."""
    buffer = bucket.buffer()
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    # the gradients are views of the flat buffer, in bucket order (reducing them reduces the buffer)
    pieces = [piece for grad in bucket.gradients() for piece in state.cut(grad.view(-1))]
    if not pieces:
        fut.set_result(buffer)
        return fut
    remaining = [len(pieces)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            buffer.div_(state.world)
            fut.set_result(buffer)

    for piece in pieces:
        state.submit(MicroOp(flat=piece, on_done=one_done))
    return fut


# DDP's register_comm_hook checks the annotations as objects (this module uses postponed annotations)
priority_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]})


# ----------------------------------------------------------------------------------------------
# Way 3: FSDP2 (`fully_shard`): its all-gather and reduce-scatter as micro-ops under the rule.
# ----------------------------------------------------------------------------------------------
#
# FSDP2 has no hook that delays its collectives: `foreach_reduce` / `foreach_all_gather` call their
# `Comm` object synchronously and read the output on the same stream right after. Its documented
# seam is that object: `FSDPModule.set_custom_reduce_scatter` / `set_custom_all_gather`. The two
# comms below cut FSDP's flat buffer into micro-ops of at most `micro_op_bytes` and launch each from
# FSDP's own thread and stream with `PriorityScheduler.launch_now` (so the launch waits for every
# queued or running all-to-all and for the previous micro-op), then `work.wait()` (what FSDP's
# default `async_op=False` does: on gloo the thread waits, on NCCL the stream does).
#
# Shape letters: `moepass.spec.SHAPES` (here P the ranks of FSDP's group, e the elements of one rank's shard:
# the all-gather input, the reduce-scatter output); the full buffer is P blocks of e, rank r's at [r*e, (r+1)*e).


def micro_op_columns(world: int, shard_numel: int, element_size: int, micro_op_bytes: int) -> list[tuple[int, int]]:
    """[a, b) ranges of a shard such that the P blocks' columns [a, b) together are <= micro_op_bytes."""
    per = max(1, micro_op_bytes // (world * element_size))
    return [(a, min(a + per, shard_numel)) for a in range(0, shard_numel, per)]


class _SchedulerComm:
    """Allocation as FSDP's default (a plain empty tensor) and the scheduler the micro-ops go through.
    Duck-typed to FSDP2's `Comm` / `AllGather` / `ReduceScatter` interfaces (torch does not export them)."""

    def __init__(self, scheduler: PriorityScheduler):
        self.scheduler = scheduler

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def columns(self, world: int, shard: Tensor) -> list[tuple[int, int]]:
        return micro_op_columns(world, shard.numel(), shard.element_size(), self.scheduler.micro_op_bytes)


class FSDPReduceScatter(_SchedulerComm):
    """FSDP2's reduce-scatter as micro-ops: columns [a, b) of the P blocks reduced into out_e[a:b].
    Each output element reduces the same P values as in one call: bit for bit at P=2 (a sum of two is
    commutative; tested), at larger P as far as the backend sums a smaller buffer in the same order."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> None:
        world, shard_e = group.size(), output_tensor.numel()
        in_Pe = input_tensor.view(world, shard_e)
        cols = self.columns(world, output_tensor)
        for a, b in cols:
            piece_in = input_tensor if len(cols) == 1 else in_Pe[:, a:b].reshape(-1)
            piece_out = output_tensor[a:b]
            nbytes = (world - 1) * (b - a) * output_tensor.element_size()
            self.scheduler.launch_now(
                "fsdp_reduce_scatter", group, nbytes,
                functools.partial(REDUCE_SCATTER_SINGLE, piece_out, piece_in, op=op, group=group, async_op=True),
            ).wait()


class FSDPAllGather(_SchedulerComm):
    """FSDP2's all-gather as micro-ops: in_e[a:b] gathered into columns [a, b) of the P blocks.
    Returns None also for `async_op=True` (each micro-op is waited on FSDP's stream; FSDP then orders
    by its all-gather event)."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        world, shard_e = group.size(), input_tensor.numel()
        out_Pe = output_tensor.view(world, shard_e)
        cols = self.columns(world, input_tensor)
        for a, b in cols:
            whole = len(cols) == 1
            piece_out = output_tensor if whole else output_tensor.new_empty(world * (b - a))
            nbytes = (world - 1) * (b - a) * input_tensor.element_size()
            self.scheduler.launch_now(
                "fsdp_all_gather", group, nbytes,
                functools.partial(ALL_GATHER_SINGLE, piece_out, input_tensor[a:b], group=group, async_op=True),
            ).wait()
            if not whole:
                out_Pe[:, a:b].copy_(piece_out.view(world, b - a))


def schedule_fsdp(model: nn.Module, scheduler: PriorityScheduler | None = None) -> PriorityScheduler:
    """Route the all-gathers and reduce-scatters of every `fully_shard` module in `model` through the
    priority rule. `scheduler`: None takes the one `moepass.compile(..., Plan(grad_sync="scheduler"))`
    installed (`model.moepass_grad_sync`), else makes one with the plan's `micro_op_bytes` (construct on
    every rank in the same order: it creates a process group). Call after `fully_shard`, on every rank."""
    from torch.distributed.fsdp import FSDPModule

    if scheduler is None:
        sync = getattr(model, "moepass_grad_sync", None)
        scheduler = sync.scheduler if sync is not None else PriorityScheduler(plan_micro_op_bytes(model))
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(f"schedule_fsdp: {type(model).__name__} has no fully_shard module: call "
                         f"torch.distributed.fsdp.fully_shard on its dense parts first")
    for module in sharded:
        module.set_custom_reduce_scatter(FSDPReduceScatter(scheduler))  # type: ignore[arg-type]
        module.set_custom_all_gather(FSDPAllGather(scheduler))  # type: ignore[arg-type]
    return scheduler
