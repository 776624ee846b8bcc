"""The generated-kernel cache (`lowering.codegen`): a directory private to the user, and only the bytes
whose SHA-256 was checked are executed (or handed to Triton as the kernel's source).

The kernel here is a one-line interpreted Triton kernel (`x += DELTA`); "evil" twins add 100 instead,
or set a flag on import, so a test sees which bytes ran.
"""

from __future__ import annotations

import builtins
import inspect
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from lowering import codegen as cg
from moepass import process_state

SOURCE = '''
import triton
import triton.language as tl

DELTA = 1.0


@triton.jit
def add_delta(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)
'''
EVIL = SOURCE.replace("+ 1.0", "+ 100.0").replace("DELTA = 1.0", "import builtins\nbuiltins.MOEPASS_EVIL_RAN = True")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory and an empty in-process module table."""
    root = tmp_path / "kernels"
    monkeypatch.setenv("MOEPASS_KERNEL_CACHE", str(root))
    monkeypatch.setattr(process_state, "KERNEL_MODULES", {})
    monkeypatch.delattr(builtins, "MOEPASS_EVIL_RAN", raising=False)
    yield root
    for name in [n for n in sys.modules if n.startswith(f"{cg.PACKAGE}.cachetest")]:
        del sys.modules[name]


def run_kernel(module) -> torch.Tensor:
    x = torch.zeros(8)
    module.add_delta[(1,)](x, 8, BLOCK=8)
    return x


def test_the_directory_is_created_0700(cache):
    module = cg.load_kernel_module(SOURCE, "cachetest")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert Path(module.__file__).parent == cache.resolve()
    assert torch.equal(run_kernel(module), torch.ones(8))


def test_the_default_is_under_the_users_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPASS_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cg.cache_dir() == (tmp_path / "xdg" / "moepass" / "kernels").resolve()
    assert stat.S_IMODE(cg.cache_dir().stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_is_refused(cache, mode):
    cache.mkdir()
    os.chmod(cache, mode)
    with pytest.raises(cg.KernelCacheError, match=rf"{cache}.*has mode {mode:04o}.*chmod 700"):
        cg.load_kernel_module(SOURCE, "cachetest")
    assert not list(cache.iterdir())  # nothing written there either


def test_a_directory_of_another_user_is_refused(cache, monkeypatch):
    cache.mkdir(mode=0o700)
    owner = cache.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # this process as another user
    with pytest.raises(cg.KernelCacheError, match=rf"belongs to uid {owner}, not to this user.*MOEPASS_KERNEL_CACHE"):
        cg.cache_dir()


def test_the_default_refused_when_unsafe_is_not_replaced_by_a_temp_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPASS_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "moepass" / "kernels").mkdir(parents=True)
    os.chmod(tmp_path / "moepass" / "kernels", 0o777)
    with pytest.raises(cg.KernelCacheError, match="world-writable"):
        cg.cache_dir()


def test_a_default_that_cannot_be_created_falls_back_to_a_private_temp_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPASS_KERNEL_CACHE", raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # mkdir under a file fails
    monkeypatch.setattr(process_state, "KERNEL_FALLBACK_DIR", process_state.Slot())
    first = cg.cache_dir()
    assert first.name.startswith("moepass-kernels-") and first != Path(cg.tempfile.gettempdir()) / "moepass_kernels"
    assert stat.S_IMODE(first.stat().st_mode) == 0o700 and cg.cache_dir() == first  # one per process
    first.rmdir()


def test_a_file_swapped_after_writing_is_refused_not_executed(cache, monkeypatch):
    write = cg.write_atomic

    def write_then_swap(path, data):
        write(path, data)
        path.write_text(EVIL)  # another process swaps the file between the write and the read-back

    monkeypatch.setattr(cg, "write_atomic", write_then_swap)
    with pytest.raises(cg.KernelCacheError, match=r"changed after it was written .* it was not executed"):
        cg.load_kernel_module(SOURCE, "cachetest")
    assert not hasattr(builtins, "MOEPASS_EVIL_RAN")
    assert not [n for n in sys.modules if n.startswith(f"{cg.PACKAGE}.cachetest")]


def test_a_tampered_cached_file_is_rewritten_before_it_runs(cache):
    cache.mkdir(mode=0o700)
    path = cache / f"cachetest_{cg.source_key(SOURCE)}.py"
    path.write_text(EVIL)
    module = cg.load_kernel_module(SOURCE, "cachetest")
    assert not hasattr(builtins, "MOEPASS_EVIL_RAN")
    assert path.read_text() == SOURCE and torch.equal(run_kernel(module), torch.ones(8))


def test_triton_reads_the_verified_source_after_the_file_changes(cache):
    module = cg.load_kernel_module(SOURCE, "cachetest")
    Path(module.__file__).write_text(EVIL)  # swapped after the load, before the first launch
    assert "+ 100.0" not in inspect.getsource(cg.unwrap(module.add_delta))
    assert torch.equal(run_kernel(module), torch.ones(8))  # the interpreter re-parses the kernel's source


def test_the_cache_hits_on_a_second_load(cache, monkeypatch):
    first = cg.load_kernel_module(SOURCE, "cachetest")
    assert cg.load_kernel_module(SOURCE, "cachetest") is first  # in this process
    path = Path(first.__file__)
    before = path.stat()
    monkeypatch.setattr(process_state, "KERNEL_MODULES", {})  # as a new process would: the file is reused, not rewritten
    second = cg.load_kernel_module(SOURCE, "cachetest")
    after = path.stat()
    assert second is not first and (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert torch.equal(run_kernel(second), torch.ones(8))
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temp file left behind


def test_the_gpu_build_child_checks_the_hash_too(cache):
    module = cg.load_kernel_module(SOURCE, "cachetest")
    request = cg.BuildRequest.of(module.add_delta, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 8}, arch=80)
    assert request.sha256 == module.MOEPASS_SOURCE_SHA256 == cg.hashlib.sha256(SOURCE.encode()).hexdigest()
    Path(module.__file__).write_text(EVIL)
    with pytest.raises(RuntimeError, match="changed after it was written"):
        cg.build_many([request])
