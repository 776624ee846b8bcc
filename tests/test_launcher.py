"""lowering.launcher: Triton's path once per launch signature, the compiled kernel's launcher after (issue 29, item 8).

The direct launch needs a compiled GPU kernel; here a stand-in kernel records what each path was called with, and
the tests check which path ran and the exact arguments the direct launch passes (Triton's launcher order: grid,
stream, function, packed metadata, launch metadata and hooks, then every parameter, constexprs included). The
kernels themselves go through `launcher` in every kernel test (interpreted: always Triton's path) and on a GPU
in `python -m moepass selfcheck`.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from lowering import launcher as launcher_module
from lowering.launcher import Launcher, arg_class

NAMES = ("x_ptr", "out_ptr", "N", "D", "BLOCK", "EVEN")  # BLOCK, EVEN: constexprs; EVEN defaults to True


class Compiled:
    """A CompiledKernel's launch surface: `run` (the launcher), `function`, `packed_metadata`, `src.signature`."""

    def __init__(self, names=NAMES):
        self.src = SimpleNamespace(signature={name: "?" for name in names})
        self.function, self.packed_metadata = "cu_function", "packed"
        self.launches: list[tuple] = []

    def run(self, *args):
        self.launches.append(args)


class Jit:
    """A JITFunction: `arg_names`, `params` (name, default) and `kernel[grid](...)` returning the compiled kernel."""

    def __init__(self, compiled=None):
        self.arg_names = list(NAMES)
        self.params = [SimpleNamespace(name=n, default=True if n == "EVEN" else inspect.Parameter.empty) for n in NAMES]
        self.compiled = compiled or Compiled()
        self.triton_calls: list[tuple] = []

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self.compiled
        return runner


class Autotuner:
    """An autotuner over `Jit`: keyed on D, its chosen config's BLOCK as `best_config.kwargs`."""

    def __init__(self):
        self.fn = Jit()
        self.arg_names, self.keys = self.fn.arg_names, ["D"]
        self.best_config = None
        self.compiled = self.fn.compiled
        self.config_pre_hook = None  # what each chosen config's pre_hook is

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.best_config = SimpleNamespace(kwargs={"BLOCK": 64 if args[3] <= 64 else 128},
                                               pre_hook=self.config_pre_hook)
            return self.fn[grid](*args, **kwargs, **self.best_config.kwargs)
        return runner


@pytest.fixture
def direct(monkeypatch):
    """As on a GPU: compiled kernels, device 0, stream 7 (the driver's raw stream handle)."""
    monkeypatch.setattr(launcher_module, "direct_launch_available", lambda: True)
    monkeypatch.setattr(launcher_module, "device_and_stream", lambda: (lambda: 0, lambda device: 7))


def tensors(n=8):
    return torch.zeros(n), torch.zeros(n)


def test_second_launch_goes_direct_with_every_parameter_in_order(direct):
    kernel = Jit()
    launch = Launcher(kernel)
    x, out = tensors()
    grids = []
    grid = lambda meta: grids.append(dict(meta)) or (meta["N_TILES"] if "N_TILES" in meta else 3, 2)  # noqa: E731
    launch[grid](x, out, 8, 32, BLOCK=16)
    assert len(kernel.triton_calls) == 1 and kernel.compiled.launches == []
    launch[grid](x, out, 8, 32, BLOCK=16)
    assert len(kernel.triton_calls) == 1, "the same signature went through Triton again"
    assert kernel.compiled.launches == [(3, 2, 1, 7, "cu_function", "packed", None, None, None, x, out, 8, 32, 16, True)]
    assert grids == [{"EVEN": True, "BLOCK": 16}], "the direct launch's grid reads the meta-parameters"


def test_a_tuple_grid_is_padded_to_three_dimensions(direct):
    kernel = Jit()
    launch = Launcher(kernel)
    x, out = tensors()
    for _ in range(2):
        launch[(5,)](x, out, 8, 32, BLOCK=16, EVEN=False)
    assert kernel.compiled.launches == [(5, 1, 1, 7, "cu_function", "packed", None, None, None, x, out, 8, 32, 16, False)]


@pytest.mark.parametrize("change, new_path", [
    (dict(N=24), False),          # 8 -> 24: both neither 1 nor a multiple of 16, 32-bit: the same specialisation
    (dict(N=16), True),           # a multiple of 16: Triton specialises on it
    (dict(N=1), True),            # 1: a constexpr for Triton
    (dict(N=2**31), True),        # past 32 bits: i64
    (dict(x=torch.zeros(9)[1:]), True),                    # not 16-byte aligned
    (dict(x=torch.zeros(8, dtype=torch.float64)), True),   # another dtype
    (dict(BLOCK=32), True),       # a constexpr's value
])
def test_a_launch_signature_finer_than_tritons_specialisation(direct, change, new_path):
    kernel = Jit()
    launch = Launcher(kernel)
    x, out = tensors()
    base = dict(x=x, N=8, BLOCK=16)
    launch[(1,)](base["x"], out, base["N"], 32, BLOCK=base["BLOCK"])
    changed = {**base, **change}
    launch[(1,)](changed["x"], out, changed["N"], 32, BLOCK=changed["BLOCK"])
    assert len(kernel.triton_calls) == (2 if new_path else 1)
    assert len(kernel.compiled.launches) == (0 if new_path else 1)


