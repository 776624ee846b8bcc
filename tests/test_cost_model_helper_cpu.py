"""The helper threads' term (`cost_model.helper_cpu`): exact on a hand-made profile (the larger of the helper CPU
and the busy-core wait, plus FSEP's planner), zero where every thread has a core (the GPU presets), added to EP, FSEP
and HP steps on an oversubscribed node; its calibration's fits, the planner timing and the microbenchmark itself
(`cost_model.calibrate_threads`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sympy

from cost_model import calibrate_threads
from cost_model import ep as cm
from cost_model import fsep as fsep_cm
from cost_model import hp as hp_cm
from cost_model import symbols as S
from cost_model.helper_cpu import exposed_thread_cpu, oversubscribed, thread_cpu
from cost_model.presets import A100, H100, PRESETS, Figure, this_machine

C_XB, C_XC = 5e-10, 2e-4  # s per byte sent, s per exchange
THREADS = {"c_xb": C_XB, "c_xc": C_XC, "n_help": 2.0}  # two helper threads (gloo: worker + TCP loop)
SHAPE = {"T": 1000, "K": 2, "D": 64, "F": 128, "m": 3, "E": 8, "G": 2, "rho": 1.0, "c_f": 1.0}


@pytest.mark.parametrize("ranks,helpers,cores,over", [
    (2, 2, 6, False),  # 2 x (1 + 2) = 6 threads on 6 cores: each its own
    (2, 2, 5, True),
    (2, 0, 2, False),  # no helper threads: the main threads alone fit
    (8, 1, 128, False),  # a GPU node's host: 16 threads, 128 cores
    (2, 3, math.inf, False),  # cores unknown / unbounded: the GPU presets
    (2, 3, 0, False),
])
def test_oversubscribed_is_threads_over_cores(ranks, helpers, cores, over):
    assert oversubscribed(ranks, helpers, cores) is over


def test_the_term_vanishes_with_enough_cores_and_is_exact_when_oversubscribed():
    x = {**THREADS, "G": 2}
    assert exposed_thread_cpu({**x, "n_core": 6}, 1e6, 5) == 0
    assert exposed_thread_cpu({**x, "n_core": 5}, 1e6, 5) == pytest.approx(5e-10 * 1e6 + 2e-4 * 5, rel=1e-12)
    assert thread_cpu(1e6, 5, C_XB, C_XC) == pytest.approx(1.5e-3, rel=1e-12)
    # n_rank (ranks sharing the node's cores) overrides G: two one-rank "nodes" on one machine still share it
    assert exposed_thread_cpu({**x, "G": 1, "n_core": 5}, 1e6, 5) == 0  # 1 x 3 <= 5
    assert exposed_thread_cpu({**x, "G": 1, "n_rank": 2, "n_core": 5}, 1e6, 5) == pytest.approx(1.5e-3, rel=1e-12)
    assert exposed_thread_cpu({"G": 2, "n_help": 2, "n_core": 1}, 1e6, 5) == 0  # no figures: nothing priced



def test_the_step_pays_the_larger_of_the_helper_cpu_and_the_busy_core_wait():
    """max(c_xb * bytes + c_xc * calls, c_wb * bytes + c_wc * calls) + the planner's CPU, each exact."""
    x = {**THREADS, "G": 2, "n_core": 2}
    cpu = 5e-10 * 1e6 + 2e-4 * 5  # 1.5 ms
    wait_small = {"c_wb": 1e-10, "c_wc": 1e-4}  # 0.6 ms: the CPU is the larger
    wait_large = {"c_wb": 2e-10, "c_wc": 6e-4}  # 3.2 ms: the wait is the larger
    assert exposed_thread_cpu({**x, **wait_small}, 1e6, 5) == pytest.approx(cpu, rel=1e-12)
    assert exposed_thread_cpu({**x, **wait_large}, 1e6, 5) == pytest.approx(2e-10 * 1e6 + 6e-4 * 5, rel=1e-12)
    assert exposed_thread_cpu({**x, **wait_large}, 1e6, 5, other=1e-3) == pytest.approx(4.2e-3, rel=1e-12)
    assert exposed_thread_cpu({"G": 2, "n_help": 2, "n_core": 2, **wait_large}, 1e6, 5) == pytest.approx(3.2e-3)
    assert exposed_thread_cpu({**x, **wait_large, "n_core": 6}, 1e6, 5, other=1e-3) == 0


