"""`Plan(deterministic=True)` (moepass/determinism.py): reruns are bitwise identical, for every form.

Each form is compiled twice from the same seed and trained the same steps; outputs, every gradient and
the parameters after each optimizer step must be equal bit for bit (torch.equal, not a tolerance). The
compiled model's forward and backward run under torch.use_deterministic_algorithms, and only they: the
process's mode is the same before and after (also checked).
"""

from __future__ import annotations

import os

import pytest
import torch

import moepass
from moepass import Plan, PlanError
from tests._dist import pool

STEPS = 2
BATCH, SEQ = 2, 8


@pytest.fixture(autouse=True)
def _deterministic_off_afterwards():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _model(form: str) -> torch.nn.Module:
    from samples.models import tiny_latent_lm, tiny_mixtral

    torch.manual_seed(0)
    if form == "hp":
        return tiny_latent_lm(dim=64, vocab_size=64)
    return tiny_mixtral(dim=64, ffn_dim=64, vocab_size=64, style="loop" if form == "locality" else "mixed")


PLANS = {
    "single": dict(form="single"),
    "single-triton": dict(form="single", lowering="triton"),
    "ep": dict(form="ep"),
    "ep-chunked": dict(form="ep", a2a_chunks=2),
    "fsep": dict(form="fsep"),
    "hp": dict(form="hp"),
    "locality": dict(form="locality", mu=0.1),
}


