"""Shared code generation helpers for the Triton kernel families in `lowering/`.

Every family writes its kernels as Python source *generated from a template* specialised to one
spec (E, K, group sizes, score function, dtypes baked in as literals / `tl.constexpr`), loads it with
`load_kernel_module`, and checks that it also builds for a real GPU with `build_for_gpu`.

API (stable; every family relies on it):

    triton_available() -> bool                 Triton importable at all
    is_interpreted() -> bool                   TRITON_INTERPRET is on (kernels run on CPU tensors)
    launch_blocker(device) -> str | None       why a Triton launch on `device` is impossible, else None
    source_key(source) -> str                  short content hash used in module / file names
    cache_dir() -> Path                        where generated sources are written
    load_kernel_module(source, name) -> module write `source` to the cache (keyed by its hash), execute the
                                               verified bytes (`exec_verified`); `KernelCacheError` if unsafe
    build_for_gpu(kernel_fn, signature, constexprs, arch, num_warps=4, num_stages=3) -> BuildReport
                                               compile to PTX + cubin for sm_<arch> without a GPU
    build_many([BuildRequest]) -> list[BuildReport]  several builds in one child process (faster)
    resource_usage(cubin_bytes) -> dict        parsed `cuobjdump --dump-resource-usage`
    ROUND_BF16_SOURCE                          @triton.jit `round_bf16(x)` helper source (interpreter truncates bf16 casts)
    SHARED_LIMIT_BYTES[arch]                   opt-in shared memory per block (sm_80 163 KiB, sm_90 227 KiB)
    shared_limit_bytes(arch) -> int            SHARED_LIMIT_BYTES[arch], 48 KiB for an arch not listed
    build_module(module, arch) -> list[BuildReport]  build every kernel a generated module lists in `GPU_BUILDS`
    module_requests(module, arch) / build_request(module, entry, arch)  the `BuildRequest`s of `GPU_BUILDS`
    render(template, **values) -> str          `string.Template` substitution ($NAME), every name required
    rounding_helpers(**{name: dtype}) -> str   @triton.jit helpers rounding fp32 to a dtype's precision
    SIG_DTYPES / TL_DTYPES                     torch dtype -> Triton signature string / `tl.` dtype name
    FLOAT_DTYPES                               the floating dtypes the kernels take (fp32, fp16, bf16)
    next_pow2(n), cdiv(a, b) -> int            host-side integer helpers (no constexpr unwrapping per call)
    register_autocast(op, policy)              autocast dtype policy of a lowered op: "fp32", "compute", "preserve"

Generated-module convention: a module lists its kernels for the GPU build check as
`GPU_BUILDS = [dict(kernel="name", signature={...}, constexprs={...}, num_warps=4), ...]` (optional
`num_stages`, `divisible`; other keys are the family's own, e.g. the grouped GEMM's `role`); the
signature uses Triton type strings for the dtypes this specialisation was generated for.

Cache: a directory private to the user: `$MOEPASS_KERNEL_CACHE` if set, else
`$XDG_CACHE_HOME/moepass/kernels` (`~/.cache/moepass/kernels`), created 0700 and refused
(`KernelCacheError`) if another user owns it or it is group- or world-writable; only if the default
cannot be created does a process use a fresh `mkdtemp` directory of its own. A source is written there
through a private temp file and `os.replace`, read back, and executed from the bytes whose SHA-256
matched (`exec_verified`; a file changed in between is refused, not run); Triton reads the kernels'
source from those same verified lines. A module is executed once per (source hash, interpret mode) per
process: `@triton.jit` reads TRITON_INTERPRET when the module runs, so both modes get their own copy.

The GPU build always constructs a `triton.runtime.jit.JITFunction` from the kernel's Python
function, whatever TRITON_INTERPRET says, and does so in a child process with TRITON_INTERPRET=0
(see `build_many` for why an in-process build after interpreted launches breaks).

Interpreter caveat (triton 3.7.1): casting fp32 -> bf16 inside a kernel *truncates* under
TRITON_INTERPRET while GPUs and torch round to nearest even. `ROUND_BF16_SOURCE` is a @triton.jit
helper (`round_bf16`) that rounds explicitly; generated kernels paste it and use it before every
bf16 store so interpreted and compiled kernels agree with torch bit for bit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib.abc
import importlib.util
import json
import linecache
import os
import re
import shutil
import stat
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from moepass import process_state

# Autocast policy of lowered ops: the dialect's registration (same policies as the ops they replace).
from moepass.dialect import register_autocast  # noqa: F401

KiB = 1024
# Maximum dynamic shared memory per block after opt-in (CUDA programming guide, compute capabilities).
SHARED_LIMIT_BYTES = {80: 163 * KiB, 86: 99 * KiB, 89: 99 * KiB, 90: 227 * KiB}
PACKAGE = "moepass_kernels"  # sys.modules prefix of generated kernel modules
# op name (route, permute, unpermute_combine, ...) -> launches that fell back to the torch reference (a device
# Triton cannot run on): the process's counter, `moepass.process_state.KERNEL_FALLBACKS`
FALLBACKS = process_state.KERNEL_FALLBACKS

# A @triton.jit helper pasted into generated sources (see the module docstring).
ROUND_BF16_SOURCE = '''
@triton.jit
def round_bf16(x):
    """fp32 -> the nearest-even bf16 value, still fp32 (NaN kept as NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
'''

SIG_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
              torch.int32: "i32"}
TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
             torch.int64: "tl.int64", torch.int32: "tl.int32"}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of two ints: `triton.cdiv` without its constexpr unwrapping (host code runs it per launch)."""
    return -(-a // b)


def render(template: str, /, **values: Any) -> str:
    """Fill `$NAME` placeholders (a missing value raises KeyError, so nothing is left unfilled)."""
    return string.Template(template).substitute({k: str(v) for k, v in values.items()})


def rounding_helpers(**dtypes: torch.dtype) -> str:
    """@triton.jit helpers `name(x)` rounding fp32 `x` to each dtype's precision (result still fp32).

    Kernels compute in fp32 and call these where torch's reference rounds (it computes in the
    tensors' dtype), so e.g. experts chosen from rounded bf16 scores agree with torch. Example:
    `rounding_helpers(round_l=torch.bfloat16)` defines `round_bf16` and `round_l`.
    """
    bodies = {torch.float32: "x", torch.float16: "x.to(tl.float16).to(tl.float32)", torch.bfloat16: "round_bf16(x)"}
    parts = [ROUND_BF16_SOURCE] if torch.bfloat16 in dtypes.values() else []
    for name, dtype in dtypes.items():
        if dtype not in bodies:
            raise ValueError(f"rounding_helpers: {name} has unsupported dtype {dtype}")
        parts.append(f"\n@triton.jit\ndef {name}(x):  # round to {dtype}\n    return {bodies[dtype]}\n")
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# Environment: is Triton there, is it interpreted, can it launch on this device.
# ----------------------------------------------------------------------------------------------


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_build_blocker() -> str | None:
    """Why a compile-only GPU build (`build_many`: PTX and cubin with the ptxas and cuobjdump that ship with
    triton) cannot run on this machine; None when it can."""
    if not triton_available():
        return "triton is not importable"
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [tool for tool in ("ptxas", "cuobjdump") if not (bin_dir / tool).exists()]
    return f"triton ships no {missing} in {bin_dir}" if missing else None


def is_interpreted() -> bool:
    """True when TRITON_INTERPRET is on: kernels then run on CPU tensors (and only on them)."""
    if not triton_available():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def launch_blocker(device: Any) -> str | None:
    """Why a Triton kernel cannot launch on tensors of `device`, or None if it can.

    Works on fake tensors' devices too (it never touches data).
    """
    if not triton_available():
        return "triton is not importable"
    kind = getattr(device, "type", str(device))
    if is_interpreted():
        if kind != "cpu":
            return f"TRITON_INTERPRET=1 runs kernels on CPU tensors only, got device {kind}"
        return None
    if kind == "cpu":
        return "tensors on CPU and TRITON_INTERPRET is off (no Triton CPU backend)"
    if kind != "cuda":
        return f"no Triton backend for device {kind}"
    return None


# ----------------------------------------------------------------------------------------------
# Generated source -> module.
# ----------------------------------------------------------------------------------------------


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


class KernelCacheError(PermissionError):
    """The kernel cache directory is not private to this user, or a cached file changed after it was written."""


def cache_dir() -> Path:
    """The private directory generated sources are written to (see "Cache" in the module doc).

    `$MOEPASS_KERNEL_CACHE` if set, else `$XDG_CACHE_HOME/moepass/kernels` (`~/.cache/moepass/kernels`).
    Created 0700; an existing one must belong to this user and not be group- or world-writable, else
    `KernelCacheError`. Only when the default cannot be created at all (a read-only home) does this
    process use a fresh private temp directory of its own (`tempfile.mkdtemp`: random name, 0700) -- never
    a fixed shared path.
    """
    chosen = os.environ.get("MOEPASS_KERNEL_CACHE")
    if chosen:
        return private_dir(Path(chosen), "MOEPASS_KERNEL_CACHE")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    try:
        return private_dir(Path(base) / "moepass" / "kernels", "the default kernel cache")
    except KernelCacheError:
        raise
    except OSError:
        return process_state.KERNEL_FALLBACK_DIR.get(_temp_kernel_dir)  # made once per process


def _temp_kernel_dir() -> Path:
    """A fresh private temp directory (`tempfile.mkdtemp`: random name, 0700), removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="moepass-kernels-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # nothing reuses it after this process
    return path


def private_dir(path: Path, what: str) -> Path:
    """`path` resolved, created 0700 if missing; `KernelCacheError` if another user owns it or others may
    write to it (they could plant or swap the generated sources this process executes)."""
    path = path.expanduser().resolve()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise KernelCacheError(f"{what} {str(path)!r} is not a directory: set MOEPASS_KERNEL_CACHE to a directory "
                               f"of your own")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelCacheError(f"{what} {str(path)!r} belongs to uid {st.st_uid}, not to this user (uid "
                               f"{os.getuid()}): generated kernels are executed from it, so it must be yours; set "
                               f"MOEPASS_KERNEL_CACHE to a directory you own (mode 0700)")
    if st.st_mode & 0o022:
        raise KernelCacheError(f"{what} {str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}: group- or "
                               f"world-writable, so other users could swap the generated kernels executed from it; "
                               f"run `chmod 700 {path}` or set MOEPASS_KERNEL_CACHE to a private directory")
    return path


class VerifiedSource(importlib.abc.InspectLoader):
    """The `__loader__` of a generated module: its source is the verified text, whatever is on disk now."""

    def __init__(self, text: str):
        self.text = text

    def get_source(self, fullname: str) -> str:
        return self.text


def exec_verified(module_name: str, path: Path, data: bytes, sha256: str) -> ModuleType:
    """Execute `data` as module `module_name` (file name `path`) if its SHA-256 is `sha256`.

    The file is never imported: the bytes whose hash was checked are compiled and run, and the
    verified lines are pinned in `linecache` under `path` (mtime None: `linecache.checkcache` leaves
    such entries alone), so what `inspect.getsource` hands to Triton's `@jit` (the GPU compiler and the
    interpreter both re-read the kernel's source) is that text too, even if the file changes later.
    """
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise KernelCacheError(f"kernel cache file {str(path)!r} changed after it was written (sha256 {got[:16]}, "
                               f"expected {sha256[:16]}): something else writes to the cache directory; it was not "
                               f"executed. Delete the file and check who can write to {str(path.parent)!r}")
    text = data.decode()
    linecache.cache[str(path)] = (len(data), None, text.splitlines(keepends=True), str(path))
    module = ModuleType(module_name)
    module.__file__ = str(path)
    module.__loader__ = VerifiedSource(text)
    module.MOEPASS_SOURCE_SHA256 = sha256  # type: ignore[attr-defined]  # BuildRequest checks the file with it
    sys.modules[module_name] = module  # dataclasses / triton look modules up by name
    try:
        exec(compile(data, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def write_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through a private temp file in the same directory (mode 0600) and `os.replace`:
    parallel processes never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_kernel_module(source: str, name: str) -> ModuleType:
    """Write `source` to `<cache_dir>/<name>_<hash>.py` (once) and execute it as a module.

    `name` is a readable prefix (e.g. "gating"); the content hash makes the file unique per
    specialisation. Triton needs the kernels to live in a real file (it reads their source with
    `inspect`), which is why the source is written out; what runs is the file's bytes read back and
    checked against the source's SHA-256 (`exec_verified`), never a file imported by name.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"load_kernel_module: name {name!r} must be a Python identifier")
    data = source.encode()
    sha256 = hashlib.sha256(data).hexdigest()
    key = sha256[:16]  # = source_key(source)
    interpreted = is_interpreted()
    cached = process_state.KERNEL_MODULES.get((sha256, interpreted))
    if cached is not None:
        return cached
    path = cache_dir() / f"{name}_{key}.py"
    try:
        current = path.read_bytes()
    except FileNotFoundError:
        current = None
    if current != data:
        write_atomic(path, data)
        current = path.read_bytes()
    module_name = f"{PACKAGE}.{name}_{key}{'_interp' if interpreted else ''}"
    module = exec_verified(module_name, path, current, sha256)
    process_state.KERNEL_MODULES[(sha256, interpreted)] = module
    return module


# ----------------------------------------------------------------------------------------------
# Compile-only GPU build check.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildReport:
    name: str
    arch: int
    num_warps: int
    ptx_bytes: int
    cubin_bytes: int
    registers: int  # per thread
    local_bytes: int  # local memory per thread (register spills and stack arrays)
    stack_bytes: int
    shared_bytes: int  # per block: Triton's dynamic shared memory + static shared memory
    seconds: float
    usage: dict[str, int] = field(default_factory=dict)  # the raw cuobjdump fields

    @property
    def shared_limit_bytes(self) -> int:
        return shared_limit_bytes(self.arch)

    def problems(self) -> list[str]:
        """What would make this kernel a bad GPU kernel (spills, too much shared memory)."""
        out = []
        if self.local_bytes or self.stack_bytes:
            out.append(f"{self.name} sm_{self.arch}: {self.local_bytes} B local / {self.stack_bytes} B stack "
                       f"per thread (register spills)")
        if self.shared_bytes > self.shared_limit_bytes:
            out.append(f"{self.name} sm_{self.arch}: {self.shared_bytes} B shared memory > limit "
                       f"{self.shared_limit_bytes} B")
        return out


def shared_limit_bytes(arch: int) -> int:
    """Opt-in shared memory per block of sm_<arch>; 48 KiB (the limit without opt-in) if not listed."""
    return SHARED_LIMIT_BYTES.get(arch, 48 * KiB)


def unwrap(kernel_fn: Any) -> Any:
    """The plain Python function under @triton.jit / InterpretedFunction / @triton.heuristics."""
    fn = kernel_fn
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def cuobjdump_path() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else "cuobjdump"


def resource_usage(cubin_bytes: bytes) -> dict[str, dict[str, int]]:
    """Per-function resource usage of a cubin: {function: {"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..}}.

    Parses `cuobjdump --dump-resource-usage`, e.g.
    ` Function add_kernel:\\n  REG:10 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 ...`.
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin_bytes)
        path = f.name
    try:
        text = subprocess.run([cuobjdump_path(), "--dump-resource-usage", path], check=True, capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(path)
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"\s*Function (\S+):", line)
        if head:
            current = head.group(1)
            usage[current] = {}
        elif current is not None and "REG:" in line:
            usage[current].update({k: int(v) for k, v in re.findall(r"([A-Z_\[\]0-9]+):(\d+)", line)})
    return usage


@dataclass(frozen=True)
class BuildRequest:
    """One kernel to build: it must be a module-level @triton.jit function of a file on disk.

    Constexpr values are JSON scalars; a string "tl.<name>" (e.g. "tl.bfloat16") stands for that
    `triton.language` attribute. `divisible` names parameters (pointers or ints) the build may assume
    divisible by 16 -- what a launch specialises to for 16-byte aligned tensors / multiples of 16
    (`tt.divisibility` = 16); without it loads cannot be vectorised as they are on the GPU.
    """

    path: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    arch: int
    num_warps: int = 4
    num_stages: int = 3
    divisible: tuple[str, ...] = ()
    sha256: str = ""  # a generated module's source hash: the build checks the file's bytes against it

    @classmethod
    def of(cls, kernel_fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int,
           num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] = ()) -> BuildRequest:
        raw = unwrap(kernel_fn)
        return cls(raw.__code__.co_filename, raw.__name__, dict(signature), dict(constexprs), arch, num_warps,
                   num_stages, tuple(divisible), raw.__globals__.get("MOEPASS_SOURCE_SHA256", ""))


def build_for_gpu(
    kernel_fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
) -> BuildReport:
    """Compile one kernel for `sm_<arch>` (no GPU needed) and read its resource usage.

    `signature` maps each non-constexpr parameter to a Triton type string ("*fp32", "*i64", "i32",
    ...); parameters named in `constexprs` get "constexpr" automatically. Several kernels: use
    `build_many` (one child process for all).
    """
    return build_many([BuildRequest.of(kernel_fn, signature, constexprs, arch, num_warps, num_stages)])[0]


def build_module(module: ModuleType, arch: int) -> list[BuildReport]:
    """Build every kernel a generated module lists in `GPU_BUILDS` for sm_<arch>."""
    return build_many(module_requests(module, arch))


def module_requests(module: ModuleType, arch: int) -> list[BuildRequest]:
    """Build requests for a generated module's `GPU_BUILDS`."""
    return [build_request(module, entry, arch) for entry in module.GPU_BUILDS]


def build_request(module: ModuleType, entry: dict[str, Any], arch: int) -> BuildRequest:
    """The request for one `GPU_BUILDS` entry of `module`; pointers count as 16-byte aligned (torch
    allocations are) unless the entry lists its own `divisible`."""
    pointers = tuple(k for k, v in entry["signature"].items() if v.startswith("*"))
    return BuildRequest.of(getattr(module, entry["kernel"]), entry["signature"], entry["constexprs"], arch,
                           entry.get("num_warps", 4), entry.get("num_stages", 3), entry.get("divisible", pointers))


def build_many(requests: list[BuildRequest]) -> list[BuildReport]:
    """Build kernels in ONE child process with TRITON_INTERPRET=0.

    Why a child process: under TRITON_INTERPRET=1 `@triton.jit` (including triton.language's own
    `tl.sum`, `tl.max`, `tl.sigmoid`, ...) yields InterpretedFunctions, parts of the code generator
    branch on the interpret knob, and (triton 3.7.1) every interpreted call of a @jit helper patches
    `triton.language` for the interpreter without undoing it -- after one interpreted launch an
    in-process GPU build fails ("'ir.value' object has no attribute 'dtype'"). A clean process
    imports triton for compilation only. Cost: ~2 s start-up per call, so batch the requests.
    """
    if not requests:
        return []
    env = dict(os.environ, TRITON_INTERPRET="0")
    payload = json.dumps([dataclasses.asdict(r) for r in requests])
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "lowering.codegen", "--build"], input=payload, text=True,
                          capture_output=True, env=env, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"GPU build child process failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    reports = []
    for request, result in zip(requests, json.loads(done.stdout.splitlines()[-1])):
        if "error" in result:
            raise RuntimeError(f"building {request.kernel} ({request.path}) for sm_{request.arch} failed:\n"
                               f"{result['error']}")
        reports.append(BuildReport(**result))
    return reports


def _build_here(request: BuildRequest) -> BuildReport:
    """Compile in this process (the child of `build_many`; TRITON_INTERPRET must be off)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    assert not triton.knobs.runtime.interpret, "GPU builds need TRITON_INTERPRET=0"
    module_name = f"{PACKAGE}._build_.{Path(request.path).stem}"
    if request.sha256:  # a generated module: run the bytes that match its hash, as load_kernel_module does
        path = Path(request.path)
        module = exec_verified(module_name, path, path.read_bytes(), request.sha256)
    else:
        spec = importlib.util.spec_from_file_location(module_name, request.path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {request.path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    jit_fn = JITFunction(unwrap(getattr(module, request.kernel)))
    constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                  for k, v in request.constexprs.items()}
    full_sig = {name: ("constexpr" if name in constexprs else request.signature[name]) for name in jit_fn.arg_names}
    attrs = {(jit_fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in request.divisible}
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn=jit_fn, signature=full_sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", request.arch, 32),
        options={"num_warps": request.num_warps, "num_stages": request.num_stages},
    )
    seconds = time.perf_counter() - start
    cubin = compiled.asm["cubin"]
    usage_by_fn = resource_usage(cubin)
    usage = usage_by_fn.get(compiled.metadata.name) or next(iter(usage_by_fn.values()), {})
    return BuildReport(
        name=compiled.metadata.name,
        arch=request.arch,
        num_warps=request.num_warps,
        ptx_bytes=len(compiled.asm["ptx"]),
        cubin_bytes=len(cubin),
        registers=usage.get("REG", 0),
        local_bytes=usage.get("LOCAL", 0),
        stack_bytes=usage.get("STACK", 0),
        shared_bytes=int(compiled.metadata.shared) + usage.get("SHARED", 0),
        seconds=seconds,
        usage=usage,
    )


def _child_main() -> None:
    import traceback

    results = []
    for fields in json.loads(sys.stdin.read()):
        try:
            results.append(dataclasses.asdict(_build_here(BuildRequest(**fields))))
        except Exception:  # reported to the parent, which raises with the kernel's name
            results.append({"error": traceback.format_exc()})
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--build"]:
    _child_main()
