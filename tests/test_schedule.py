"""The schedule pass on the fake process group (graphs only): issue/wait counts, pipeline order,
provenance, verifier, golden snapshot; the cost model's chunk count and packing; plan errors.

The snapshot under tests/golden/schedule_ep_n2.txt is regenerated with MOEPASS_UPDATE_GOLDEN=1
(review the diff).
"""

from __future__ import annotations

import functools
import operator
from pathlib import Path

import pytest
import torch
from _golden import check_golden

import moepass
from moepass import schedule
from moepass.runtime import collectives as comm
from moepass.runtime.scheduler import MARK

GOLDEN = Path(__file__).parent / "golden"
D, F, E, K = 16, 32, 8, 2


@pytest.fixture
def fake_world():
    """A fake process group of `world` ranks for one test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.runtime.topology import reset_groups

    started = []

    def start(world, rank=0):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        started.append(world)

    yield start
    if started:
        dist.destroy_process_group()
        reset_groups()


def _block():
    from samples.models import LoopMoE

    torch.manual_seed(0)
    return LoopMoE(D, F, E, top_k=K)


def _compile(world, **plan):
    return moepass.compile(_block(), moepass.Plan(form="ep", topology=moepass.Topology(1, world), **plan))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _table_of(splits):
    """The host split table a dispatch/combine's splits_2P argument is a row (or flipped row) of."""
    while splits.target in (operator.getitem, "flip"):
        splits = splits.args[0]
    return splits


@pytest.mark.parametrize("n", [1, 2, 4])
def test_issue_wait_counts(fake_world, n):
    fake_world(4)
    gm = _compile(4, a2a_chunks=n)
    t = _targets(gm)
    a2a = [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target is comm.ALL_TO_ALL]
    assert sum(nd.args[4] == "dispatch" for nd in a2a) == n and sum(nd.args[4] == "combine" for nd in a2a) == n
    # one count exchange and one host split table for every chunk; a wait per dispatch and combine + the counts'
    assert t.count(comm.EXCHANGE_COUNTS) == 1 and t.count(comm.HOST_SPLITS) == 1 and t.count(comm.WAIT) == 2 * n + 1
    table = next(nd for nd in gm.graph.nodes if nd.target is comm.HOST_SPLITS)
    for nd in a2a:  # every exchange reads its Python-int splits from the table: no host sync of its own
        assert _table_of(nd.args[6]) is table, nd.format_node()
    assert t.count(MARK) == 2 * n + 1  # expert_in/out per chunk + the combine region
    record = gm.history[[h["pass"] for h in gm.history].index("schedule")]
    assert record["stats"]["chunks"] == n and record["stats"]["all_to_all"] == 2 * n
    moepass.verify(gm, after="schedule")  # shapes, pairing, provenance, split sums


def test_pipeline_order_and_provenance(fake_world):
    fake_world(4)
    gm = _compile(4, a2a_chunks=3)
    pos = {nd.name: i for i, nd in enumerate(gm.graph.nodes)}
    for j in range(2):
        # the transfer of chunk j+1 is issued before chunk j's expert compute, whose wait comes after it
        assert pos[f"dispatch_c{j + 1}"] < pos[f"y_MD_c{j}"]
        assert pos[f"x_RD_c{j}"] < pos[f"y_MD_c{j}"] < pos[f"combine_c{j}"] < pos[f"x_RD_c{j + 1}"]
    assert max(pos[f"combine_c{j}"] for j in range(3)) < min(pos[f"y_ND_combined_c{j}"] for j in range(3))
    # the counts of every chunk go in one exchange, before the first dispatch; its wait right before it
    assert max(pos[f"permute_c{j}"] for j in range(3)) < pos["exchange_counts_n"] < pos["recv_counts_E_nPL"]
    assert pos["recv_counts_E_nPL"] < pos["splits_2P_n"] < pos["dispatch_c0"]
    for nd in gm.graph.nodes:
        if nd.op == "call_function" and nd.target in (comm.ALL_TO_ALL, comm.WAIT, comm.EXCHANGE_COUNTS, comm.HOST_SPLITS,
                                                      MARK):
            assert nd.meta["moepass"]["pass"] == "schedule", nd.name


