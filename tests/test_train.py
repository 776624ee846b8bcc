"""The training recipe (issue 30): `python -m moepass train` (samples/train.py over moepass/train/).

- data: the corpus is read from the standard library, the ranks' slices of a step are its global batch, an
  epoch visits every sequence once; the learning-rate schedule's warmup and cosine end points;
- optimizer: torch's AdamW over an EP-compiled model with foreach=True fails on the plain + DTensor mix (the
  GPU default; the control), `build_optimizer`'s groups step with foreach=True and equal the foreach=False step;
- parity: at W=2 gloo, EP and FSEP (placements changing every step) give the untouched model's loss on the
  same global batches step by step over 20 steps (`--reference`, one run), to fp32 tolerance;
- crash and resume: a run checkpoints at step 4 and its last rank dies after step 6 (os._exit, no clean-up);
  `--resume latest` continues from step 4 and its losses (and FSEP placement tables) for steps 5..8 are
  bitwise those of the uninterrupted run: FSEP (placements changing every step), and EP with FSDP2 on the
  dense parameters under the priority scheduler (DCP over DTensors of two meshes);
- other models: `--model hf:qwen3_moe` (built from its config) and `--model torchtitan` train with the
  untouched model's losses (3 steps);
- HP x FSDP2 at W=4 (ep_size=2): the untouched model's losses for 3 steps;
- resume elsewhere: a checkpoint of EP at W=4 continues as FSEP at W=2, one of the single form as EP, with
  the uninterrupted run's losses to fp32 tolerance (checkpoints hold the original model's layout);

- `--compile` (inductor over the DDP-wrapped EP model): the same losses as the reference for 3 steps, and no
  graph break names a moepass op (the breaks left are DDP's own Python).

Runs are subprocesses (`python -m moepass train --nproc 2`, which spawns its gloo ranks).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import REPO_DIR, pool  # noqa: E402

RTOL = 1e-5  # fp32: a distributed step vs one process (summation order)
RUN_TIMEOUT = 900


def train(out, *args: str, expect_ok: bool = True) -> tuple[subprocess.CompletedProcess, dict | None]:
    cmd = [sys.executable, "-m", "moepass", "train", "--nproc", "2", "--seq", "32", "--warmup", "5",
           "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": REPO_DIR, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    path = os.path.join(str(out), "train_log.json")
    return proc, (json.load(open(path)) if proc.returncode == 0 and os.path.exists(path) else None)


# ---- data and schedule (one process) -----------------------------------------------------------------


def test_corpus_batches_partition_by_rank_and_cover_an_epoch():
    from moepass.train.data import VOCAB, Batches, corpus_tokens

    tokens = corpus_tokens()
    assert tokens.numel() > 400_000 and int(tokens.max()) < VOCAB and int(tokens.min()) >= 0
    assert torch.equal(tokens, corpus_tokens())  # the same bytes every time
    b = Batches.from_corpus(seq=32, global_batch=8, seed=3)
    step = 5
    whole = b.global_batch_at(step)
    assert whole.shape == (8, 33)
    assert torch.equal(torch.cat([b.rank_batch(step, r, 4) for r in range(4)]), whole)
    seen = torch.cat([b.rows_at(s) for s in range(b.steps_per_epoch)])
    assert torch.unique(seen).numel() == seen.numel() == b.steps_per_epoch * 8  # no sequence twice per epoch
    assert not torch.equal(b.rows_at(b.steps_per_epoch), b.rows_at(0))  # the next epoch: another order
    assert not torch.equal(Batches.from_corpus(32, 8, seed=4).global_batch_at(step), whole)
    with pytest.raises(ValueError, match=r"global_batch=8 must be a multiple of the world size 3"):
        b.rank_batch(0, 0, 3)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    from moepass.train.optim import lr_at

    lrs = [lr_at(s, 1.0, warmup=10, total=100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)


# ---- the optimizer over plain + DTensor parameters (W=2, the shared pool) -------------------------------


def case_foreach(rank, world):
    import moepass
    from moepass.train.optim import build_optimizer
    from samples.models import tiny_mixtral

    def stepped(make):
        torch.manual_seed(0)
        cm = moepass.compile(tiny_mixtral(vocab_size=64, dim=32, ffn_dim=32, num_experts=4),
                             moepass.Plan(form="ep", topology=moepass.Topology(1, world)))
        opt = make(cm)
        cm.loss(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))).backward()
        opt.step()
        return moepass.logical_state_dict(cm)

    plain = stepped(lambda cm: torch.optim.AdamW(cm.parameters(), lr=1e-2, weight_decay=0.0, foreach=True))
    on = stepped(lambda cm: build_optimizer(cm, 1e-2, foreach=True))
    off = stepped(lambda cm: build_optimizer(cm, 1e-2, foreach=False))
    for name in on:
        a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (on[name], off[name]))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in plain.items()}


def test_build_optimizer_steps_with_foreach_on_a_dtensor_mix():
    """build_optimizer's groups (one per mesh) step with foreach=True as with foreach=False; a plain
    AdamW(cm.parameters(), foreach=True) over the mix steps too (moepass.compile's step hooks,
    tests/test_optim.py checks its values)."""
    plain = pool(2).run(case_foreach)
    assert plain[0] and all(torch.isfinite(t).all() for t in plain[0].values())


class SkippingExperts(torch.nn.Module):
    """A loop-style MoE layer reduced to its hazard: expert i runs only when `use[i]` is set."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x, use):
        return x + sum(e(x) for e, u in zip(self.experts, use) if u)


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(SkippingExperts() for _ in range(2))

    def forward(self, x, use):
        for layer in self.layers:
            x = layer(x, use)
        return x.square().sum()


