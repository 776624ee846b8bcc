"""What `python -m moepass selfcheck` runs on every rank of its pool (`moepass.runtime.workers.Pool`): one
training step of each parallel form against the untouched model's step, and the collectives' bandwidth.

Each case is `case_*(rank, world, ...)` and returns plain numbers; a wrong figure raises AssertionError
naming what differs, which the pool reports as the item's failure. Tensors live on the rank's device: its
current CUDA device under NCCL (the pool sets it), else the CPU.

The parity method is the distributed tests' (tests/test_ep.py, tests/test_hp.py): the untouched model runs
the global batch (W ranks x BATCH_PER_RANK sequences) with the mean loss; rank r runs slice r of it in the
compiled model. Replicated gradients are averaged over the ranks, expert gradients already are the mean
of the ranks' losses', so every gradient (`moepass.logical_grads`) and every parameter after an SGD step
compares with the reference's. form="single" runs the whole batch on every rank.

HP runs on the sample LM whose MoE layers are Multi-Head LatentMoE (`samples.models.tiny_latent_lm`), where
HP keeps the math (on a standard block HP converts the block: another model). form="locality" changes
the routing by design (top-1 locality router plus its losses): its step is checked to run and stay
finite, and its loss's distance from the untouched model's is reported, not judged.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from moepass.pipeline import CompileInfo

BATCH_PER_RANK, SEQ = 2, 8
RTOL, ATOL = 1e-4, 1e-5  # fp32 tolerances for a distributed step vs one process (summation order, atomics)
LM = dict(vocab_size=64, dim=32, ffn_dim=64, top_k=2, layers=2, heads=4)


def rank_device() -> torch.device:
    """The rank's device: its current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_model(form: str, world: int) -> torch.nn.Module:
    """The sample LM a form is checked on, its sizes rounded up to a multiple of the world size: E experts
    (8 or more) for the expert-parallel forms, H latent heads (4 or more) for HP."""
    from samples.models import tiny_latent_lm, tiny_mixtral

    torch.manual_seed(0)
    if form == "hp":
        heads = world * math.ceil(4 / world)
        return tiny_latent_lm(heads=heads, head_dim=8, experts=4, top_k=2, latent_ffn_dim=16,
                              vocab_size=LM["vocab_size"], dim=LM["dim"], layers=LM["layers"])
    return tiny_mixtral(style="loop", num_experts=world * math.ceil(8 / world), **LM)


def plan_for(form: str, world: int):
    import moepass

    if form == "single":
        return moepass.Plan(form="single", keep_original_if_slower=False)  # the rewritten graph is what is checked
    extra = {"mu": 0.1, "gate": "learned"} if form == "locality" else {}
    return moepass.Plan(form=form, topology=moepass.Topology(1, world), **extra)