def test_golden_snapshot(fake_world):
    fake_world(2)

    def render():
        gm = _compile(2, a2a_chunks=2)
        moepass.verify(gm)  # fills node.meta["val"]: the snapshot shows shapes whatever MOEPASS_VERIFY says
        text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        return text.replace(repr(gm.layout.groups.ep_group.group_name), "'<ep_group>'")

    check_golden(GOLDEN / "schedule_ep_n2.txt", render)


def test_single_form_unchanged():
    gm = moepass.compile(_block(), moepass.Plan(form="single"))
    record = next(h for h in gm.history if h["pass"] == "schedule")
    assert not record["changed"] and MARK not in _targets(gm)


def test_auto_without_batch_is_one_chunk(fake_world):
    fake_world(2)
    gm = _compile(2)
    record = next(h for h in gm.history if h["pass"] == "schedule")
    assert record["stats"]["chunks"] == 1 and "no Plan.batch" in record["stats"]["chunks_from"]


# Three configurations whose compute/transfer ratio grows: the chosen n must not fall, and must move.
RATIO_CONFIGS = [  # (name, hardware figures): compute/transfer ratio 0.00064, 2.1, 6.4 at alpha = 100 us
    ("network-bound", dict(flops=1e13, intra_bw=1e8, inter_bw=1e8, alpha=1e-4)),
    ("balanced", dict(flops=3e10, intra_bw=1e9, inter_bw=1e9, alpha=1e-4)),
    ("compute-bound", dict(flops=1e10, intra_bw=1e9, inter_bw=1e9, alpha=1e-4)),
]


@functools.lru_cache(maxsize=1)
def _spec():
    return moepass.detect(_block()).blocks[0]


def chunks_for(figures, tokens=4096, ep=4):
    from cost_model.presets import this_machine

    spec = _spec()
    hw = this_machine().with_figures("test", **figures)
    times = schedule.layer_times(spec, tokens, ep, ep, hardware=hw)
    return times.compute / times.transfer, times.chunks()


def test_chunks_follow_compute_transfer_ratio():
    picks = [chunks_for(fig) for _, fig in RATIO_CONFIGS]
    ratios, ns = [r for r, _ in picks], [n for _, n in picks]
    assert ratios == sorted(ratios)
    assert ns == [1, 4, 8], picks  # transfer-bound: chunking does not pay; the more compute, the more chunks


def test_packing_resolves_before_rewrite(fake_world):
    fake_world(4)
    gm = _compile(4, packing=2)
    assert gm.layout.groups.ep_size == 2 and gm.layout.local_experts == E // 2
    with pytest.raises(moepass.PlanError, match="Plan.batch"):
        _compile(4, packing="auto")


def test_packing_auto_doubles_until_compute_bound(fake_world):
    from cost_model.presets import this_machine

    fake_world(4)
    spec = _spec()
    plan = moepass.Plan(form="ep", packing="auto", batch=(8, 512), a2a_chunks=1)
    slow_net = this_machine().with_figures("test", flops=1e12, intra_bw=1e7, inter_bw=1e7, alpha=1e-6)
    fast_net = this_machine().with_figures("test", flops=1e9, intra_bw=1e11, inter_bw=1e11, alpha=1e-6)
    orig = schedule.layer_times
    try:
        schedule.layer_times = lambda *a, **k: orig(*a, **{**k, "hardware": slow_net})
        assert schedule.choose_packing(spec, plan, 4, 4) == 4  # transfer never hidden: pack to one rank
        schedule.layer_times = lambda *a, **k: orig(*a, **{**k, "hardware": fast_net})
        assert schedule.choose_packing(spec, plan, 4, 4) == 1
    finally:
        schedule.layer_times = orig


