"""No hidden state (issue 13, item 2): the process-group cache follows the world it was made in,
boolean environment flags have one parser ("0" means off), the hardware a compile-time decision
prices with is a Plan field, and Plan fields that another form reads raise PlanError.

None of these tests uses a fixture that clears `moepass.runtime.topology`'s cache: the cache must
be right by itself across explain / compile / destroy_process_group.
"""

from __future__ import annotations

import ast
import importlib
import os
import queue
import re
import socket
import traceback
from pathlib import Path

import pytest
import torch

import moepass
from moepass import Plan, PlanError, schedule

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
BATCH_PER_RANK, SEQ = 2, 8
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------
# The group cache: explain (fake process group) then compile on a real gloo world, one process.
# ----------------------------------------------------------------------------------------------


def _explain_then_train(rank: int, world: int, port: int, results) -> None:
    """One rank: explain on the fake world (no process group yet), then gloo, compile, fwd + bwd."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOEPASS_CHECK_COLLECTIVES="1")
        torch.set_num_threads(1)
        import torch.distributed as dist

        import moepass
        from moepass.runtime.grads import all_reduce_replicated_grads
        from samples.models import tiny_mixtral

        torch.manual_seed(0)
        model = tiny_mixtral(style="fused", **CFG)
        plan = moepass.Plan(form="ep", ep_size=world)
        assert not dist.is_initialized()
        text = moepass.explain(model, plan)  # builds every block on the fake world, then destroys it
        assert "fake process group at world size 2" in text and "would fail" not in text, text[-3000:]
        assert not dist.is_initialized()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            cm = moepass.compile(model, plan)  # same (world, ep_size, topology): the cached-groups key
            tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                                   generator=torch.Generator().manual_seed(7))
            mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
            ref_loss = model.loss(tokens)  # the single-process reference on every rank's batch
            ref_loss.backward()
            ref_out = model(tokens[:, :-1])[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
            out = cm(mine[:, :-1])
            loss = cm.loss(mine)
            loss.backward()  # the all-to-all backward runs on the new world's groups
            all_reduce_replicated_grads(cm)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss /= world
            torch.testing.assert_close(global_loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
            ref_grads = {n: p.grad for n, p in model.named_parameters()}
            grads = moepass.logical_grads(cm)
            for name, (g, rows) in grads.items():
                want = ref_grads[name] if rows is None else ref_grads[name][rows]
                torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
            forms = sorted({gm.form for gm in cm.moepass_info.rewritten.values()})
            expert_grads = sum(rows is not None for _, rows in grads.values())  # this rank's expert shard
            results.put((rank, True, {"forms": forms, "grads": len(grads), "expert_grads": expert_grads}))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_explain_then_compile_on_gloo_in_one_process():
    """The issue's bug: explain's fake groups were handed to compile ("Could not resolve the process
    group registered under the name 3"). Fresh processes, no cache-clearing fixture."""
    import torch.multiprocessing as mp

    world, ctx = 2, mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_explain_then_train, args=(r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            rank, ok, value = results.get(timeout=300)
            got[rank] = (ok, value)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(got))} did not finish within 300 s")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
    for rank in range(world):
        report = got[rank][1]
        assert report["forms"] == ["ep"] and report["expert_grads"] > 0, report


