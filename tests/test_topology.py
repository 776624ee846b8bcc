"""Topology: node grouping, link classification, validation, and the EP mesh / groups it builds."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

from moepass import PlanError, Topology  # noqa: E402


def test_links_by_simulated_node():
    t = Topology(2, 2)
    assert t.world_size == 4 and [t.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.link(0, p) for p in range(4)] == ["self", "intra", "inter", "inter"]
    assert [t.link(3, p) for p in range(4)] == ["inter", "inter", "intra", "self"]


def test_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Topology.from_env() == Topology(2, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(PlanError, match="LOCAL_WORLD_SIZE=3"):
        Topology.from_env()


@pytest.mark.parametrize("kw,field", [({"nodes": 0, "ranks_per_node": 2}, "nodes"),
                                      ({"nodes": 2, "ranks_per_node": 1.5}, "ranks_per_node"),
                                      ({"nodes": 1, "ranks_per_node": 2, "timeout": 0}, "timeout")])
def test_invalid_topology_names_the_field(kw, field):
    with pytest.raises(PlanError, match=f"Topology.{field}="):
        Topology(**kw)


def case_groups(rank, world, ep_size, nodes):
    import torch.distributed as dist

    from moepass.runtime.topology import ep_groups

    g = ep_groups(Topology(nodes, world // nodes, timeout=30.0), ep_size, "cpu")
    again = ep_groups(Topology(nodes, world // nodes, timeout=30.0), ep_size, "cpu")
    mesh_groups = {g.mesh.get_group("ep").group_name, g.mesh.get_group("dp").group_name}
    return {
        "cached": again is g,
        "mesh": tuple(g.mesh.mesh.shape), "names": g.mesh.mesh_dim_names,
        "ep_ranks": g.ep_ranks, "dp_ranks": g.dp_ranks,
        "ep_group_ranks": dist.get_process_group_ranks(g.ep_group),
        "separate": g.ep_group.group_name not in mesh_groups and g.dp_group.group_name not in mesh_groups
        and g.ep_group.group_name != g.dp_group.group_name,
        "ep_rank": g.ep_rank, "dp_rank": g.dp_rank,
    }


def case_bad_ep_size(rank, world):
    import moepass
    from samples.models import tiny_mixtral

    try:
        moepass.compile(tiny_mixtral(num_experts=8, layers=1, dim=16, ffn_dim=16, vocab_size=16),
                        moepass.Plan(form="ep", ep_size=3))
    except PlanError as err:
        return str(err)
    return None


def test_ep_groups_dp_x_ep():
    out = pool(4).run(case_groups, 2, 2)
    assert all(o["cached"] and o["separate"] for o in out)
    assert out[0]["mesh"] == (2, 2) and out[0]["names"] == ("dp", "ep")
    assert [o["ep_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # EP inside a node
    assert [o["dp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # replicas of the same experts
    assert [o["ep_group_ranks"] for o in out] == [o["ep_ranks"] for o in out]
    assert [(o["dp_rank"], o["ep_rank"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_ep_size_must_divide_world():
    msg = pool(2).run(case_bad_ep_size)[0]
    assert msg is not None and "Plan.ep_size=3" in msg and "divide" in msg


def case_auto_world(rank, world):
    """form="auto" prices the ranks that run: the initialised group when no torchrun variables are set."""
    from moepass.api import default_topology

    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE") if k in os.environ}
    try:
        return default_topology()
    finally:
        os.environ.update(saved)


def test_auto_prices_the_initialised_world_under_spawn():
    assert pool(2).run(case_auto_world) == [(1, 2), (1, 2)]