def test_micro_op_bytes_sets_a_chunk_floor(fake_world):
    """a2a_chunks="auto": the cost model's n, raised so each chunk's dispatch is <= Plan.micro_op_bytes."""
    from cost_model.presets import resolve_hardware

    fake_world(4)
    spec, batch = _spec(), (2, 48)
    b = resolve_hardware(None).values()["b"]
    dispatch_bytes = 96 * K * D * b  # tokens per rank * K rows of D elements
    model_n = schedule.layer_times(spec, 96, 4, 4).chunks()
    micro = int(dispatch_bytes // (model_n + 3)) + 1  # needs model_n + 3 chunks
    n, why = schedule.choose_chunks(spec, moepass.Plan(form="ep", batch=batch, micro_op_bytes=micro), 4, 4)
    assert n == model_n + 3 and f"micro_op_bytes={micro}" in why, why
    assert schedule.micro_op_chunks(spec, 96, micro, b) == model_n + 3
    assert dispatch_bytes / n <= micro < dispatch_bytes / (n - 1)
    n, why = schedule.choose_chunks(spec, moepass.Plan(form="ep", batch=batch), 4, 4)  # 30 MiB: no floor
    assert n == model_n and "micro_op_bytes" not in why
    assert schedule.micro_op_chunks(spec, 96, 1, b) == 96  # never more chunks than tokens
    gm = _compile(4, batch=batch, micro_op_bytes=micro)
    dispatches = [nd for nd in gm.graph.nodes if nd.target is comm.ALL_TO_ALL and nd.args[4] == "dispatch"]
    assert len(dispatches) == model_n + 3


@pytest.mark.parametrize("n", [1, 2])
def test_shared_expert_computes_while_the_combine_is_in_flight(fake_world, n):
    """Work independent of the exchange (the shared expert and its gate) moves between the last combine
    issue and the first combine wait; what depends on the exchange stays after it."""
    from samples.models import FusedMoE

    fake_world(2)
    torch.manual_seed(0)
    gm = moepass.compile(FusedMoE(D, F, E, K, shared_ffn_dim=F),
                         moepass.Plan(form="ep", a2a_chunks=n, topology=moepass.Topology(1, 2)))
    pos = {nd.name: i for i, nd in enumerate(gm.graph.nodes)}
    last_issue = max(pos[f"combine_c{j}"] for j in range(n)) if n > 1 else pos["combine"]
    first_wait = min(pos[f"y_ND_combined_c{j}"] for j in range(n)) if n > 1 else pos["y_ND_combined"]
    moved = ["shared_TD", "shared_gate_T1", "shared_gate_sigmoid", "shared_gated_TD"]
    assert all(last_issue < pos[name] < first_wait for name in moved), pos
    assert first_wait < pos["out_TD"] < pos["out_plus_shared_TD"]  # the routed sum needs the combine
    record = next(h for h in gm.history if h["pass"] == "schedule")
    assert record["stats"]["overlapped_nodes"] == len(moved)
    moepass.verify(gm, after="schedule")


def test_lina_ablation_by_hand():
    """cost_model.schedule.lina_ablation on numbers worked by hand (ms): transfer 10 per direction,
    expert backward 40, alpha 0.1, 50 of dense all-reduce on the same link, DDP bucket 25, micro-op 1,
    packed transfer 5."""
    from cost_model.schedule import a2a_with_allreduce, lina_ablation

    rows = lina_ablation(10.0, 40.0, 0.1, allreduce=50.0, bucket=25.0, micro_op=1.0, packed_transfer=5.0)
    want = {
        "plain": (0.2 + 2 * (10 + 10) + 40, 1),  # fair share: each direction slowed by min(10, 50/2)
        "priority": (0.2 + 2 * (10 + 25) + 40, 1),  # behind a whole bucket: worse than fair share here
        "+ partitioning": (0.2 + 2 * (10 + 1) + 40, 1),
        "+ pipelining": (2 * 2.6 + 10 + 3 * 10 + 8, 4),  # n=4: t_a 2.6, t_c 10; 8 micro-op waits
        "+ packing": (2 * 2.6 + 20 + 1 * 20 + 4, 2),  # n=2 on 5 ms: t_a 2.6, t_c 20; 4 waits
    }
    assert rows.keys() == want.keys()
    for row, (seconds, n) in want.items():
        assert rows[row][1] == n and rows[row][0] == pytest.approx(seconds), (row, rows[row])
    assert a2a_with_allreduce(10.0, 3.0, "fair") == 13.0 and a2a_with_allreduce(10.0, 3.0, "priority", 5.0) == 13.0
    with pytest.raises(ValueError, match="use 'fair' or 'priority'"):
        a2a_with_allreduce(1.0, 1.0, "fifo")
