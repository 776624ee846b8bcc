"""Locality-aware routing (`Plan(form="locality")`, LocMoE): parity with a hand-written PyTorch reference
(outputs, both losses, every gradient) at W=1, W=2 as Topology(2, 1) and W=4 as Topology(2, 2); the
capacity never below the floor and the recorded delta; training with mu > 0 moves tokens to their node's
experts; `moepass.aux_loss` under torch.compile; the Plan errors.

The reference (`reference`) is plain PyTorch on the original block's own modules: the GrAP gate or the
block's router weight, ReLU, softmax, argmax, the floor from the regularised incomplete beta (mpmath),
token-order capacity per expert, the expert MLPs, L_aux and L_loc. Under EP every rank's batch is its own
capacity group and its own loss, so the distributed reference runs the block on each rank's slice; the
gradient compared is that of the mean of the ranks' losses (DDP's convention, as tests/test_ep.py).

Shape legend: T tokens of a rank, D width, E experts.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

import moepass  # noqa: E402
from moepass import PlanError  # noqa: E402

D, F_DIM, E = 16, 32, 8
B, S = 2, 12  # per rank: T = 24 tokens
RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------------------------
# Helpers that run inside the ranks.
# ----------------------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, dim=D, experts=E):
        super().__init__()
        from samples.models import LoopMoE

        self.moe = LoopMoE(dim, F_DIM, experts, top_k=2)

    def forward(self, x):
        return self.moe(x)


def own_node_experts(rank, nodes, world, experts=E):
    """Experts on `rank`'s node: E/W consecutive experts per rank, ranks node-major (written out by hand)."""
    per_rank, per_node = experts // world, world // nodes
    node = rank // per_node
    return list(range(node * per_node * per_rank, (node + 1) * per_node * per_rank))


def d_local(own, experts=E):
    from moepass.rewrite.locality import LOCAL_SMOOTHING as eps

    return torch.tensor([(1 - eps) / len(own) * (e in own) + eps / experts for e in range(experts)])


def floor_of(delta, experts, dim):
    """ec_min of Theorem 1: 1 / (E * (1 - I_{delta^2}(1/2, (D-1)/2))), straight from mpmath."""
    import mpmath

    return float(1 / (experts * (1 - mpmath.betainc(0.5, (dim - 1) / 2, 0, delta**2, regularized=True))))