def test_gpu_presets_price_no_helper_cpu():
    """NCCL's proxy threads on a GPU node's free host cores: c_xb = c_xc = 0 and the cores unbounded, so the term
    is 0 even with the figures of a CPU machine put beside them."""
    for hw in PRESETS.values():
        v = hw.values()
        assert v["c_xb"] == v["c_xc"] == v["c_wb"] == v["c_wc"] == v["c_plan"] == v["c_plan_e"] == 0, hw.name
        assert math.isinf(v["n_core"]), hw.name
        x = {**v, **SHAPE, "G": 8}
        assert cm.ep_layer(x, ep=8, n=2, dp=1, dropless=True, cross_node_dp=False).threads == 0
        assert exposed_thread_cpu({**x, **THREADS}, 1e9, 10) == 0  # cores unbounded


def test_ep_adds_the_helper_cpu_of_its_exchanges_to_the_step():
    x = {**A100.values(), **SHAPE, **THREADS}
    for dropless, n in ((True, 1), (False, 1), (True, 4)):
        free = cm.ep_layer({**x, "n_core": 6}, ep=2, n=n, dp=1, dropless=dropless, cross_node_dp=False)
        busy = cm.ep_layer({**x, "n_core": 2}, ep=2, n=n, dp=1, dropless=dropless, cross_node_dp=False)
        sent = 1000 * 2 * 64 * 2 / 2  # T*K*D*b/ep to the other rank, per direction
        assert free.threads == 0 and float(free.a2a_bytes) == sent
        calls = 4 * n + 1  # dispatch + combine fwd + bwd in n chunks, and the split sizes (a capacity's too)
        assert float(busy.threads) == pytest.approx(C_XB * 4 * sent + C_XC * calls, rel=1e-12)
        assert float(busy.step - free.step) == pytest.approx(float(busy.threads), rel=1e-12)
        for key in ("compute", "a2a_exposed", "other_comm", "host"):
            assert getattr(busy, key) == getattr(free, key), key
    # no all-to-all and no gradient to all-reduce: nothing on the helper threads
    assert cm.ep_layer({**x, "n_core": 2}, ep=1, n=1, dp=1, dropless=True, cross_node_dp=False).threads == 0