def lm_loss(model: Any, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The sample LM's next-token loss (`TinyMoELM.loss`), of the untouched or the compiled model."""
    return model.loss(tokens_BS)


def named(what: str) -> Callable[[str], str]:
    """An assert_close `msg` that puts `what` before torch's description of the difference."""
    return lambda message: f"{what}: {message}"


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def case_form_step(rank: int, world: int, form: str, fault: bool = False) -> dict:
    """One step (forward, backward, SGD step) of `form` vs the untouched model's step on the global batch:
    {"loss", "grad", "param": the largest differences, "grads": how many gradients were compared}. For
    form="locality": {"loss_vs_untouched", "aux"} (module doc). `fault`: the compiled loss is scaled by
    1.001 before backward, a planted failure (`selfcheck --fault form:NAME`)."""
    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecated collective names: not ours to judge
    # locality changes the routing by design: this item reports by how much (compile's warning says the same)
    warnings.filterwarnings("ignore", message="moepass.compile changed the math")
    device = rank_device()
    if device.type == "cuda":  # fp32 products in fp32 on both sides
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = sample_model(form, world).to(device)
    cm = moepass.compile(model, plan_for(form, world))
    info = cast("CompileInfo", cm.moepass_info)
    rewritten = {path: gm.form for path, gm in info.rewritten.items()}
    if set(rewritten.values()) != {form}:  # an untouched copy would pass every comparison below
        raise AssertionError(f"{form}: moepass.compile rewrote {rewritten or 'no block'} on {device}, not every MoE "
                             f"block into form {form!r}; detection says: "
                             + " | ".join(info.report.summary().splitlines()[:3]))
    distributed = form != "single"
    B = world * BATCH_PER_RANK
    tokens_BS = torch.randint(0, LM["vocab_size"], (B, SEQ + 1), generator=torch.Generator().manual_seed(100))
    tokens_BS = tokens_BS.to(device)
    mine_BS = tokens_BS[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK] if distributed else tokens_BS
    opt, ref_opt = torch.optim.SGD(cm.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)

    ref_loss = lm_loss(model, tokens_BS)
    ref_loss.backward()
    loss = lm_loss(cm, mine_BS)
    aux = moepass.aux_loss(cm) if form == "locality" else None
    total = loss + aux if aux is not None else loss
    if fault:
        total = total * 1.001
        loss = loss * 1.001
    total.backward()
    if distributed:
        all_reduce_replicated_grads(cm)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
    opt.step()
    ref_opt.step()
    _sync(device)
    if form == "locality":
        grads = moepass.logical_grads(cm)
        bad = [n for n, (g, _) in grads.items() if not torch.isfinite(g).all()]
        assert torch.isfinite(loss) and aux is not None and torch.isfinite(aux), \
            f"locality: loss {loss.item()} or aux loss {aux}: not finite"
        assert not bad, f"locality: gradients not finite: {bad[:3]}"
        return {"loss_vs_untouched": abs(loss.item() - ref_loss.item()), "aux": aux.item(), "grads": len(grads)}

    report = {"loss": abs(loss.item() - ref_loss.item()), "grad": 0.0, "param": 0.0, "grads": 0}
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=named("loss"))
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    for name, (g, index) in moepass.logical_grads(cm).items():
        ref_grad = ref_grads[name]
        assert ref_grad is not None, f"gradient {name}: the compiled model has one, the untouched model none"
        want = ref_grad[index or slice(None)]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=named(f"gradient {name}"))
        report["grad"] = max(report["grad"], _max_err(g, want))
        report["grads"] += 1
    assert report["grads"] > 0, f"{form}: moepass.logical_grads(compiled model) gave no gradient to compare"
    state, ref_params = moepass.logical_state_dict(cm), dict(model.named_parameters())
    for name, (_, index) in moepass.logical_grads(cm).items():
        value = state[name]
        value = value.to_local() if hasattr(value, "to_local") else value
        want = ref_params[name].detach()[index or slice(None)]
        torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL, msg=named(f"parameter {name}"))
        report["param"] = max(report["param"], _max_err(value, want))
    return report


def case_bandwidth(rank: int, world: int, op: str, nbytes: int, iters: int = 5) -> dict:
    """`op` ("all_to_all_single" or "all_reduce") on `nbytes` of fp32 per rank: its result checked, then the
    median time of `iters` calls after one warm-up; {"seconds": this rank's median}."""
    device = rank_device()
    numel = nbytes // 4 // world * world
    x = torch.full((numel,), float(rank), device=device)
    if op == "all_to_all_single":
        out = torch.empty_like(x)

        def call():
            dist.all_to_all_single(out, x)

        call()
        want = torch.arange(world, device=device, dtype=x.dtype).repeat_interleave(numel // world)
        torch.testing.assert_close(out, want, msg=named("all_to_all_single received wrong data"))
    elif op == "all_reduce":
        y = x.clone()

        def call():
            dist.all_reduce(y)

        call()
        total = world * (world - 1) / 2
        torch.testing.assert_close(y, torch.full_like(y, total), msg=named("all_reduce summed wrong"))
    else:
        raise ValueError(f"case_bandwidth(op={op!r}) is invalid: use 'all_to_all_single' or 'all_reduce'")
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"seconds": sorted(times)[len(times) // 2]}
