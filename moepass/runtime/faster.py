"""form="single" is never slower than the block it replaced: the faster of the two, timed at the first call.

The single form changes no math and adds no parallelism: what it is for is speed (grouped expert GEMMs, Triton
kernels, fewer launches). Where the user's own block is faster for some input — a block that is already a few
large dense ops, on a device whose time at that size is the host's launch cost — running its rewritten graph
would make the model slower. So, with `Plan(keep_original_if_slower=True)` (the default of form="single"), a
compiled block keeps the user's block object beside its graph (holding the same parameters, buffers and
children: the two share one table of each, so `.to()`, `to_empty()` and re-registered parameters reach both)
and, the first time it sees an input signature (shapes, dtypes, devices, grad and training mode, autocast),
first runs both once on copies of that input from the same state: where their outputs differ beyond rounding
(`disagreement`: detection proved the graph in fp32, but under autocast a router may score in bf16 where
`moe.route` scores in fp32), the user's block runs for that signature, untimed. Else it times both, interleaved:

    warm-up: 2 untimed steps each (kernels compile and autotune, caches fill), then 2 timed: where one side's
             best is CLEAR times the other's, that decides
    ROUNDS rounds: n steps of one, n steps of the other (the order alternating), n sized to ~0.1 s a half
    per round, the ratio of the two sides' median steps; the rewritten graph is kept when the median ratio over
    the rounds is <= KEEP_BELOW (at least 2 % faster)

A step is what training runs: the forward, then, when grad mode is on, the backward of every output that needs
a gradient into the block's inputs and parameters (`torch.autograd.grad`: no `.grad` is written and no
accumulation hook fires, DDP's or FSDP's included). The measurement leaves no trace: the random number
generators are forked, the buffers restored (values and objects), the inputs copied (a block may write into
its input), and the caller's saved-tensor hooks (activation offload, checkpointing) see none of its tensors.
Blocks of one structure (`moepass.detect.structure.structural_key`) share a decision within a compiled model:
a 48-layer model is timed once per input signature, not 48 times.

The rewritten graph always runs (nothing is timed) where the choice could not be made honestly or would change
a guarantee: under a tracer, a compiler or a functorch transform, for inputs of a tensor subclass (DTensor,
FakeTensor), for parameters that are not plain tensors (FSDP2's shards), and where compile left the keeper out:
`Plan(deterministic=True)` (bitwise-reproducible runs: a timing cannot decide what runs),
`Plan(expert_recompute=True)` (the memory it asks for is the rewritten form's), the torch.compile backend (a
traced graph), `MOEPASS_ALWAYS_REWRITE=1` (the test suite sets it; tests that time set the plan field). What was
chosen is `faster.choices(block)` (a `Choice` per input signature) and logged at INFO on logger "moepass".

Each process decides for itself: under data parallelism two ranks may run different sides of one block (each
the block's math within its dtype's rounding; the gradients are averaged as ever). A run that must repeat bit for
bit sets `Plan(deterministic=True)`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moepass.determinism import output_tensors
from moepass.eager import PLAIN_INPUTS, PLAIN_TENSORS, watched

log = logging.getLogger("moepass")

KEEPER = "moepass_keeper"  # the attribute (instance dict, not a submodule) a compiled block holds its keeper in
WARMUP = 2  # untimed steps of each before any timing: compilation, autotuning, first-touch pages
ROUNDS = 5  # interleaved rounds; the decision reads their median ratio
ROUND_SECONDS = 0.1  # each half of a round runs about this long (at least one step)
MAX_STEPS = 20  # steps per half at most
KEEP_BELOW = 0.98  # the rewritten graph is kept when its median time ratio is at most this
# the two sides must agree on the first input of a signature: output difference at most this share of the
# output's largest magnitude (16-bit outputs or autocast; else AGREE_FP32), else the user's block runs
AGREE_16BIT, AGREE_FP32 = 5e-2, 1e-3
CLEAR = 2.0  # a warm-up ratio beyond this (either way) decides without the rounds
PLAIN_VALUES = PLAIN_INPUTS - set(PLAIN_TENSORS)  # the plain non-tensor arguments an input signature holds


@dataclass(frozen=True)
class Choice:
    """What one input signature runs: `original` (the user's block) or the rewritten graph, and why."""

    original: bool
    ratio: float  # rewritten / original, median over the rounds (nan: not measured)
    ratios: tuple[float, ...]  # per round
    steps: int  # steps per half round
    reason: str = ""  # why nothing was measured (the rewritten graph runs)

    def __str__(self) -> str:
        which = "original block" if self.original else "rewritten graph"
        if self.reason:
            return f"{which} ({self.reason})"
        return (f"{which}: rewritten/original {self.ratio:.3f} [{min(self.ratios):.3f}, {max(self.ratios):.3f}] over "
                f"{len(self.ratios)} rounds of {self.steps} step(s)")


def input_key(training: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
    """The signature a choice holds for: every tensor's shape, dtype, device and requires_grad, the plain values,
    grad and training mode, autocast; None where an input is not a plain tensor or value (the graph runs)."""
    if not kwargs and len(args) == 1 and type(args[0]) is Tensor and not torch._C._is_any_autocast_enabled():
        x = args[0]  # the common call, a block of one hidden-state tensor: the same key, made without the loop
        return (training, torch.is_grad_enabled(), (None, x.shape, x.dtype, x.device, x.requires_grad))
    parts: list[Hashable] = [training, torch.is_grad_enabled()]
    for name, value in (*((None, a) for a in args), *kwargs.items()):
        if type(value) in PLAIN_TENSORS:
            parts.append((name, value.shape, value.dtype, value.device, value.requires_grad))
        elif type(value) in PLAIN_VALUES:
            parts.append((name, value))
        else:
            return None
    if torch._C._is_any_autocast_enabled():
        parts.append(tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                           if torch.is_autocast_enabled(kind)))
    return tuple(parts)


def fresh(value: Any, leaves: list[Tensor]) -> Any:
    """A copy of one input that the step may write into, as a block's input is in training: made by an op from a
    leaf (added to `leaves`) when the input needs a gradient, so an in-place write is legal and differentiated."""
    if not isinstance(value, Tensor):
        return value
    if not value.requires_grad:
        return value.detach().clone()
    leaf = value.detach().requires_grad_()
    leaves.append(leaf)
    return leaf.clone()


def one_step(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], params: Sequence[Tensor]) -> None:
    """One training step of `fn` on copies of its inputs: forward, and with grad mode on the backward of every
    output needing a gradient into the inputs and `params` (returned, not accumulated into `.grad`)."""
    leaves: list[Tensor] = []
    args = tuple(fresh(a, leaves) for a in args)
    kwargs = {name: fresh(v, leaves) for name, v in kwargs.items()}
    out = fn(*args, **kwargs)
    if not torch.is_grad_enabled():
        return
    outs = [t for t in output_tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.grad(outs, [*leaves, *params], [torch.ones_like(t) for t in outs], allow_unused=True)


class SavedState:
    """The block's buffers (objects and values) and random number generators, put back on exit (and by `rewind`)."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.buffers = [(m, name, b, b.detach().clone()) for m in module.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.devices = [device] if device.type not in ("cpu", "meta") else []
        self.accelerator = torch.get_device_module(device.type) if self.devices else None
        self.rng = torch.random.fork_rng(devices=self.devices, device_type=device.type if self.devices else "cuda")

    def __enter__(self) -> SavedState:
        self.rng.__enter__()
        self.states = (torch.get_rng_state(), [self.accelerator.get_rng_state(d) for d in self.devices])
        return self

    def rewind(self) -> None:
        """The buffers and the random number generators as they were on entry (the next call sees what the
        first one saw: the same dropout, jitter and balancing state)."""
        with torch.no_grad():
            for module, name, buffer, value in self.buffers:
                module._buffers[name] = buffer
                buffer.copy_(value)
        torch.set_rng_state(self.states[0])
        for d, state in zip(self.devices, self.states[1]):
            self.accelerator.set_rng_state(state, d)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.rewind()
        finally:
            self.rng.__exit__(*exc)


def disagreement(original: Callable[..., Any], rewritten: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], saved: SavedState) -> str:
    """Why the two sides are not the same computation for this input, or "": their outputs on copies of it, from
    the same state, apart by more than 16-bit (or fp32) rounding. Detection proved the graph in fp32; what it
    cannot see is, e.g., a router that scores in bf16 under autocast where `moe.route` scores in fp32 (Hugging
    Face's DeepSeek-V3): other experts for some tokens. The user's block then runs, so the model computes as
    written on every machine, whichever side would be faster."""
    outs = []
    for fn in (original, rewritten):
        saved.rewind()
        with torch.no_grad():
            outs.append([t.detach() for t in output_tensors(fn(*(fresh(a, []) for a in args),
                                                               **{k: fresh(v, []) for k, v in kwargs.items()}))])
    saved.rewind()
    theirs, ours = outs
    autocast = torch._C._is_any_autocast_enabled()
    if len(theirs) != len(ours):
        return f"its rewritten graph returns {len(ours)} tensors where the block returns {len(theirs)}"
    for a, b in zip(theirs, ours):
        if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():
            continue  # shapes and integer outputs were checked by detection; here: values under this signature
        scale = float(a.abs().max()) if a.numel() else 0.0
        worst = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        low = autocast or min(torch.finfo(a.dtype).bits, torch.finfo(b.dtype).bits) <= 16
        share = AGREE_16BIT if low else AGREE_FP32
        if not worst <= share * max(scale, 1e-6):
            return (f"its rewritten graph does not reproduce it for this input: outputs {worst:.3g} apart where "
                    f"|y| <= {scale:.3g}" + (" (under autocast: a router scoring in bf16, say, where moepass "
                                             "scores in fp32)" if autocast else ""))
    return ""


def same(t: Tensor) -> Tensor:
    return t


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure(original: Callable[..., Any], rewritten: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Choice:
    """Time `original` against `rewritten` on copies of the inputs (module docstring) and choose."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    params = [p for p in module.parameters() if p.requires_grad]
    runs = {"original": original, "rewritten": rewritten}

    def half(name: str, steps: int) -> float:
        """The median seconds of one step over `steps` (a page fault or a collection in one step moves no median)."""
        seconds = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            one_step(runs[name], args, kwargs, params)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    # the caller's saved-tensor hooks (activation offload, a checkpointed region's) see none of this: the innermost
    # pair of hooks is the one autograd uses, and these keep each tensor as it is
    with SavedState(module, device) as saved, torch.autograd.graph.saved_tensors_hooks(same, same):
        differs = disagreement(original, rewritten, args, kwargs, saved)
        if differs:  # not the same computation for this input: the user's block runs, whatever the times
            return Choice(original=True, ratio=float("nan"), ratios=(), steps=0, reason=differs)
        for name in runs:  # untimed: kernels compile and autotune, launch paths and caches fill, pages are touched
            half(name, WARMUP)
        warm = {name: min(half(name, 1) for _ in range(2)) for name in runs}
        ratio = warm["rewritten"] / warm["original"]
        if not 1 / CLEAR < ratio < CLEAR:  # one is several times the other: no round would change the choice
            return Choice(original=ratio > KEEP_BELOW, ratio=ratio, ratios=(ratio,), steps=1)
        steps = max(1, min(MAX_STEPS, round(ROUND_SECONDS / max(max(warm.values()), 1e-9))))
        ratios = []
        for r in range(ROUNDS):
            order = ("original", "rewritten") if r % 2 == 0 else ("rewritten", "original")
            seconds = {name: half(name, steps) for name in order}
            ratios.append(seconds["rewritten"] / seconds["original"])
    ratio = statistics.median(ratios)
    return Choice(original=ratio > KEEP_BELOW, ratio=ratio, ratios=tuple(ratios), steps=steps)


class Keeper:
    """A compiled block's choice between its rewritten graph and the user's block it replaced (module docstring).

    `block` is the user's block (in the compiled copy), sharing the compiled block's tables of parameters,
    buffers and children; `shared` the decisions of the blocks of one structure in one compiled model
    (`structure` is this block's key there, None: decided alone)."""

    def __init__(self, gm: nn.Module, block: nn.Module, path: str, structure: Hashable | None,
                 shared: dict[Hashable, Choice]):
        for table in ("_parameters", "_buffers", "_modules"):  # one table each: whatever reaches one reaches both
            block.__dict__[table] = gm.__dict__[table]
        block.__dict__["_non_persistent_buffers_set"] = gm.__dict__["_non_persistent_buffers_set"]
        self.block, self.path, self.structure, self.shared = block, path, structure, shared
        self.choices: dict[Hashable, Choice] = {}

    def forward_for(self, gm: nn.Module, graph_forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        """The user's block's forward where it was measured faster for these inputs; None: the rewritten graph."""
        key = input_key(gm.training, args, kwargs)
        if key is None:
            return None
        choice = self.choices.get(key)
        if choice is None:
            choice = self.decide(gm, graph_forward, key, args, kwargs)
        if not choice.original:
            return None
        if self.block.training is not gm.training:  # its children are the compiled block's: only its flag can differ
            self.block.__dict__["training"] = gm.training
        return self.block.forward

    def decide(self, gm: nn.Module, graph_forward: Callable[..., Any], key: Hashable, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Choice:
        shared_key = None if self.structure is None else (self.structure, key)
        choice = None if shared_key is None else self.shared.get(shared_key)
        if choice is None:
            reason = next((f"parameter {name!r} is a {type(p.data).__name__}, not a plain tensor"
                           for name, p in gm.named_parameters() if type(p.data) is not Tensor), "")
            if not reason and any(isinstance(t, Tensor) and t.is_meta for t in (*args, *kwargs.values())):
                reason = "meta tensors take no time"
            if reason:
                choice = Choice(original=False, ratio=float("nan"), ratios=(), steps=0, reason=reason)
            else:
                self.block.__dict__["training"] = gm.training
                choice = measure(self.block.forward, lambda *a, **k: graph_forward(gm, *a, **k), gm, args, kwargs)
            if shared_key is not None:
                self.shared[shared_key] = choice
        self.choices[key] = choice
        log.info("block %s runs its %s", self.path or "<root>", choice)
        return choice


def install(cls: type[nn.Module]) -> None:
    """Route `cls.forward` (a compiled block's class) through the block's keeper, where compile attached one."""
    graph_forward = cls.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        keeper = self.__dict__.get(KEEPER)
        if keeper is not None and not watched():
            own = keeper.forward_for(self, graph_forward, args, kwargs)
            if own is not None:
                return own(*args, **kwargs)
        return graph_forward(self, *args, **kwargs)

    forward.__wrapped__ = graph_forward  # type: ignore[attr-defined]  # inspect.signature sees the graph's inputs
    cls.forward = forward  # type: ignore[method-assign]


def attach(gm: nn.Module, block: nn.Module, path: str, structure: Hashable | None,
           shared: dict[Hashable, Choice]) -> Keeper:
    """Give compiled block `gm` the user's `block` to choose from (they then share their state tables)."""
    keeper = Keeper(gm, block, path, structure, shared)
    gm.__dict__[KEEPER] = keeper
    return keeper


def choices(gm: nn.Module) -> dict[Hashable, Choice]:
    """What each input signature `gm` has seen runs (empty where it has no keeper or has not run)."""
    keeper = gm.__dict__.get(KEEPER)
    return {} if keeper is None else dict(keeper.choices)