def test_every_piece_of_a_gradient_all_reduce_is_a_collective_call_on_the_helper_threads():
    """The gradient all-reduces run on the same threads as the exchanges: each piece (one call, or one per u bytes)
    costs c_xc, each byte a rank sends in the ring (2 (W-1)/W of the gradient) c_xb; the expert replicas' over dp,
    the dense parameters' (P_d) over all W ranks."""
    x = {**A100.values(), **SHAPE, **THREADS, "n_core": 2}
    grads = 8 * 3 * 64 * 128 * x["b_g"]  # the layer's expert gradients, every rank all of them at ep = 1
    whole = cm.ep_layer(x, ep=1, n=1, dp=2, dropless=True, cross_node_dp=False)
    assert float(whole.threads) == pytest.approx(C_XB * grads + C_XC * 1, rel=1e-12)  # W = 2: the ring sends it all
    pieced = cm.ep_layer({**x, "u": grads / 4}, ep=1, n=1, dp=2, dropless=True, cross_node_dp=False)
    assert float(pieced.threads) == pytest.approx(C_XB * grads + C_XC * 4, rel=1e-12)
    assert cm.allreduce_calls(grads, 4, 65536) == math.ceil(grads / 65536) and cm.allreduce_calls(grads, 1) == 0
    assert cm.allreduce_sent(1000.0, 4) == pytest.approx(1500.0)
    dense = {"P_d": 100_000, "u": 65536}  # over W = 2 at ep = 2: ceil(P_d b_g / u) pieces
    without = cm.ep_layer(x, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    with_dense = cm.ep_layer({**x, **dense}, ep=2, n=1, dp=1, dropless=True, cross_node_dp=False)
    dense_bytes = 100_000 * x["b_g"]
    assert float(with_dense.threads - without.threads) == pytest.approx(
        C_XB * dense_bytes + C_XC * math.ceil(dense_bytes / 65536), rel=1e-12)


def test_fsep_adds_its_token_exchanges_and_its_three_restores():
    x = {**A100.values(), **SHAPE, **THREADS, "n_core": 2}
    W, C = 2, 4
    terms = fsep_cm.fsep_layer(x, W=W, C=C, n=1, rho=1.0, a2a_rows=(0.5, 0.0))
    sent = 1000 * 2 * 0.5 * 64 * 2
    S_e = 3 * 64 * 128
    restore = C * S_e / W * 2  # one restore: the 1/W slice of C experts to the other rank, b bytes (= b_g here)
    # 4 token exchanges, the split sizes and the planner's count gather, 3 restores
    want = C_XB * (4 * sent + 3 * restore) + C_XC * (4 + 2 + 3)
    assert float(terms.threads) == pytest.approx(want, rel=1e-12)
    kept = fsep_cm.fsep_layer(x, W=W, C=C, n=1, rho=1.0, a2a_rows=(0.5, 0.0), keep_restored=True)
    assert float(terms.threads - kept.threads) == pytest.approx(C_XB * restore + C_XC, rel=1e-12)
    planned = fsep_cm.fsep_layer({**x, "c_plan": 3e-4, "c_plan_e": 1e-7}, W=W, C=C, n=1, rho=1.0,
                                 a2a_rows=(0.5, 0.0))  # the planner's solve on the [W, E] = [2, 8] counts
    assert float(planned.threads - terms.threads) == pytest.approx(3e-4 + 1e-7 * 2 * 8, rel=1e-12)
    assert fsep_cm.fsep_layer({**x, "n_core": 6, "c_plan": 3e-4}, W=W, C=C, n=1, rho=1.0,
                              a2a_rows=(0.5, 0.0)).threads == 0  # every thread its own core: the planner too


def test_hp_adds_its_four_exchanges():
    x = {**A100.values(), **SHAPE, **THREADS, "n_core": 2, "H": 4, "h": 32}
    terms = hp_cm.hp_layer(x, ep=2, dp=1, cross_node=False)
    assert float(terms.threads) == pytest.approx(C_XB * 4 * float(terms.a2a_bytes) + C_XC * 4, rel=1e-12)
    assert hp_cm.hp_layer({**x, "n_core": 6}, ep=2, dp=1, cross_node=False).threads == 0


def test_a_symbolic_layer_has_no_helper_term():
    x = {name: info.symbol for name, info in S.TABLE.items()}
    terms = cm.ep_layer(x, ep=8, n=1, dp=1, dropless=True, cross_node_dp=False)
    assert terms.threads == 0 and isinstance(sympy.sympify(terms.step), sympy.Expr)
    fsep = fsep_cm.fsep_layer(x, W=8, C=2, n=1, rho=S.rho, a2a_rows=(S.rho / 2, 0))  # the planner's 0 * W * E
    assert fsep.threads == 0
    # figures as numbers but the ranks per node a symbol: oversubscription is decided on numbers only
    assert exposed_thread_cpu({**THREADS, "G": S.G, "n_core": 2}, 1e6, 5) == 0


def test_this_machine_reads_the_helper_figures(tmp_path: Path):
    base = {"alpha": 1e-4, "bandwidth": 2e9, "flops": 5e10, "created": "now"}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**base, "xfer_byte_cost": 4e-10, "xfer_call_cost": 1e-4, "helper_threads": 3,
                                "cores": 2, "planner_cost": 3e-4, "planner_entry_cost": 1e-7,
                                "xfer_wait_byte_cost": 1e-10, "xfer_wait_call_cost": 6e-4}))
    v = this_machine(path).values()
    assert (v["c_xb"], v["c_xc"], v["n_help"], v["n_core"]) == (4e-10, 1e-4, 3.0, 2.0)
    assert (v["c_wb"], v["c_wc"]) == (1e-10, 6e-4)
    assert (v["c_plan"], v["c_plan_e"]) == (3e-4, 1e-7)
    assert "sched_getaffinity" in this_machine(path).cores.source
    path.write_text(json.dumps(base))  # an older profile: no helper CPU priced
    v = this_machine(path).values()
    assert v["c_xb"] == v["c_xc"] == 0 and math.isinf(v["n_core"])
    hw = H100.with_figures("test", xfer_byte_cost=1e-9)
    assert isinstance(hw.xfer_byte_cost, Figure) and hw.values()["c_xb"] == 1e-9