def test_group_cache_follows_the_world():
    """Two fake worlds in turn: the second gets its own groups, resolvable by name; none of the first's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import Topology, ep_groups, group_info

    assert not dist.is_initialized()
    topology = Topology(1, 4)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        first = ep_groups(topology, 4, "cpu")
        assert ep_groups(topology, 4, "cpu") is first  # cached within one world
        first_name = first.ep_group.group_name
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        second = ep_groups(topology, 4, "cpu")
        assert second is not first
        for group in (second.ep_group, second.dp_group):
            assert dist.distributed_c10d._resolve_process_group(group.group_name) is group
            assert group_info(group.group_name)[1] == dist.get_process_group_ranks(group)
        if first_name != second.ep_group.group_name:  # names are reused by the next world or not at all
            with pytest.raises(KeyError, match="not made by moepass in the current world"):
                group_info(first_name)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------------
# Environment flags.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [
    (None, False), ("", False), ("0", False), ("false", False), ("FALSE", False), ("No", False), ("off", False),
    (" 0 ", False), ("1", True), ("true", True), ("True", True), ("YES", True), ("on", True),
])
def test_flag_values(monkeypatch, value, expected):
    from moepass.envflags import flag

    if value is None:
        monkeypatch.delenv("MOEPASS_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("MOEPASS_TEST_FLAG", value)
    assert flag("MOEPASS_TEST_FLAG") is expected


@pytest.mark.parametrize("value", ["2", "enable", "y", "-1", "nope"])
def test_flag_rejects_anything_else(monkeypatch, value):
    from moepass.envflags import flag

    monkeypatch.setenv("MOEPASS_VERIFY", value)
    with pytest.raises(ValueError, match=rf"MOEPASS_VERIFY='{re.escape(value)}' is not a valid flag: use one of "
                                         r"\['1', 'true', 'yes', 'on'\] for on, or one of "
                                         r"\['', '0', 'false', 'no', 'off'\]"):
        flag("MOEPASS_VERIFY")


def _verifier_calls(monkeypatch, env_value: str) -> list[str]:
    from samples.models import FusedMoE

    verifier = importlib.import_module("moepass.verify")  # the module (moepass.verify is the function)
    calls: list[str] = []
    real = verifier.verify
    monkeypatch.setattr(verifier, "verify", lambda gm, after="", **kw: calls.append(after)
                        or real(gm, after=after, **kw))
    monkeypatch.setenv("MOEPASS_VERIFY", env_value)
    moepass.compile(FusedMoE(16, 32, num_experts=4, top_k=2))
    return calls


def test_moepass_verify_0_turns_the_verifier_off(monkeypatch):
    assert _verifier_calls(monkeypatch, "0") == []
    assert _verifier_calls(monkeypatch, "false") == []


def test_moepass_verify_1_turns_the_verifier_on(monkeypatch):
    calls = _verifier_calls(monkeypatch, "1")
    assert calls[0] == "canonical" and "schedule" in calls and len(calls) >= 3, calls


def test_moepass_verify_typo_is_an_error(monkeypatch):
    from samples.models import FusedMoE

    monkeypatch.setenv("MOEPASS_VERIFY", "ture")
    with pytest.raises(ValueError, match="MOEPASS_VERIFY='ture'"):
        moepass.compile(FusedMoE(16, 32, num_experts=4, top_k=2))


def test_moepass_check_collectives_0_is_off(monkeypatch):
    from moepass.runtime import collectives

    monkeypatch.setattr(collectives, "CHECK", False)  # the import-time reading of this environment
    monkeypatch.setenv("MOEPASS_CHECK_COLLECTIVES", "0")
    assert not collectives.checks_enabled()
    monkeypatch.setenv("MOEPASS_CHECK_COLLECTIVES", "1")
    assert collectives.checks_enabled()


def test_every_moepass_flag_goes_through_the_parser():
    """No module of moepass reads a MOEPASS_* variable itself; every flag() name is documented."""
    from moepass.envflags import FLAGS

    direct = re.compile(r"""(environ(\.get)?\s*[(\[]|getenv\s*\()\s*["']MOEPASS_""")
    named = re.compile(r"""\bflag\(\s*["'](MOEPASS_\w+)["']""")
    offenders, used = [], set()
    for path in sorted((ROOT / "moepass").rglob("*.py")):
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for m in direct.finditer(text)]
        used |= set(named.findall(text))
    assert not offenders, f"read MOEPASS_* flags with moepass.envflags.flag: {offenders}"
    assert used and used <= set(FLAGS), used - set(FLAGS)


# ----------------------------------------------------------------------------------------------
# Plan.hardware: the figures compile-time decisions price with.
# ----------------------------------------------------------------------------------------------


def _spec():
    from samples.models import LoopMoE

    torch.manual_seed(0)
    return moepass.detect(LoopMoE(16, 32, 8, top_k=2)).blocks[0]


def test_plan_hardware_validation(tmp_path):
    from cost_model.presets import H100, PRESET_NAMES

    assert Plan().hardware is None
    for value in (*PRESET_NAMES, H100, None):
        assert Plan(form="ep", hardware=value).hardware == value  # the cost model prices with it under ep/fsep/auto
    with pytest.raises(PlanError, match=r"Plan.hardware='h10' is invalid: use a preset name \['a100', 'h100', "
                                        r"'ascend910a', 'this-machine'\].*Did you mean 'h100'\?"):
        Plan(hardware="h10")
    with pytest.raises(PlanError, match=r"Plan.hardware=3 is invalid: use a preset name"):
        Plan(hardware=3)
    missing = str(tmp_path / "nope.json")
    with pytest.raises(PlanError, match=r"no calibration profile at that path.*moepass calibrate"):
        Plan(hardware=missing)
    with pytest.raises(PlanError, match=r"Plan.hardware='h10' is invalid"):
        Plan(blocks={"layers.0.mlp": {"hardware": "h10"}})


def test_plan_hardware_reads_a_given_profile(tmp_path):
    from cost_model.presets import resolve_hardware

    path = tmp_path / "profile.json"
    path.write_text('{"flops": 1.5e10, "bandwidth": 3e9, "alpha": 5e-5, "created": "test"}')
    hw = resolve_hardware(Plan(form="ep", hardware=str(path)).hardware)
    assert (float(hw.flops), float(hw.intra_bw), float(hw.alpha)) == (1.5e10, 3e9, 5e-5)


def test_plan_hardware_feeds_the_chunk_count():
    from cost_model.presets import H100, this_machine

    spec = _spec()
    base = Plan(form="ep", batch=(8, 512))
    n, why = schedule.choose_chunks(spec, base.replace(hardware="h100"), 4, 4)
    want = schedule.layer_times(spec, 4096, 4, 4, hardware=H100)
    assert n == want.chunks() and "cost model on h100" in why
    assert f"transfer={want.transfer * 1e3:.3g} ms" in why  # the preset's figures, not this machine's
    default = schedule.layer_times(spec, 4096, 4, 4)
    assert default.hardware == "this-machine" and default.transfer != want.transfer
    # figures that make the decision differ: the plan's hardware decides it
    slow_net = this_machine().with_figures("test", flops=1e13, intra_bw=1e8, inter_bw=1e8, alpha=1e-4)
    compute_bound = this_machine().with_figures("test", flops=1e10, intra_bw=1e9, inter_bw=1e9, alpha=1e-4)
    assert schedule.choose_chunks(spec, base.replace(hardware=slow_net), 4, 4)[0] == 1
    assert schedule.choose_chunks(spec, base.replace(hardware=compute_bound), 4, 4)[0] > 1


def test_plan_hardware_feeds_packing():
    from cost_model.presets import this_machine

    spec = _spec()
    plan = Plan(form="ep", packing="auto", batch=(8, 512), a2a_chunks=1)
    slow_net = this_machine().with_figures("test", flops=1e12, intra_bw=1e7, inter_bw=1e7, alpha=1e-6)
    fast_net = this_machine().with_figures("test", flops=1e9, intra_bw=1e11, inter_bw=1e11, alpha=1e-6)
    assert schedule.choose_packing(spec, plan.replace(hardware=slow_net), 4, 4) == 4
    assert schedule.choose_packing(spec, plan.replace(hardware=fast_net), 4, 4) == 1


def test_plan_hardware_feeds_form_auto():
    from moepass.api import resolve_auto
    from samples.models import LoopMoE

    report = moepass.detect(LoopMoE(16, 32, 8, top_k=2))
    plan = Plan(form="auto", batch=(8, 512), topology=moepass.Topology(1, 4), hardware="h100")
    chosen, result = resolve_auto(plan, report)
    assert result.hardware.name == "h100" and chosen.form == result.best.form
    # kept where it still acts (the chunk count under ep / fsep), at its default under the other forms
    assert chosen.hardware == ("h100" if chosen.form in ("ep", "fsep") else None)


def test_plan_hardware_reaches_the_schedule_pass():
    """compile on a fake world of 4: the schedule pass records the preset it priced with."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cost_model.presets import H100
    from samples.models import LoopMoE

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        torch.manual_seed(0)
        gm = moepass.compile(LoopMoE(16, 32, 8, top_k=2), Plan(form="ep", topology=moepass.Topology(1, 4),
                                                                batch=(8, 512), hardware="h100"))
    finally:
        dist.destroy_process_group()
    stats = next(h for h in gm.history if h["pass"] == "schedule")["stats"]
    assert "cost model on h100" in stats["chunks_from"]
    assert stats["chunks"] == schedule.layer_times(gm.spec, 4096, 4, 4, hardware=H100).chunks()


# ----------------------------------------------------------------------------------------------
# Plan fields that only apply to some forms (Plan.deterministic: tests/test_deterministic.py).
# ----------------------------------------------------------------------------------------------


def test_fsep_fields_with_another_form_are_errors():
    """FSEP is built: its fields are accepted with form='fsep' and refused, not ignored, with another form."""
    assert Plan(form="fsep", slots_per_device=2, planner="static").slots_per_device == 2
    with pytest.raises(PlanError, match=r"Plan.slots_per_device=2 has no effect with form='ep': .*FSEP.*"
                                        r"Use form='fsep', or leave it None"):
        Plan(form="ep", slots_per_device=2)
    with pytest.raises(PlanError, match=r"Plan.planner='static' has no effect with form='single'"):
        Plan(planner="static")
    with pytest.raises(PlanError, match=r"Plan.planner='even' is invalid: use 'auto' .*'static'"):
        Plan(form="fsep", planner="even")
    with pytest.raises(PlanError, match=r"Plan.slots_per_device=0 is invalid"):  # a bad value is still named so
        Plan(form="fsep", slots_per_device=0)


def test_expert_recompute_is_still_accepted():
    assert Plan(expert_recompute=True).expert_recompute is True


# ----------------------------------------------------------------------------------------------
# cost_model: no import cycle, no private calls across modules.
# ----------------------------------------------------------------------------------------------


def _first_party_imports(path: Path) -> set[str]:
    """Every cost_model module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cost_model"):
            if node.module == "cost_model":
                found |= {f"cost_model.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cost_model.")}
    return found


def test_cost_model_has_no_import_cycle():
    modules = {f"cost_model.{p.stem}": p for p in (ROOT / "cost_model").glob("*.py") if p.stem != "__init__"}
    graph = {name: _first_party_imports(path) & set(modules) for name, path in modules.items()}
    assert "cost_model.simulate" not in graph["cost_model.search"]
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*trail, name, dep])}"
            if dep not in state:
                visit(dep, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_search_result_eligible_is_public():
    from cost_model.search import BlockShape, search

    shape = BlockShape(E=8, K=2, D=64, F=128, m=3, cf=None)
    result = search([shape], (1, 4), (2, 64), profile="h100")
    eligible = result.eligible()
    assert eligible and eligible[0] is result.best
    assert all(c.feasible and not c.math_changing for c in eligible)
    assert any(c.math_changing for c in result.ranked)  # capacity factors are ranked, not eligible
    text = (ROOT / "cost_model" / "simulate.py").read_text()
    assert "._eligible(" not in text
