"""Test session set-up.

TRITON_INTERPRET must be set before any `lowering` module is imported (Triton reads it when
`@triton.jit` runs), so it is set here, at the top of the first file pytest imports.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MOEPASS_VERIFY", "1")  # the verifier runs after every pass in every test
os.environ.setdefault("MOEPASS_ALWAYS_REWRITE", "1")  # no timing picks what runs (tests of it set the plan field)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))

import ast  # noqa: E402
import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from moepass.runtime import workers  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("full", max_examples=200, deadline=None)  # tests/test_properties.py: 220 cases
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

UNDER_XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # a pytest-xdist worker (`-n 2`, what CI runs)

if UNDER_XDIST:
    # two workers share the cores: one intra-op thread each (two threads per worker oversubscribe the cores and
    # their spin-waits cost more than they save), and the ranks and subprocesses the tests start inherit it
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


# Tests by kind (pyproject's markers, --strict-markers): `distributed` spawns ranks, `slow` takes more than a
# few seconds, `gpu` needs CUDA, `unit` is everything else (`pytest -m unit` runs in one process). A test is
# marked `distributed` by hand, or here when it, or a function of its module it calls, calls the rank pool
# (`pool(W)`, or a `Pool(W)` of its own); `_pool_runs_are_marked` fails a test that ran a case on the pool without the mark, so the
# marks cannot go stale.
KINDS = ("distributed", "slow", "gpu")


def _pool_callers(module) -> set[str]:
    """Names of the module's functions that call `pool(...)` or make a `Pool(...)`, directly or through the
    module's other functions."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    calls: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls[node.name] = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                                and isinstance(c.func, ast.Name)}
    found = {name for name, called in calls.items() if called & {"pool", "Pool"}}  # the shared pool, or one of its own
    while True:
        more = {name for name, called in calls.items() if called & found} - found
        if not more:
            return found
        found |= more


def pytest_collection_modifyitems(config, items):
    callers: dict[str, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        function = getattr(item, "originalname", None) or getattr(item, "name", "")
        if module is not None:
            if module.__name__ not in callers:
                callers[module.__name__] = _pool_callers(module)
            if function in callers[module.__name__] and "distributed" not in item.keywords:
                item.add_marker(pytest.mark.distributed)
        if not any(kind in item.keywords for kind in KINDS):
            item.add_marker(pytest.mark.unit)
    if UNDER_XDIST:
        # under pytest-xdist the slow tests go first (a stable sort: collection order
        # otherwise), so that no worker is left with a long one at the end while the other idles
        items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (CPU paths are tested instead)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_POOL_RUNS = [0]
_run_case = workers.Pool.run


def _counted_run(self, *args, **kwargs):
    _POOL_RUNS[0] += 1
    return _run_case(self, *args, **kwargs)


workers.Pool.run = _counted_run  # counts the cases the tests send to spawned ranks (see KINDS)


@pytest.fixture(autouse=True)
def _pool_runs_are_marked(request):
    before = _POOL_RUNS[0]
    yield
    if _POOL_RUNS[0] != before and "distributed" not in request.node.keywords:
        pytest.fail(f"{request.node.nodeid} ran cases on spawned ranks but is not marked distributed: add "
                    f"@pytest.mark.distributed (tests/conftest.py marks a test that calls pool(...) itself)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """The spawned rank pools (tests/_dist.py) are shared by the whole session and closed at its end (test
    files import the harness as `tests._dist` or, with tests/ on sys.path, as `_dist`: two module objects)."""
    import sys

    yield
    for name in ("tests._dist", "_dist"):
        if name in sys.modules:
            sys.modules[name].shutdown()