def test_the_calibration_fits_a_line_over_the_bytes_sent():
    """Samples [(input bytes, helper CPU s per exchange, wall gain s, helper threads)]: W=2 sends half of the input;
    the slopes are s per byte sent, the intercepts s per exchange (the wait's after the link time alpha + bytes /
    bandwidth is taken off the wall gain); the threads counted at the largest size."""
    link = [1e-4 + size / 2 / 2e9 for size in calibrate_threads.SIZES]
    samples = [(size, 3e-5 + 4e-10 * size / 2, t + 6e-4 + 1e-10 * size / 2, 2.0 + (size > 1 << 20))
               for size, t in zip(calibrate_threads.SIZES, link)]
    got = calibrate_threads.figures(samples, 2, alpha=1e-4, bandwidth=2e9)
    assert got["xfer_byte_cost"] == pytest.approx(4e-10, rel=1e-9)
    assert got["xfer_call_cost"] == pytest.approx(3e-5, rel=1e-6)
    assert got["xfer_wait_byte_cost"] == pytest.approx(1e-10, rel=1e-6)
    assert got["xfer_wait_call_cost"] == pytest.approx(6e-4, rel=1e-9)
    assert got["helper_threads"] == 3.0 and got["cores"] == calibrate_threads.available_cores() >= 1
    first = got["threads_samples"][0]
    assert first["sent_bytes"] == calibrate_threads.SIZES[0] / 2
    assert first["link_s"] == pytest.approx(1e-4 + first["sent_bytes"] / 2e9, rel=1e-12)
    flat = calibrate_threads.figures([(s, 1e-4, 0.0, 1.0) for s, *_ in samples], 2, 1e-4, 2e9)
    assert flat["xfer_byte_cost"] == pytest.approx(0.0, abs=1e-18) and flat["xfer_call_cost"] == pytest.approx(1e-4)
    assert flat["xfer_wait_byte_cost"] == flat["xfer_wait_call_cost"] == 0  # no wall gain: below the link time
    with pytest.raises(ValueError, match="need >= 2 message sizes"):
        calibrate_threads.figures(samples[:1], 2, 1e-4, 2e9)


def test_the_planner_calibration_times_each_size_and_fits_a_line():
    """`planner_times` runs the solver it is given once per warm-up and repetition on [W, E] counts; the figures
    are the line over the W*E entries; `cost_model.calibrate.planner_solve` is the runtime's planner."""
    from cost_model import calibrate

    seen = []

    def solver(W, E, C):
        return lambda counts: seen.append((tuple(counts.shape), C))

    sizes = ((2, 8, 4), (4, 64, 16))
    samples = calibrate_threads.planner_times(solver, sizes, reps=3)
    assert [n for n, _ in samples] == [16, 256] and all(t >= 0 for _, t in samples)
    assert seen == [((2, 8), 4)] * 5 + [((4, 64), 16)] * 5
    got = calibrate_threads.planner_figures([(16, 3e-4 + 16e-7), (256, 3e-4 + 256e-7), (1024, 3e-4 + 1024e-7)])
    assert got["planner_cost"] == pytest.approx(3e-4, rel=1e-9)
    assert got["planner_entry_cost"] == pytest.approx(1e-7, rel=1e-9)
    solve = calibrate.planner_solve(2, 8, 4)
    import torch

    solve(torch.full((2, 8), 100, dtype=torch.int64))  # the runtime planner runs on such counts


def test_thread_cpu_counts_this_process_threads():
    import threading

    cpu = calibrate_threads.thread_cpu_ns()
    assert threading.get_native_id() in cpu and all(v >= 0 for v in cpu.values())


@pytest.mark.distributed
def test_the_microbenchmark_runs_on_two_ranks():
    from cost_model.calibrate import spawn_ranks

    sizes = (1 << 16, 1 << 18)
    out = spawn_ranks(calibrate_threads.worker, (2, sizes, 2), len(sizes), "helper-thread timing", 120.0)
    assert [size for size, *_ in out] == list(sizes)
    assert all(math.isfinite(cpu) and math.isfinite(wall) and threads >= 0 for _, cpu, wall, threads in out)


def test_the_fidelity_benchmark_prices_its_two_ranks_on_one_node():
    """benchmarks/cost_fidelity.py: W=2 ranks on this machine's cores (n_rank = W, the locality form's two one-rank
    "nodes" included); threads_s is the EP exchanges' helper CPU exactly, and the phases still add up."""
    from _fidelity import bench as load_bench

    bench = load_bench()
    hw = this_machine(bench.PROFILE).with_figures("test", xfer_byte_cost=C_XB, xfer_call_cost=C_XC,
                                                   xfer_wait_byte_cost=0.0, xfer_wait_call_cost=0.0,
                                                   helper_threads=2, cores=2, planner_cost=0.0)
    for c in (bench.CONFIGS[0], bench.LOCALITY_CONFIGS[0]):
        p = bench.predict(c, hw, 1.0)
        calls = 5  # both exchange the split sizes first (the locality form's kept rows per rank vary too)
        assert p["threads_s"] == pytest.approx(C_XB * 4 * p["dispatch_bytes"] + C_XC * calls, rel=1e-12), c
        assert p["fwd_s"] + p["bwd_s"] == pytest.approx(p["step_s"], rel=1e-12)
        alone = bench.predict(c, hw.with_figures("test", cores=math.inf), 1.0)
        assert alone["threads_s"] == 0 and p["step_s"] - alone["step_s"] == pytest.approx(p["threads_s"], rel=1e-9)
