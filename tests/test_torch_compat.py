"""Torch-version seams: moepass calls torch 2.13's single-tensor collectives (`all_gather_single`,
`reduce_scatter_single`; the old names warn as deprecated) and falls back to the old names on releases
that lack the new ones (torch 2.11 on a GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as dist

from moepass.runtime import collectives, scheduler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_new_names_where_torch_has_them():
    assert scheduler.ALL_GATHER_SINGLE is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert scheduler.REDUCE_SCATTER_SINGLE is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    assert collectives.ALL_GATHER_SINGLE is scheduler.ALL_GATHER_SINGLE


def test_the_old_names_on_a_torch_without_the_new_ones():
    code = """
import torch.distributed as dist
for name in ("all_gather_single", "reduce_scatter_single"):  # as torch 2.11
    if hasattr(dist, name):
        delattr(dist, name)
from moepass.runtime import collectives, scheduler
assert scheduler.ALL_GATHER_SINGLE is dist.all_gather_into_tensor
assert scheduler.REDUCE_SCATTER_SINGLE is dist.reduce_scatter_tensor
assert collectives.ALL_GATHER_SINGLE is dist.all_gather_into_tensor
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
