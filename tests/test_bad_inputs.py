"""The bad-input catalogue: plans, models, worlds and tensors a user gets wrong, each with its exact error.

One case table. Every case names the module path or field, the value and the fix in its message (the
regex pins all three), and the user's model comes out untouched: same module types, same parameter and
buffer values, no hooks added. World-size cases run on the in-process "fake" process group (graphs only,
no data), so they need no spawned ranks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import moepass
from moepass import Plan, PlanError, Topology
from samples.models import tiny_latent_lm, tiny_mixtral

BLOCK = "layers.0.mlp"


@dataclass(frozen=True)
class Case:
    id: str
    act: Callable[[nn.Module], object]  # does the wrong thing to (a model built by `model`)
    error: type[Exception]
    match: str  # regex over the message: where, what, fix
    model: Callable[[], nn.Module] = lambda: tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32)
    world: int | None = None  # fake process group of this size around the case


def _compile(plan: Plan, **kw) -> Callable[[nn.Module], object]:
    return lambda model: moepass.compile(model, plan, **kw)


def _block_input(x_fn: Callable[[], torch.Tensor], anomaly: bool = False) -> Callable[[nn.Module], object]:
    """Compile (single form) and feed the first MoE block `x_fn()` directly."""

    def act(model: nn.Module) -> object:
        cm = moepass.compile(model, Plan())
        mode = torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext()
        with mode:
            return cm.get_submodule(BLOCK)(x_fn())

    return act


def _nan_hidden() -> torch.Tensor:
    x = torch.randn(2, 4, 32)
    x[1, 2, 5] = float("nan")
    x[0, 0, 0] = float("inf")
    return x


CASES = [
    # ---- plans -------------------------------------------------------------------------------------
    Case("form-typo", lambda m: Plan(form="epp"), PlanError,
         r"Plan.form='epp' is invalid: use one of \['single', 'ep', 'fsep', 'hp', 'locality', 'auto'\].*'ep'"),
    Case("unknown-field", lambda m: Plan(chunks=2), PlanError,
         r"Plan got an unknown field 'chunks': valid fields are \[.*\]"),
    Case("ep-size-zero", lambda m: Plan(form="ep", ep_size=0), PlanError,
         r"Plan.ep_size=0 is invalid: use a positive int dividing the world size."),
    Case("capacity-negative", lambda m: Plan(capacity_factor=-1.0), PlanError,
         r"Plan.capacity_factor=-1.0 is invalid: use a float > 0, or None for dropless routing."),
    Case("chunks-zero", lambda m: Plan(form="ep", a2a_chunks=0), PlanError,
         r"Plan.a2a_chunks=0 is invalid: use an int >= 1 or 'auto'."),
    Case("slots-with-ep", lambda m: Plan(form="ep", slots_per_device=2), PlanError,
         r"Plan.slots_per_device=2 has no effect with form='ep': it sizes the expert slots of FSEP. Use "
         r"form='fsep', or leave it None"),
    Case("locality-without-mu", lambda m: Plan(form="locality"), PlanError,
         r"Plan\(form='locality'\) needs mu=<float >= 0>, the weight of the locality loss"),
    Case("hardware-unknown", lambda m: Plan(hardware="h200x"), PlanError,
         r"Plan.hardware='h200x' is invalid: use a preset name \[.*\], a calibration profile path"),
    Case("block-override-not-dict", lambda m: Plan(blocks={BLOCK: 3}), PlanError,
         r"Plan.blocks\['layers.0.mlp'\]=3 is invalid: use a dict of Plan fields, or None to leave the block alone."),
    Case("deterministic-per-block", lambda m: Plan(blocks={BLOCK: {"deterministic": True}}), PlanError,
         r"Plan.blocks\['layers.0.mlp'\]\['deterministic'\]=True is invalid: deterministic applies to the whole "
         r"model .*; set Plan\(deterministic=...\) on the whole plan, not per block."),
    Case("grad-sync-per-block", lambda m: Plan(blocks={BLOCK: {"grad_sync": "scheduler"}}), PlanError,
         r"Plan.blocks\['layers.0.mlp'\]\['grad_sync'\]='scheduler' is invalid: grad_sync applies to the whole "
         r"model"),
    Case("strict-per-block", lambda m: Plan(blocks={BLOCK: {"strict": True}}), PlanError,
         r"Plan.blocks\['layers.0.mlp'\]\['strict'\]=True is invalid: strict applies to the whole model .*; set "
         r"Plan\(strict=...\) on the whole plan, not per block."),
    Case("grad-sync-typo", lambda m: Plan(grad_sync="sched"), PlanError,
         r"Plan.grad_sync='sched' is invalid: use one of \['none', 'scheduler'\]."),
    Case("plan-not-a-plan", lambda m: moepass.compile(m, "ep"), PlanError,
         r"moepass.compile\(plan='ep'\) is invalid: pass a moepass.Plan\(...\)"),
    Case("auto-without-batch", _compile(Plan(form="auto")), PlanError,
         r"Plan.form='auto' needs Plan.batch=\(batch, seq\) tokens per rank for the cost model; pass it, or name a "
         r"form explicitly."),
    Case("backend-unknown-option", lambda m: moepass.backend.moepass_backend(torch.fx.symbolic_trace(nn.Linear(2, 2)),
                                                                             [], {"chunks": 2}), PlanError,
         r"torch.compile\(backend='moepass', options=\{'chunks': ...\}\) has an unknown key"),
    # ---- worlds and process groups -----------------------------------------------------------------
    Case("ep-without-process-group", _compile(Plan(form="ep")), PlanError,
         r"Plan\(form='ep'\) for block 'layers.0.mlp' needs torch.distributed initialised \(init_process_group\) on "
         r"every rank: run under torchrun or torch.multiprocessing.spawn, or use form='single' on one process."),
    Case("fsep-without-process-group", _compile(Plan(form="fsep"), inplace=True), PlanError,
         r"Plan\(form='fsep'\) for block 'layers.0.mlp' needs torch.distributed initialised"),
    Case("topology-mismatches-world", _compile(Plan(form="ep", topology=Topology(2, 2))), PlanError,
         r"Plan.topology=Topology\(nodes=2, ranks_per_node=2.*\) is invalid: it has 4 ranks but the world has 2; use "
         r"Topology\(nodes, ranks_per_node\) with nodes\*ranks_per_node=2.", world=2),
    Case("ep-size-not-dividing-world", _compile(Plan(form="ep", ep_size=3)), PlanError,
         r"Plan.ep_size=3 is invalid: it must divide the world size 2.", world=2),
    Case("experts-not-splitting", _compile(Plan(form="ep")), PlanError,
         r"Plan.ep_size=None \(the world size, 2\) is invalid for block layers.0.mlp: its 3 experts do not split "
         r"evenly over 2 EP ranks; use an ep_size dividing both 3 and the world size 2 \(valid: \[1\]\)",
         model=lambda: tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32, num_experts=3, top_k=1), world=2),
    Case("packing-not-dividing", _compile(Plan(form="ep", packing=4)), PlanError,
         r"Plan.packing=4 is invalid for block layers.0.mlp: packing 4 spreads the experts over ep_size/4 ranks, and "
         r"ep_size 2 is not divisible by 4; use a packing dividing 2.", world=2),
    Case("fsep-slots-cannot-hold-experts", _compile(Plan(form="fsep", slots_per_device=3)), PlanError,
         r"Plan.slots_per_device=3 is invalid for block layers.0.mlp: 2 devices x 3 slots cannot host its 8 experts; "
         r"use slots_per_device >= 4.", world=2),
    Case("hp-heads-not-splitting", _compile(Plan(form="hp")), PlanError,
         r"Plan.form='hp' is invalid for block layers.0.mlp: its 3 heads do not split over 2 ranks; use "
         r"Plan\(heads=...\) a multiple of 2 \(conversion\) or an ep_size dividing 3.",
         model=lambda: tiny_latent_lm(heads=3, head_dim=16, dim=32, vocab_size=32), world=2),
    Case("hp-head-ep-not-dividing", _compile(Plan(form="hp", head_ep_size=3)), PlanError,
         r"Plan.head_ep_size=3 is invalid: it must divide the 2 ranks of a block .* use a divisor of 2.",
         model=lambda: tiny_latent_lm(dim=32, vocab_size=32), world=2),
    Case("hp-cannot-convert-capacity", _compile(Plan(form="hp")), PlanError,
         r"Plan.form='hp' cannot convert block layers.0.mlp: it has capacity, which a Multi-Head LatentMoE does not; "
         r"leave it alone with Plan\(blocks=\{'layers.0.mlp': None\}\).",
         model=lambda: tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32, style="gshard"), world=2),
    # ---- tensors -----------------------------------------------------------------------------------
    Case("hidden-wrong-width", _block_input(lambda: torch.randn(2, 8, 16)), ValueError,
         r"MoE block 'layers.0.mlp' got hidden states of shape \(2, 8, 16\): its router and experts take width D=32; "
         r"pass \[..., 32\]."),
    Case("hidden-token-ids", _block_input(lambda: torch.randint(0, 32, (2, 8, 32))), ValueError,
         r"MoE block 'layers.0.mlp' got hidden states of dtype torch.int64: pass floating-point hidden states "
         r"\[..., 32\] \(e.g. the embedding's output, not token ids\)."),
    Case("hidden-nan-inf-under-anomaly", _block_input(_nan_hidden, anomaly=True), ValueError,
         r"MoE block 'layers.0.mlp' got 2 non-finite hidden-state values \(NaN/inf\) of 256: they come from the layers "
         r"before it; fix the source"),
]


@contextlib.contextmanager
def _world(size: int | None):
    if size is None:
        yield
        return
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fingerprint(model: nn.Module) -> tuple:
    """Module types by path, every parameter and buffer's value, and the hooks: what 'untouched' means."""
    types = tuple((name, type(m)) for name, m in model.named_modules())
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return types, tensors, hooks


def test_the_catalogue_has_at_least_twenty_cases():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_its_error_and_leaves_the_model_untouched(case: Case):
    torch.manual_seed(0)
    model = case.model()
    types, tensors, hooks = _fingerprint(model)
    with _world(case.world), pytest.raises(case.error, match=case.match):
        case.act(model)
    after_types, after_tensors, after_hooks = _fingerprint(model)
    assert after_types == types and after_hooks == hooks
    assert after_tensors.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(after_tensors[name], value), name


def test_non_finite_hidden_states_pass_through_without_anomaly_mode():
    """Outside anomaly detection the check costs nothing (no host sync): NaN flows as in the original model."""
    torch.manual_seed(0)
    model = tiny_mixtral(dim=32, ffn_dim=32, vocab_size=32)
    cm = moepass.compile(copy.deepcopy(model), Plan())
    x = _nan_hidden()
    ours, theirs = cm.get_submodule(BLOCK)(x), model.get_submodule(BLOCK)(x)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
