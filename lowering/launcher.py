"""Launching a Triton kernel with the fewest host steps: `launcher(kernel)[grid](*args, **constexprs)`.

`kernel[grid](...)` re-derives on every call what a model's steps never change: it reads Triton's knobs from the
environment, binds and specialises every argument, looks up the autotuner's cache and the jit cache, checks the
kernel's globals and builds the launch metadata. On an H100 (triton 3.6) moepass's `single` form made 2,500-3,000
Python calls per forward + backward at the layer case, against 95-382 for the untouched blocks, and the GPU waited
for the host; launching directly took 35 -> 17 us per autotuned launch and ~590 calls off a step
(benchmarks/results/gpu/README.md, session 4).

A `Launcher` goes through Triton's own path the first time it sees a *launch signature* and keeps the
`CompiledKernel` that call returned (and, for an autotuner, the config it picked); later launches with the same
signature call the compiled kernel's launcher directly with the arguments Triton itself would pass it (every
parameter in order, the constexprs included, which the launcher skips). The signature is the current device, each
keyword argument, each tensor's dtype and 16-byte alignment, each int's value class (1, a multiple of 16, 32-bit or
not: what Triton specialises on), a float as a float (an fp32 argument: never specialised, so a value that changes
every step reuses one entry), any other argument's value, and the exact value of every argument the autotuner
keys on: strictly finer than Triton's specialisation and autotune keys, so the cached kernel is the one Triton
would have launched. A grid callable is given the meta-parameters (the keyword constexprs and the autotuned
config), which is all moepass's grids read.

Triton's path is taken every time when interpreted (`TRITON_INTERPRET=1`: no compiled kernel), when a launch hook
is installed (profilers such as proton: the direct launch would skip it), when the kernel runs a hook before each
launch (a config's `pre_hook`, the jit function's `pre_run_hooks`), when the compiled kernel does not carry
the launcher this module calls (another Triton version), or with `MOEPASS_PLAIN_TRITON_LAUNCH=1` (A/B timing).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moepass.envflags import flag

Grid = Sequence[int] | Callable[[dict[str, Any]], Sequence[int]]
INT32 = (-(2**31), 2**31)


def arg_class(value: Any) -> Any:
    """What Triton specialises a launch argument on (dtype and alignment of a tensor, the class of an int)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value == 1, value % 16 == 0, INT32[0] <= value < INT32[1]
    if isinstance(value, float):
        return float
    return value


class Launcher:
    """Launches one jit kernel or autotuner; see the module doc."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct = direct_launch_available()
        # launch signature -> (launcher, function, packed metadata, meta-parameters, the parameters after args)
        self.compiled: dict[tuple, tuple] = {}
        self.lock = threading.Lock()  # first launches of a signature (autograd may launch from its own threads)
        if not self.direct:
            return
        self.arg_names: list[str] = list(kernel.arg_names)
        base = kernel
        while not hasattr(base, "params"):  # an autotuner (or heuristics) wraps the JITFunction as .fn
            base = base.fn
        self.base = base
        self.defaults = {p.name: p.default for p in base.params if p.default is not inspect.Parameter.empty}
        self.tuning_keys = [self.arg_names.index(name) for name in getattr(kernel, "keys", ())]
        self.current_device, self.current_stream = device_and_stream()

    def __getitem__(self, grid: Grid) -> Callable[..., None]:
        return functools.partial(self.run, grid)

    def signature(self, device: int, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """(device, arg_class of each argument, the autotune key's values, the keyword arguments). Writing
        arg_class out in a loop measured 3.2 against 3.8 us for 21 arguments: not worth the second copy."""
        return (device, *[arg_class(a) for a in args], *[args[i] for i in self.tuning_keys if i < len(args)],
                *kwargs.items())

    def run(self, grid: Grid, *args: Any, **kwargs: Any) -> None:
        if not self.direct:
            self.kernel[grid](*args, **kwargs)
            return
        device = self.current_device()
        key = self.signature(device, args, kwargs)
        entry = self.compiled.get(key)
        if entry is None:
            with self.lock:  # an autotuner's best_config belongs to the call that set it
                self.remember(key, self.kernel[grid](*args, **kwargs), args, kwargs)
            return
        launch, function, packed, meta, tail = entry
        g = grid(meta) if callable(grid) else grid
        launch(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, self.current_stream(device), function,
               packed, None, None, None, *args, *tail)

    def remember(self, key: tuple, compiled: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Keep what the direct launch needs from the kernel Triton just launched, if it can be launched directly."""
        config = getattr(self.kernel, "best_config", None)
        meta = {**self.defaults, **kwargs, **(config.kwargs if config is not None else {})}
        tail = self.arg_names[len(args):]
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        per_launch_hooks = getattr(config, "pre_hook", None) is not None or bool(getattr(self.base, "pre_run_hooks", ()))
        if (signature is None or len(signature) != len(self.arg_names) or not hasattr(compiled, "packed_metadata")
                or any(name not in meta for name in tail) or per_launch_hooks or launch_hooks_installed()):
            return
        self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, meta,
                              tuple(meta[name] for name in tail))


def direct_launch_available() -> bool:
    """Compiled kernels (not the interpreter) and not switched off by MOEPASS_PLAIN_TRITON_LAUNCH."""
    from triton import knobs

    return not knobs.runtime.interpret and not flag("MOEPASS_PLAIN_TRITON_LAUNCH")


def device_and_stream() -> tuple[Callable[[], int], Callable[[int], int]]:
    """Triton's active driver's `current device` and `current stream of a device` (what its own launch calls)."""
    from triton.runtime import driver

    return driver.active.get_current_device, driver.active.get_current_stream


def launch_hooks_installed() -> bool:
    """A launch enter or exit hook is set (a function, or a non-empty hook chain as triton 3.7 keeps them)."""
    from triton import knobs

    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


@functools.cache
def launcher(kernel: Any) -> Launcher:
    """The one `Launcher` of `kernel` (a jit function or an autotuner), made on first use."""
    return Launcher(kernel)


__all__ = ["Launcher", "arg_class", "device_and_stream", "direct_launch_available", "launch_hooks_installed", "launcher"]
