"""Every ```python block of README.md and docs/USER_GUIDE.md runs here, so the documents stay true.

A document's blocks run in order in one fresh process and one namespace, as a reader would type them
(`test_single_process_blocks`). A block whose first line is `# torchrun --nproc-per-node N ...` is a script
for N ranks: it runs on the harness's N spawned gloo ranks (tests/_dist.py), each first running the
document's first block (its set-up), with `torch.distributed.init_process_group` a no-op there since the
harness has already initialised the group (`test_distributed_block`). Tracebacks name `DOC:LINE`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import pool

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/USER_GUIDE.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TORCHRUN = re.compile(r"# torchrun --nproc-per-node (\d+)")


def blocks(doc: str) -> list[tuple[int, str]]:
    """(first line of the code, the code) of each ```python block of `doc`."""
    text = (ROOT / doc).read_text()
    return [(text[: m.start(1)].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


def ranks(code: str) -> int:
    """N for a block starting `# torchrun --nproc-per-node N`, else 0 (one process)."""
    m = TORCHRUN.match(code)
    return int(m.group(1)) if m else 0


def run_blocks(named: list[tuple[str, str]], namespace: dict) -> None:
    for name, code in named:
        exec(compile(code, name, "exec"), namespace)


def test_the_documents_have_blocks_and_the_torchrun_ones_are_marked():
    for doc in DOCS:
        found = blocks(doc)
        assert found, f"{doc} has no ```python block"
        for line, code in found:
            if "torchrun" in code.splitlines()[0]:
                assert ranks(code), f"{doc}:{line}: write the first line as '# torchrun --nproc-per-node N ...'"


@pytest.mark.parametrize("doc", DOCS)
def test_single_process_blocks(doc, tmp_path):
    named = [(f"{doc}:{line}", code) for line, code in blocks(doc) if not ranks(code)]
    script = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom test_docs import run_blocks\n"
              f"run_blocks({named!r}, {{'__name__': '__main__'}})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"a block of {doc} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def case_block(rank: int, world: int, setup: tuple[str, str], block: tuple[str, str], cwd: str) -> str:
    import torch.distributed as dist

    init = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # the harness's group is the one the block uses
    here = os.getcwd()
    os.chdir(cwd)
    try:
        run_blocks([setup, block], {"__name__": "__main__"})
    finally:
        dist.init_process_group = init
        os.chdir(here)
    return "ok"


DISTRIBUTED = [(doc, line, code) for doc in DOCS for line, code in blocks(doc) if ranks(code)]


@pytest.mark.distributed
@pytest.mark.parametrize("doc,line,code", DISTRIBUTED, ids=[f"{d}:{n}" for d, n, _ in DISTRIBUTED])
def test_distributed_block(doc, line, code, tmp_path):
    first_line, first = blocks(doc)[0]
    assert not ranks(first), f"{doc}: the first ```python block is the set-up every rank runs; it cannot be a script"
    results = pool(ranks(code)).run(case_block, (f"{doc}:{first_line}", first), (f"{doc}:{line}", code),
                                    str(tmp_path), timeout=300)
    assert results == ["ok"] * ranks(code)
