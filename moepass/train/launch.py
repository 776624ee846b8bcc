"""Run `fn(args)` on every rank of a process group: under torchrun (its environment), or by spawning
`nproc` ranks on this machine (NCCL over the CUDA GPUs when there are that many, else gloo on the CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moepass.runtime.workers import free_port


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def backend_for(world: int, device: str) -> str:
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= 1 else "gloo"


def _rank_main(rank: int, world: int, port: int, device: str, timeout_s: float, fn: Callable[[Any], Any],
               args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _init_and_run(device, timeout_s, fn, args)


def _init_and_run(device: str, timeout_s: float, fn: Callable[[Any], Any], args: Any) -> Any:
    world = int(os.environ["WORLD_SIZE"])
    backend = backend_for(world, device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        return fn(args)
    finally:
        dist.destroy_process_group()


def run(fn: Callable[[Any], Any], args: Any, nproc: int, device: str, timeout_s: float = 300.0) -> None:
    """`fn(args)` on every rank (see module doc). A rank that fails makes this raise (spawned ranks: the
    `ProcessRaisedException` / `ProcessExitedException` of torch.multiprocessing, naming the rank)."""
    if under_torchrun():
        _init_and_run(device, timeout_s, fn, args)
        return
    if nproc < 1:
        raise ValueError(f"nproc={nproc} is invalid: spawn 1 or more ranks")
    if nproc == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        _init_and_run(device, timeout_s, fn, args)
        return
    mp.spawn(_rank_main, args=(nproc, free_port(), device, timeout_s, fn, args), nprocs=nproc, join=True)