def test_an_autotuner_keys_on_exact_values_and_launches_its_chosen_config(direct):
    kernel = Autotuner()
    launch = Launcher(kernel)
    x, out = tensors()
    grid = lambda meta: (meta["BLOCK"],)  # noqa: E731
    launch[grid](x, out, 8, 64)
    launch[grid](x, out, 8, 64)
    launch[grid](x, out, 8, 80)   # 64 -> 80: the same int class, another autotune key
    assert len(kernel.fn.triton_calls) == 2
    launch[grid](x, out, 8, 80)
    assert [c[:3] + c[9:] for c in kernel.compiled.launches] == [
        (64, 1, 1, x, out, 8, 64, 64, True), (128, 1, 1, x, out, 8, 80, 128, True)]


def test_triton_path_every_time_when_interpreted_or_switched_off(monkeypatch):
    kernel = Jit()
    monkeypatch.setenv("MOEPASS_PLAIN_TRITON_LAUNCH", "1")
    launch = Launcher(kernel)
    x, out = tensors()
    for _ in range(3):
        launch[(1,)](x, out, 8, 32, BLOCK=16)
    assert len(kernel.triton_calls) == 3 and kernel.compiled.launches == []


@pytest.mark.parametrize("why", ["launch hook", "other launcher signature", "no compiled kernel", "pre-run hook"])
def test_not_remembered_when_the_direct_launch_would_differ(direct, monkeypatch, why):
    kernel = Jit(Compiled(NAMES[:-2]) if why == "other launcher signature" else None)
    if why == "launch hook":
        monkeypatch.setattr(launcher_module, "launch_hooks_installed", lambda: True)
    if why == "no compiled kernel":
        kernel.compiled = None
    if why == "pre-run hook":
        kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    launch = Launcher(kernel)
    x, out = tensors()
    for _ in range(2):
        launch[(1,)](x, out, 8, 32, BLOCK=16)
    assert len(kernel.triton_calls) == 2


def test_arg_class():
    assert arg_class(torch.zeros(4)) == (torch.float32, True)
    assert arg_class(torch.zeros(5)[1:]) == (torch.float32, False)
    assert arg_class(1) == (True, False, True) and arg_class(32) == (False, True, True)
    assert arg_class(True) is True and arg_class(0.5) is float and arg_class(None) is None


def test_real_kernels_launch_through_it():
    """Every generated kernel module and the grouped GEMM call `launcher(kernel)[grid]`, not `kernel[grid]`."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lowering"
    bare = [f"{path.name}: {line.strip()}" for path in root.rglob("*.py") if path.name != "launcher.py"
            for line in path.read_text().splitlines() if re.match(r"\s+\w*kernel\w*\[[^\]]", line)]
    assert bare == []


def test_launch_hooks_installed_reads_a_hook_chain_or_a_function(monkeypatch):
    from triton import knobs

    assert not launcher_module.launch_hooks_installed()
    hook = lambda metadata: None  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # triton >= 3.7: hook chains
        chain.add(hook)
        try:
            assert launcher_module.launch_hooks_installed()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert launcher_module.launch_hooks_installed()
    assert not launcher_module.launch_hooks_installed()


def test_signature_is_arg_class_of_each_argument_then_the_tuning_keys_and_keywords(direct):
    kernel = Autotuner()
    launch = Launcher(kernel)
    x = torch.zeros(9)[1:]
    args = (x, torch.nn.Parameter(torch.zeros(4)), 1, 48, 2**40, 0.5, True, None)
    kernel.arg_names = ["a", "b", "c", "D", "e", "f", "g", "h"]
    launch.tuning_keys = [3]
    assert launch.signature(0, args, {"BLOCK": 16}) == (0, *map(arg_class, args), 48, ("BLOCK", 16))


def test_an_autotuner_config_with_a_pre_hook_is_never_launched_directly(direct):
    kernel = Autotuner()
    kernel.config_pre_hook = lambda nargs: None
    launch = Launcher(kernel)
    x, out = tensors()
    for _ in range(2):
        launch[(1,)](x, out, 8, 64)
    assert len(kernel.fn.triton_calls) == 2 and kernel.compiled.launches == []


def test_a_float_that_changes_every_launch_reuses_one_entry_and_is_passed_as_given(direct):
    kernel = Jit()
    launch = Launcher(kernel)
    x, out = tensors()
    for scale in (0.5, 0.25, 0.125):
        launch[(1,)](x, out, 8, scale, BLOCK=16)
    assert len(kernel.triton_calls) == 1 and len(launch.compiled) == 1
    assert [c[12] for c in kernel.compiled.launches] == [0.25, 0.125]