def _run(form: str, plan_kwargs: dict, rank: int) -> dict[str, torch.Tensor]:
    """One fresh compile, STEPS SGD steps; every output, gradient and parameter, by name and step."""
    before = torch.are_deterministic_algorithms_enabled()
    cm = moepass.compile(_model(form), Plan(deterministic=True, **plan_kwargs))
    assert torch.are_deterministic_algorithms_enabled() == before  # scoped to the model, not switched for good
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    seen: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=gen)
        logits = cm(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        if form == "locality":
            loss = loss + moepass.aux_loss(cm)
        opt.zero_grad()
        loss.backward()
        seen[f"{step}/logits"] = logits.detach().clone()
        for name, p in cm.named_parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                seen[f"{step}/grad/{name}"] = g.detach().clone()
        opt.step()
        for name, p in cm.named_parameters():
            seen[f"{step}/param/{name}"] = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
    return seen


def case_reruns_bitwise(rank: int, world: int, form: str) -> dict:
    try:
        first, second = _run(form, PLANS[form], rank), _run(form, PLANS[form], rank)
    finally:
        torch.use_deterministic_algorithms(False)
    differ = sorted(k for k in first if not torch.equal(first[k], second[k]))
    nan = sorted(k for k in first if first[k].is_floating_point() and not torch.isfinite(first[k]).all())
    return {"keys": len(first), "grads": sum("/grad/" in k for k in first), "differ": differ, "nan": nan,
            "same_keys": sorted(first) == sorted(second)}


@pytest.mark.parametrize("form", ["single", "single-triton"])
def test_single_device_reruns_are_bitwise_identical(form):
    result = case_reruns_bitwise(0, 1, form)
    assert result["same_keys"] and result["grads"] > 0
    assert result["differ"] == [] and result["nan"] == []


@pytest.mark.parametrize("form", ["ep", "ep-chunked", "fsep", "hp", "locality"])
def test_distributed_reruns_are_bitwise_identical_at_w2(form):
    results = pool(2).run(case_reruns_bitwise, form)
    for rank, result in enumerate(results):
        assert result["same_keys"] and result["grads"] > 0, (rank, result)
        # fresh memory is NaN-filled under deterministic algorithms: a NaN would be a read of uninitialised memory
        assert result["differ"] == [] and result["nan"] == [], (rank, result)


class _ModeProbe(torch.nn.Module):
    """Records the deterministic mode in its forward and when the backward passes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", torch.are_deterministic_algorithms_enabled()))
        x = x * 1.0
        if x.requires_grad:
            x.register_hook(lambda g: self.seen.append(("backward", torch.are_deterministic_algorithms_enabled())))
        return x


def test_deterministic_mode_is_on_while_the_compiled_model_runs_and_only_then():
    torch.use_deterministic_algorithms(False)
    class Probed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm, self.probe = _model("single"), _ModeProbe()

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.probe(self.lm(tokens)) * 2.0  # the probe's tensor is inside: the backward reaches it later

    cm = moepass.compile(Probed(), Plan(form="single", deterministic=True))
    assert not torch.are_deterministic_algorithms_enabled()  # compile leaves the process's mode as it was
    probe = cm.probe
    probe.seen.clear()  # detection ran the model while compiling
    logits = cm(torch.randint(0, 64, (2, 8)))
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the forward
    logits.float().pow(2).mean().backward()
    assert not torch.are_deterministic_algorithms_enabled()  # and after the backward
    assert probe.seen == [("forward", True), ("backward", True)]
    with torch.no_grad():
        cm(torch.randint(0, 64, (2, 8)))
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # a mode set by the user is put back as it was
    cm(torch.randint(0, 64, (2, 8))).sum().backward()
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    moepass.compile(_model("single"), Plan(form="single"))
    assert not torch.are_deterministic_algorithms_enabled()  # only when the plan asks
    text = moepass.explain(_model("single"), Plan(deterministic=True), graphs=False)
    assert "deterministic: on: the compiled model's forward and backward run under" in text


def test_explicit_deterministic_block_restores_the_mode():
    from moepass import determinism

    torch.use_deterministic_algorithms(False)
    with determinism.deterministic():
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_is_a_whole_plan_setting():
    assert Plan(deterministic=True).deterministic is True
    with pytest.raises(PlanError, match=r"Plan.blocks\['layers.0.mlp'\]\['deterministic'\]=True is invalid: "
                                        r"deterministic applies to the whole model \(determinism covers the whole model's run, "
                                        r".*\); set Plan\(deterministic=...\) on the whole plan, not per block."):
        Plan(blocks={"layers.0.mlp": {"deterministic": True}})
    with pytest.raises(PlanError, match=r"Plan.deterministic=1 is invalid: use True or False."):
        Plan(deterministic=1)


def test_cuda_needs_cublas_workspace_config(monkeypatch):
    """On a machine with CUDA, cuBLAS's fixed workspace must be configured before its first use."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    with pytest.raises(PlanError, match=r"Plan.deterministic=True needs CUBLAS_WORKSPACE_CONFIG set to one of "
                                        r"\[':4096:8', ':16:8'\] on a machine with CUDA \(it is None\).*export "
                                        r"CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        moepass.compile(_model("single"), Plan(deterministic=True))
    assert not torch.are_deterministic_algorithms_enabled()  # nothing half-done
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from moepass import determinism

    determinism.enable()
    assert torch.are_deterministic_algorithms_enabled()


def test_grouped_gemm_takes_fixed_configs_when_deterministic():
    """On a GPU the grouped GEMM autotunes (a timing race picks block_k, i.e. the summation order);
    under deterministic algorithms it takes pick_config's one config per shape, as interpreted."""
    from lowering import grouped_gemm as gg

    x, counts = torch.randn(8, 16), torch.tensor([5, 3])
    w_gate, w_up, w_down = torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 32)
    args = (x, counts, w_gate, w_up, w_down, None, None, None, "swiglu", 7.0, 1.702)
    torch.use_deterministic_algorithms(False)
    tuned = gg.spec_of(*args, interpreted=False)
    torch.use_deterministic_algorithms(True)
    fixed = gg.spec_of(*args, interpreted=False)
    assert (tuned.deterministic, tuned.fixed_configs) == (False, False)
    assert (fixed.deterministic, fixed.fixed_configs) == (True, True)
    assert "# Block sizes: @triton.autotune over CONFIGS." in gg.render(tuned)
    assert "# Block sizes: one config per shape (pick_config)." in gg.render(fixed)


def test_no_generated_kernel_uses_atomics():
    """Every lowered family's generated source (the GPU build, not the interpreted one) is atomic-free."""
    from moepass.lower import sources

    os.environ.setdefault("MOEPASS_VERIFY", "1")
    cm = moepass.compile(_model("single"), Plan(form="single", lowering="triton"))
    texts = [(name, family, text) for gm in cm.moepass_info.rewritten.values() for name, family, text in sources(gm)]
    families = {family for _, family, _ in texts}
    assert {"gating", "permute", "grouped_gemm", "combine"} <= families, families
    for name, family, text in texts:
        assert "atomic" not in text, (name, family)


def test_backend_runs_the_compiled_graph_under_the_mode_and_restores_it():
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    model = _model("single")
    compiled = torch.compile(model, backend="moepass", options={"plan": Plan(deterministic=True), "inner": "eager"})
    tokens = torch.randint(0, 64, (2, 8))
    logits = compiled(tokens)
    assert not torch.are_deterministic_algorithms_enabled()
    logits.float().pow(2).mean().backward()
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.allclose(logits, model(tokens), atol=1e-5)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch._dynamo.reset()