def case_fsdp_touch(rank, world):
    import torch.distributed as dist

    import moepass
    from samples.train import touch_every_parameter

    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    use = [(True, False), (True, True)][rank]  # rank 0 never reads expert 1
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    ref_out = reference(x, use)
    ref_out.backward()
    for p in reference.parameters():  # DDP's rule: the mean over ranks, a zero where a rank read nothing
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        p.grad = g / world
    for layer in model.layers:
        touch_every_parameter(layer)
        moepass.fully_shard(layer)
    moepass.fully_shard(model)
    out = model(x, use)
    out.backward()
    assert torch.equal(out.detach(), ref_out.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7, msg=name)
    return True


@pytest.mark.distributed
def test_fsdp2_on_the_untouched_loop_model_gives_every_expert_a_gradient():
    """--form none --fsdp: a layer that skips an expert on one rank only still reduce-scatters the same
    gradients on every rank (touch_every_parameter), each equal to DDP's mean."""
    assert pool(2).run(case_fsdp_touch) == [True, True]


# ---- parity with the untouched model, and crash + resume (W=2, subprocesses) -----------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_losses_equal_the_reference_step_by_step(tmp_path, form):
    _, log = train(tmp_path, "--form", form, "--steps", "20", "--reference", "--foreach", "on", "--log-every", "5")
    steps = log["steps"]
    assert [r["step"] for r in steps] == list(range(1, 21))
    worst = max(abs(r["loss"] - r["ref_loss"]) / abs(r["ref_loss"]) for r in steps)
    assert worst <= RTOL, f"{form}: max relative |dloss| {worst:.2e} over 20 steps"
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # it learns
    assert all(r["a2a_bytes"] > 0 for r in steps)
    if form == "fsep":
        tables = [json.dumps(r["placements"], sort_keys=True) for r in steps]
        assert len(set(tables)) > 5  # the planner moved experts while the losses stayed equal
    assert os.path.getsize(tmp_path / "loss.png") > 10_000


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("setup", [("--form", "fsep"), ("--form", "ep", "--fsdp", "--grad-sync", "scheduler")],
                         ids=["fsep", "ep-fsdp2-scheduler"])
def test_crash_and_resume_continue_bitwise(tmp_path, setup):
    fsep = "fsep" in setup
    common = (*setup, "--steps", "8", "--ckpt-every", "4", "--log-every", "1")
    _, whole = train(tmp_path / "whole", *common)
    crashed, _ = train(tmp_path / "crash", *common, "--kill-at", "6", expect_ok=False)
    assert crashed.returncode != 0 and "exit code 17" in crashed.stderr  # rank 1 died after step 6
    assert sorted(os.listdir(tmp_path / "crash" / "ckpt")) == ["step_000004"]
    proc, resumed = train(tmp_path / "crash", *common, "--resume", "latest")
    assert "resumed from" in proc.stdout and resumed["start_step"] == 4
    after = {r["step"]: r for r in whole["steps"] if r["step"] > 4}
    got = {r["step"]: r for r in resumed["steps"]}
    assert sorted(got) == list(range(1, 9))  # the log goes on from the checkpoint's steps
    got = {s: r for s, r in got.items() if s > 4}
    assert [got[s]["loss"] for s in got] == [after[s]["loss"] for s in got]  # bitwise
    if fsep:
        assert [got[s]["placements"] for s in got] == [after[s]["placements"] for s in got]
        assert len({json.dumps(after[s]["placements"], sort_keys=True) for s in after}) > 1  # tables kept changing


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(("ep", "4"), ("fsep", "2")), (("single", "2"), ("ep", "2"))],
                         ids=["ep-w4-to-fsep-w2", "single-to-ep"])
