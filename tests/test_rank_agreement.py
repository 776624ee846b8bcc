"""Ranks that would rewrite different blocks (issue 29, item 1's "nothing silent", across ranks): detection reads a
block's weights, so a model whose parameters differ from rank to rank (left as `torch.empty` memory, or built
with another seed) can be accepted on one rank and rejected on another; the ranks then rewrite different blocks
and the first all-to-all hangs. `compile` compares the ranks' verdicts first and raises on every rank, naming
the block, which ranks accepted it and the rejecting rank's reason; a block with NaN weights says so. Plans that
differ from rank to rank (a field read from a rank's own config) are named field by field the same way."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import moepass
from moepass import Plan, PlanError
from moepass.agreement import disagreement, verdicts
from samples.models import tiny_mixtral

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import pool  # noqa: E402

SMALL = dict(dim=32, ffn_dim=32, vocab_size=32, num_experts=4, heads=2, layers=1)


def model_with_nan_router(nan: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_mixtral(**SMALL)
    if nan:  # what an uninitialised torch.empty parameter can hold
        with torch.no_grad():
            model.layers[0].mlp.gate.weight[0, 0] = float("nan")
    return model


def test_a_block_with_nan_weights_is_rejected_saying_so():
    model = model_with_nan_router(nan=True)
    report = moepass.detect(model)
    [rejected] = report.details
    assert rejected.path == "layers.0.mlp" and not rejected.accepted
    assert rejected.reason.startswith("its 'gate.weight' holds NaN or inf values (uninitialised memory, e.g. "
                                      "torch.empty parameters never initialised?): initialise or load the weights "
                                      "before detect/compile. The checks: ")
    clean = moepass.detect(model_with_nan_router(nan=False))
    assert all(d.accepted for d in clean.details)


def case_compile_with_rank_dependent_weights(rank: int, world: int) -> str:
    model = model_with_nan_router(nan=rank == 1)
    try:
        moepass.compile(model, Plan(form="ep"))
    except PlanError as err:
        return str(err)
    return "compiled"


@pytest.mark.distributed
def test_ranks_that_disagree_on_a_block_raise_on_every_rank_instead_of_hanging():
    messages = pool(2).run(case_compile_with_rank_dependent_weights, timeout=120)
    assert messages[0] == messages[1]  # the same error on every rank
    assert messages[0].startswith("moepass.compile: the ranks do not agree on how to rewrite the MoE blocks: "
                                  "'layers.0.mlp': accepted on rank(s) [0], rejected on [1] (rank 1: its "
                                  "'gate.weight' holds NaN or inf values")
    assert messages[0].endswith("or leave the blocks alone with Plan(blocks={'layers.0.mlp': None}).")


def case_compile_with_equal_weights(rank: int, world: int) -> list[str]:
    return sorted(moepass.compile(model_with_nan_router(nan=False), Plan(form="ep")).moepass_info.rewritten)


@pytest.mark.distributed
def test_ranks_that_agree_compile_as_before():
    assert pool(2).run(case_compile_with_equal_weights, timeout=120) == [["layers.0.mlp"]] * 2


def test_plans_that_differ_by_rank_are_named_field_by_field():
    report = moepass.detect(model_with_nan_router(nan=False))
    same = verdicts(Plan(form="ep", ep_size=2), report)
    assert disagreement([same, verdicts(Plan(form="ep", ep_size=2), report)]) is None
    message = disagreement([same, verdicts(Plan(form="ep", ep_size=2, a2a_chunks=2, capacity_factor=1.5), report),
                            verdicts(Plan(form="fsep", ep_size=2), report)])
    assert message is not None
    assert ("'layers.0.mlp': the ranks' plans differ: form rank 0: 'ep', rank 1: 'ep', rank 2: 'fsep'; "
            "capacity_factor rank 0: None, rank 1: 1.5, rank 2: None; a2a_chunks rank 0: 'auto', rank 1: 2, "
            "rank 2: 'auto'; ") in message
    assert "Pass the same Plan on every rank" in message
    left_alone = verdicts(Plan(form="ep", blocks={"layers.0.mlp": None}), report)
    assert "form rank 0: 'ep', rank 1: None" in disagreement([same, left_alone])