def reference(block, x_TD, gate, capacity_factor, target_E, alpha, mu):
    """The locality block in plain PyTorch: (out_TD, L_aux, L_loc, delta, floor, capacity)."""
    T, dim = x_TD.shape
    n = len(block.experts)
    x32 = x_TD.float()
    if gate == "grap":
        g_ED = torch.zeros(n, dim)
        for i in range(n):
            g_ED[i, i * dim // n:(i + 1) * dim // n] = n / dim
        logits_TE = x32 @ g_ED.T
    else:
        g_ED = block.gate.weight
        logits_TE = x32 @ g_ED.float().T
    probs_TE = torch.softmax(torch.relu(logits_TE), dim=-1)
    ids_T = probs_TE.argmax(dim=-1)
    w_T = probs_TE[torch.arange(T), ids_T]
    keep_T = torch.ones(T, dtype=torch.bool)
    delta = floor = capacity = None
    if capacity_factor is not None:
        cos_T = (x32.double() @ g_ED.detach().double().T)[torch.arange(T), ids_T] / (
            x32.double().norm(dim=-1) * g_ED.detach().double()[ids_T].norm(dim=-1))
        delta = min(max(cos_T.min().item(), 0.0), math.nextafter(1.0, 0.0))
        floor = floor_of(delta, n, dim)
        capacity = min(T, max(math.ceil(floor), math.ceil(T * capacity_factor / n)))
        seen = [0] * n
        for t in range(T):
            seen[ids_T[t]] += 1
            keep_T[t] = seen[ids_T[t]] <= capacity
    out_TD = torch.zeros_like(x_TD)
    for e in range(n):
        rows = torch.where((ids_T == e) & keep_T)[0]
        if rows.numel():
            out_TD = out_TD.index_add(0, rows, block.experts[e](x_TD[rows]) * w_T[rows, None])
    f_E = torch.bincount(ids_T, minlength=n).float() / T
    P_E = probs_TE.mean(dim=0)
    l_aux = alpha * n * (f_E * P_E).sum()
    l_loc = mu * (P_E * (P_E.log() - target_E.log())).sum()
    return out_TD, l_aux, l_loc, delta, floor, capacity


def _inputs(world, seed, spike=0.0):
    """[world * T, D] inputs; `spike` > 0 adds a positive bump on one GrAP block per token (raises delta)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * B * S, D, generator=g)
    if spike:
        x = torch.rand(world * B * S, D, generator=g)
        block = torch.randint(0, E, (world * B * S,), generator=g)
        for t, k in enumerate(block.tolist()):
            x[t, k * D // E:(k + 1) * D // E] += spike
    return x


def case_parity(rank, world, nodes, gate, capacity_factor, spike=0.0, alpha=0.01, mu=0.3):
    """The compiled locality block vs `reference` on every rank's slice: outputs, losses, every gradient."""
    import copy

    from moepass.runtime.grads import all_reduce_replicated_grads

    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    plan = moepass.Plan(form="locality", gate=gate, mu=mu, alpha=alpha, capacity_factor=capacity_factor,
                        topology=moepass.Topology(nodes, world // nodes))
    cm = moepass.compile(net, plan)
    x_all = _inputs(world, seed=7, spike=spike).requires_grad_()
    gy_all = torch.randn(world * B * S, D, generator=torch.Generator().manual_seed(8))
    T = B * S
    # reference: every rank's slice, the mean of the ranks' losses
    ref_total, ref_rank = 0.0, None
    for r in range(world):
        target = d_local(own_node_experts(r, nodes, world))
        got = reference(ref.moe, x_all[r * T:(r + 1) * T], gate, capacity_factor, target, alpha, mu)
        loss_r = (got[0] * gy_all[r * T:(r + 1) * T]).sum() + got[1] + got[2]
        ref_total = ref_total + loss_r / world
        if r == rank:
            ref_rank = got
    ref_total.backward()
    # locality form on this rank's slice
    x = x_all.detach()[rank * T:(rank + 1) * T].clone().view(B, S, D).requires_grad_()
    out = cm(x)
    aux = moepass.aux_loss(cm)
    ((out.view(T, D) * gy_all[rank * T:(rank + 1) * T]).sum() + aux).backward()
    all_reduce_replicated_grads(cm)
    state = cm.moe.locality.locality_state()
    out_ref, aux_ref, loc_ref, delta, floor, capacity = ref_rank
    err = {"out": (out.view(T, D) - out_ref).abs().max().item(),
           "aux": abs(state["aux"] - aux_ref.item()), "loc": abs(state["loc"] - loc_ref.item()),
           "aux_total": abs(aux.item() - (aux_ref + loc_ref).item())}
    torch.testing.assert_close(out.view(T, D), out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(aux, (aux_ref + loc_ref).detach(), rtol=RTOL, atol=ATOL)
    assert abs(state["aux"] - aux_ref.item()) <= 1e-6 and abs(state["loc"] - loc_ref.item()) <= 1e-6, (state, err)
    # x: the rank's own loss (the exchange's backward leaves input gradients unscaled) = world * d(mean)/dx
    torch.testing.assert_close(x.grad.view(T, D), world * x_all.grad[rank * T:(rank + 1) * T], rtol=RTOL, atol=ATOL)
    ref_grads = {f"moe.{n}": p.grad for n, p in ref.moe.named_parameters()}
    grads = moepass.logical_grads(cm)
    compared = []
    for name, (g, rows) in grads.items():
        want = ref_grads[name] if rows is None else ref_grads[name][rows]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        err["grad"] = max(err.get("grad", 0.0), (g - want).abs().max().item())
        compared.append(name)
    router = "moe.gate.weight"
    assert (router in compared) == (gate == "learned"), compared  # GrAP: the router weight is frozen, unread
    experts_here = {int(n.split(".")[2]) for n in compared if ".experts." in n}
    assert experts_here == set(range(rank * E // world, (rank + 1) * E // world)), experts_here
    if capacity_factor is not None:
        assert state["capacity"] == capacity and state["delta"] == pytest.approx(delta, abs=1e-6), (state, delta)
        assert state["floor"] == pytest.approx(floor_of(state["delta"], E, D), rel=1e-9), state  # of the delta
        assert state["floor"] == pytest.approx(floor, rel=1e-5), (state["floor"], floor)  # delta in fp32 vs fp64
    return {"err": err, "state": state, "capacity": capacity, "dropped": int((out.view(T, D) == 0).all(-1).sum())}


def case_floor(rank, world, cases):
    """Seeded cases (spike, capacity factor): capacity = max(ceil(floor), ceil(T*cf/E)) clamped to T (never
    below the floor), delta equals a direct float64 computation, kept rows per expert = min(count, capacity)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    out = []
    models = {cf: moepass.compile(Net(), moepass.Plan(form="locality", gate="grap", mu=0.0, capacity_factor=cf,
                                                      topology=moepass.Topology(1, 1)))
              for cf in sorted({c for _, c, _ in cases})}
    for seed, cf, spike in cases:
        x = _inputs(1, seed, spike)
        cm = models[cf]
        with torch.no_grad():
            y = cm(x)
        s = cm.moe.locality.locality_state()
        T = x.shape[0]
        logits = x.view(T, E, D // E).mean(-1)
        ids = torch.softmax(torch.relu(logits), -1).argmax(-1)
        gate = torch.zeros(E, D, dtype=torch.float64)
        for i in range(E):
            gate[i, i * D // E:(i + 1) * D // E] = 1.0
        cos = (x.double() * gate[ids]).sum(-1) / (x.double().norm(dim=-1) * gate[ids].norm(dim=-1))
        delta = min(max(cos.min().item(), 0.0), math.nextafter(1.0, 0.0))
        assert s["delta"] == pytest.approx(delta, abs=1e-6), (s["delta"], delta)
        assert s["floor"] == pytest.approx(floor_of(s["delta"], E, D), rel=1e-9)
        assert s["capacity"] == min(T, max(math.ceil(s["floor"]), math.ceil(T * cf / E)))
        assert s["capacity"] >= min(T, math.ceil(s["floor"]))
        counts = torch.bincount(ids, minlength=E)
        kept = int((y != 0).any(-1).sum())
        assert kept == int(counts.clamp(max=s["capacity"]).sum()), (kept, counts.tolist(), s)
        assert F.cosine_similarity(x, gate.float()[ids]).min().item() == pytest.approx(cos.min().item(), abs=1e-6)
        out.append((seed, cf, spike, round(s["delta"], 4), round(s["floor"], 3), s["capacity"],
                    math.ceil(T * cf / E), kept))
    return out


def case_train(rank, world, mu, steps, lr):
    """W=2 as two nodes of one rank: rank r's tokens are shifted along its own direction (the ranks' data
    differ, so a shared router can tell them apart). Trains router and experts `steps` SGD steps on
    mse(out, 0.5 x) + aux_loss; returns the own-node share and the dispatch bytes of one final forward."""
    from moepass.runtime.grads import all_reduce_replicated_grads

    torch.manual_seed(0)
    cm = moepass.compile(Net(), moepass.Plan(form="locality", gate="learned", mu=mu, capacity_factor=None,
                                             topology=moepass.Topology(2, 1)))
    opt = torch.optim.SGD(cm.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)
    shift = torch.zeros(D)
    shift[rank] = 2.0
    shares = []
    for _ in range(steps):
        x = torch.randn(B * S, D, generator=g) + shift
        opt.zero_grad()
        out = cm(x)
        loss = torch.nn.functional.mse_loss(out, 0.5 * x) + moepass.aux_loss(cm)
        loss.backward()
        all_reduce_replicated_grads(cm)
        opt.step()
        shares.append(round(cm.moe.locality.locality_state()["own_node_share"], 4))
    x = torch.randn(B * S, D, generator=g) + shift
    moepass.reset_comm_stats()
    with torch.no_grad():
        cm(x)
    stats = moepass.comm_stats()["dispatch"]
    own = cm.moe.locality.locality_state()["own_node_share"]
    return {"first_share": shares[0], "final_share": own, "own_tokens": round(own * B * S),
            "dispatch_inter": stats["inter"], "dispatch_self": stats["self"], "dispatch_intra": stats["intra"]}


def _grads(model):
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
            for n, p in model.named_parameters() if p.grad is not None}


def case_compile(rank, world, gate, steps, capacity_factor=0.5):
    """torch.compile(model) (inductor) vs eager: outputs, aux_loss, every gradient, for `steps` steps."""
    torch.manual_seed(0)
    plan = moepass.Plan(form="locality", gate=gate, mu=0.5, capacity_factor=capacity_factor,
                        topology=moepass.Topology(1, 1))
    eager = moepass.compile(Net(), plan)
    torch.manual_seed(0)  # the same initial weights (a compiled EP model holds process groups: no deepcopy)
    compiled_model = moepass.compile(Net(), plan)
    compiled = torch.compile(compiled_model)
    errs = []
    for step in range(steps):
        x = _inputs(1, seed=20 + step, spike=0.5 * step).view(B, S, D)
        results = []
        for model, run in ((eager, eager), (compiled_model, compiled)):
            model.zero_grad()
            xi = x.clone().requires_grad_()
            out = run(xi)
            aux = moepass.aux_loss(model)
            (out.square().mean() + aux).backward()
            results.append((out.detach(), aux.detach(), xi.grad, _grads(model),
                            model.moe.locality.locality_state()))
        (o1, a1, x1, g1, s1), (o2, a2, x2, g2, s2) = results
        torch.testing.assert_close(o2, o1, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(a2, a1, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(x2, x1, rtol=RTOL, atol=ATOL)
        assert set(g1) == set(g2)
        for n in g1:
            torch.testing.assert_close(g2[n], g1[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        assert [k for k, v in s1.items() if v is None] == [k for k, v in s2.items() if v is None], (s1, s2)
        assert {k: v for k, v in s2.items() if v is not None} == pytest.approx(
            {k: v for k, v in s1.items() if v is not None}, rel=RTOL, abs=ATOL), (s1, s2)
        assert a1.item() > 0
        errs.append(abs(a2.item() - a1.item()))
    return errs


def case_aux_errors(rank, world):
    """aux_loss: zero without locality blocks, errors before any forward and after an eval forward."""
    torch.manual_seed(0)
    plain = moepass.compile(Net(), moepass.Plan(form="ep", topology=moepass.Topology(1, 1)))
    zero = moepass.aux_loss(plain)
    cm = moepass.compile(Net(), moepass.Plan(form="locality", mu=0.1, topology=moepass.Topology(1, 1)))
    messages = []
    try:
        moepass.aux_loss(cm)
    except RuntimeError as err:
        messages.append(str(err))
    cm.eval()
    with torch.no_grad():
        cm(torch.randn(4, D))
    try:
        moepass.aux_loss(cm)
    except RuntimeError as err:
        messages.append(str(err))
    cm.train()
    cm(torch.randn(4, D))
    return zero.item(), zero.shape, messages, moepass.aux_loss(cm).requires_grad


def case_ddp(rank, world):
    """DDP over a locality model (W=2, two nodes): DDP broadcasts rank 0's buffers every forward, yet each rank
    keeps its own D_local, and the losses equal the same model's without DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        cm = moepass.compile(Net(), moepass.Plan(form="locality", mu=0.3, topology=moepass.Topology(2, 1)))
        run = DDP(cm) if wrap else cm
        x = _inputs(world, seed=3)[rank * B * S:(rank + 1) * B * S]
        for _ in range(2):  # the second forward follows DDP's buffer broadcast
            out = run(x)
            aux = moepass.aux_loss(run)
            (out.square().mean() + aux).backward()
        results.append((aux.item(), cm.moe.locality.log_target_E.exp()))
    (plain, target), (ddp, ddp_target) = results
    torch.testing.assert_close(ddp_target, d_local(own_node_experts(rank, 2, world)))
    torch.testing.assert_close(target, ddp_target)
    assert abs(plain - ddp) <= 1e-6, (plain, ddp)
    return ddp


def case_tiny_mixtral(rank, world, steps):
    """The demo LM, every MoE layer in the locality form at W=2 (two nodes), trained with aux_loss."""
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=64, dim=32, ffn_dim=64, num_experts=8, top_k=2, layers=2, heads=4)
    cm = moepass.compile(model, moepass.Plan(form="locality", gate="grap", mu=0.1, capacity_factor=1.25,
                                             topology=moepass.Topology(2, 1)))
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        opt.zero_grad()
        ce = cm.loss(tokens)
        aux = moepass.aux_loss(cm)
        (ce + aux).backward()
        all_reduce_replicated_grads(cm)
        opt.step()
        losses.append((ce.item(), aux.item()))
    states = {p: m.locality_state() for p, m in cm.named_modules() if hasattr(m, "locality_state")}
    return losses, states


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------

PARITY_CASES = [  # (gate, capacity_factor, spike): dropless, drops at delta = 0, the floor binding
    ("grap", None, 0.0), ("learned", None, 0.0), ("grap", 0.25, 0.0), ("learned", 0.25, 0.0), ("grap", 0.1, 1.0),
]


@pytest.mark.distributed
def test_parity_w1():
    for gate, cf, spike in PARITY_CASES:
        (res,) = pool(1).run(case_parity, 1, gate, cf, spike)
        print(gate, cf, spike, res)
        if cf == 0.25:
            assert res["dropped"] > 0  # capacity in effect
        if spike:
            assert res["capacity"] > math.ceil(B * S * cf / E)  # the floor decides the capacity


@pytest.mark.distributed
@pytest.mark.parametrize("world,nodes", [(2, 2), (4, 2)])
def test_parity_distributed(world, nodes):
    for gate, cf, spike in PARITY_CASES[2:]:
        results = pool(world).run(case_parity, nodes, gate, cf, spike)
        print(world, nodes, gate, cf, spike, [r["err"] for r in results], [r["capacity"] for r in results])


@pytest.mark.distributed
def test_capacity_never_below_floor():
    cases = [(seed, cf, spike) for seed in (1, 2) for cf in (0.05, 0.5, 2.0) for spike in (0.0, 0.8, 1.0, 2.0)]
    (rows,) = pool(1).run(case_floor, cases)
    for row in rows:
        print(row)  # seed, c_f, spike, delta, ec_min, capacity, ceil(T*c_f/E), kept rows
    assert any(cf_cap < c < B * S for *_, c, cf_cap, _ in rows)  # the floor decides, below the clamp
    assert any(c == B * S < math.ceil(floor) for *_, floor, c, _, _ in rows)  # the clamp to T
    assert any(c == cf_cap > math.ceil(floor) for *_, floor, c, cf_cap, _ in rows)  # c_f decides


@pytest.mark.distributed
def test_locality_loss_moves_tokens_to_their_node():
    base = pool(2).run(case_train, 0.0, 30, 0.5)
    local = pool(2).run(case_train, 2.0, 30, 0.5)
    for name, res in (("mu=0", base), ("mu=2", local)):
        print(name, res)
    for r in range(2):
        assert local[r]["final_share"] > base[r]["final_share"]
        assert local[r]["dispatch_inter"] < base[r]["dispatch_inter"]
    assert sum(r["dispatch_inter"] for r in local) < 0.5 * sum(r["dispatch_inter"] for r in base)


@pytest.mark.distributed
@pytest.mark.parametrize("gate", ["grap", "learned"])
def test_aux_loss_under_torch_compile(gate):
    (errs,) = pool(1).run(case_compile, gate, 2, timeout=600)
    print(gate, errs)


@pytest.mark.distributed
def test_aux_loss_errors():
    (zero, shape, messages, grad) = pool(1).run(case_aux_errors)[0]
    assert zero == 0.0 and shape == torch.Size([])
    assert messages == [
        "moepass.aux_loss: locality block 'moe' has not run a forward yet; call aux_loss after the model's forward, "
        "before backward.",
        "moepass.aux_loss: the latest forward of locality block 'moe' ran in eval mode, which computes no auxiliary "
        "loss; call model.train() before the forward whose loss you train on.",
    ]
    assert grad


@pytest.mark.distributed
def test_ddp_keeps_each_ranks_local_distribution():
    losses = pool(2).run(case_ddp)
    assert losses[0] != losses[1]  # each rank's own D_local and tokens


@pytest.mark.distributed
def test_tiny_mixtral_trains_at_w2():
    results = pool(2).run(case_tiny_mixtral, 3)
    for losses, states in results:
        print(losses, states)
        assert all(math.isfinite(c) and a > 0 for c, a in losses)
        assert sorted(states) == ["layers.0.mlp.locality", "layers.1.mlp.locality"]
        assert all(s["capacity"] >= 1 and s["floor"] > 0 for s in states.values())


def test_plan_errors():
    cases = [
        (dict(form="locality", gate="grp", mu=0.1),
         "Plan.gate='grp' is invalid: use one of ['grap', 'learned']. Did you mean 'grap'?"),
        (dict(form="locality", mu=-0.5),
         "Plan.mu=-0.5 is invalid: use a finite float >= 0, the weight of the locality loss mu*KL(D_current || "
         "D_local) (0 turns it off)."),
        (dict(form="locality", mu=0.1, alpha=float("nan")),
         "Plan.alpha=nan is invalid: use a finite float >= 0, the weight of the balance loss (0 turns it off)."),
        (dict(form="locality"),
         "Plan(form='locality') needs mu=<float >= 0>, the weight of the locality loss mu*KL(D_current || "
         "D_local); mu=0 gives the plain top-1 router with the balance loss only (a switch router)."),
        (dict(form="locality", mu=0.1, packing=2),
         "Plan.packing=2 has no effect with form='locality': it hosts k times the experts per device under "
         "form='ep' (form='auto' picks its own). Use form='ep', or leave it 1."),
        (dict(form="ep", mu=0.1),
         "Plan.mu=0.1 has no effect with form='ep': gate, mu and alpha configure the routing of form='locality'. "
         "Use form='locality', or leave it None."),
        (dict(form="single", gate="grap"),
         "Plan.gate='grap' has no effect with form='single': gate, mu and alpha configure the routing of "
         "form='locality'. Use form='locality', or leave it 'learned'."),
        (dict(form="fsep", alpha=0.02),
         "Plan.alpha=0.02 has no effect with form='fsep': gate, mu and alpha configure the routing of "
         "form='locality'. Use form='locality', or leave it 0.01."),
    ]
    for kwargs, message in cases:
        with pytest.raises(PlanError) as err:
            moepass.Plan(**kwargs)
        assert str(err.value) == message


def test_grap_needs_width_multiple_of_experts():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    net = Net(dim=18, experts=4)  # 18 % 4 = 2: raised by the conversion, before any process group is made
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())  # compile checks one exists first
    try:
        with pytest.raises(PlanError) as err:
            moepass.compile(net, moepass.Plan(form="locality", gate="grap", mu=0.1))
    finally:
        dist.destroy_process_group()
    assert str(err.value) == (
        "Plan.gate='grap' is invalid for block moe: the GrAP gate averages E=4 contiguous blocks of D/E channels, "
        "but D=18 is not a multiple of 4 (D % E = 2); use gate='learned' (the block's own router), or leave this "
        "block alone with Plan(blocks={'moe': None}).")


def test_explain_marks_the_math_change():
    text = moepass.explain(Net(), moepass.Plan(form="locality", gate="grap", mu=0.2, capacity_factor=1.0,
                                               topology=moepass.Topology(2, 1)), graphs=False)
    print(text)
    assert ("moepass plan: form='locality' lowering='auto' (changes the model's math in 1 block(s), as the plan "
            "names: see each 'math')") in text
    assert "pass convert:locality: changed" in text
    assert "locality routing (changes the model's math: named by Plan.form='locality'): GrAP" in text
    assert "L_aux = 0.01*E*sum f_i*P_i; L_loc = 0.2*KL(mean softmax || D_local)" in text
    assert "this rank's node holds experts [0, 1, 2, 3]" in text
    assert "capacity: per (source rank, expert): max(ceil(ec_min(delta)), ceil(T*1/E)) clamped to T" in text
    assert f"ec_min(delta=0) = {floor_of(0.0, E, D):.4g} tokens" in text