def test_resume_under_another_form_and_world_size(tmp_path, before, after):
    """A checkpoint is in the original model's layout (model, AdamW moments and steps): a run saved at step
    4 under one form and world size continues under another with the losses of the uninterrupted run, to
    fp32 tolerance (the same global batches; only the summation order differs)."""
    common = ("--steps", "8", "--log-every", "1")
    _, whole = train(tmp_path / "whole", "--form", before[0], "--nproc", before[1], *common, "--ckpt-every", "4")
    proc, resumed = train(tmp_path / "resumed", "--form", after[0], "--nproc", after[1], *common,
                          "--resume", str(tmp_path / "whole" / "ckpt" / "step_000004"))
    assert "resumed from" in proc.stdout and resumed["start_step"] == 4 and resumed["world"] == int(after[1])
    expected = {r["step"]: r["loss"] for r in whole["steps"]}
    got = {r["step"]: r["loss"] for r in resumed["steps"]}
    assert sorted(got) == list(range(1, 9))  # the log goes on from the checkpoint's steps
    assert all(got[s] == expected[s] for s in range(1, 5))  # those are the saved run's
    got = {s: loss for s, loss in got.items() if s > 4}
    worst = max(abs(got[s] - expected[s]) / expected[s] for s in got)
    assert worst <= RTOL, f"{before} -> {after}: max relative |dloss| {worst:.2e}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("model,form,blocks", [("hf:qwen3_moe", "single", "model.layers.0.mlp"),
                                               ("torchtitan", "ep", "model.layers.0.moe")],
                         ids=["hf-qwen3_moe-single", "torchtitan-ep"])
def test_other_models_train_with_the_untouched_models_losses(tmp_path, model, form, blocks):
    """--model: a Hugging Face causal LM built from its config, torchtitan's Qwen3-MoE; both MoE blocks of
    each rewritten, the losses those of the untouched model (--reference) for 3 steps."""
    pytest.importorskip("transformers" if model.startswith("hf:") else "torchtitan")
    _, log = train(tmp_path, "--model", model, "--form", form, "--steps", "3", "--reference", "--log-every", "1")
    assert len(log["blocks"]) == 2 and blocks in log["blocks"]
    worst = max(abs(r["loss"] - r["ref_loss"]) / abs(r["ref_loss"]) for r in log["steps"])
    assert worst <= RTOL, f"{model} {form}: max relative |dloss| {worst:.2e}"
    assert log["steps"][-1]["loss"] < log["steps"][0]["loss"]


@pytest.mark.distributed
@pytest.mark.slow
def test_hp_with_fsdp2_on_a_2x2_mesh_w4_keeps_the_losses(tmp_path):
    """HP (the sample's Multi-Head LatentMoE twin, heads over the ranks, experts inside on ep_size=2) with FSDP2
    on the dense parameters at W=4: the untouched model's losses for 3 steps (EP and FSEP under FSDP2 on the
    2x2 mesh: tests/test_fsdp_moepass.py::test_fully_shard_on_a_2x2_mesh_w4)."""
    _, log = train(tmp_path, "--form", "hp", "--fsdp", "--nproc", "4", "--ep-size", "2", "--steps", "3",
                   "--reference", "--log-every", "1")
    assert log["world"] == 4 and set(log["blocks"].values()) == {"HPLayout"}
    worst = max(abs(r["loss"] - r["ref_loss"]) / abs(r["ref_loss"]) for r in log["steps"])
    assert worst <= RTOL, f"hp x FSDP2 at W=4: max relative |dloss| {worst:.2e}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("form", ["ep", "fsep"])
def test_compile_keeps_the_losses_and_breaks_no_moepass_block(tmp_path, form):
    """torch.compile (inductor, data-dependent shapes captured) over the compiled model under DDP. FSEP: its
    deferred gradient reduction must not run a compiled region's backward a second time."""
    proc, log = train(tmp_path, "--form", form, "--compile", "--steps", "3", "--reference", "--log-every", "1")
    assert all(abs(r["loss"] - r["ref_loss"]) <= RTOL * abs(r["ref_loss"]) for r in log["steps"])
    breaks = log["graph_breaks"]
    assert breaks is not None and "graph breaks:" in proc.stdout
    assert not [r for r in breaks if "moe" in r.lower()]  # the only breaks are DDP's own Python (its logger)
