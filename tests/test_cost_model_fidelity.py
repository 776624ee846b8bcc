"""benchmarks/cost_fidelity.py's predictions without a measurement: every form it measures (EP, FSEP, HP,
locality, Lina's schedule) is priced, the forward/backward split adds up to the step, and the in-run CPU share scales exactly the
CPU-bound terms (compute and host) and nothing else."""

from __future__ import annotations

import pytest
from _fidelity import bench as _bench

from cost_model.presets import this_machine


def test_every_form_is_priced_and_the_phases_add_up():
    bench = _bench()
    hw = this_machine(bench.PROFILE)
    configs = sum(bench.FORM_CONFIGS.values(), ())
    assert {c.form for c in configs} == set(bench.ALL_FORMS.split(","))
    for c in configs:
        p = bench.predict(c, hw)
        assert p["step_s"] > 0 and 0 < p["fwd_s"] < p["step_s"], c
        assert p["fwd_s"] + p["bwd_s"] == pytest.approx(p["step_s"], rel=1e-12)
        parts = p["compute_s"] + p["a2a_s"] + p["host_s"] + p["other_s"] + p["threads_s"]
        assert p["step_s"] == pytest.approx(parts, rel=1e-9), c


def test_the_in_run_share_scales_compute_and_host_only():
    bench = _bench()
    hw = this_machine(bench.PROFILE)
    for c in (bench.CONFIGS[0], bench.HP_CONFIGS[0], bench.LOCALITY_CONFIGS[0]):
        full, half = bench.predict(c, hw), bench.predict(c, bench.at_share(hw, 0.5))
        assert half["a2a_s"] == pytest.approx(full["a2a_s"], rel=1e-12)
        assert half["compute_s"] == pytest.approx(2 * full["compute_s"], rel=1e-9)
        assert half["host_s"] == pytest.approx(2 * full["host_s"], rel=1e-9)
    profile = {"samples": {"matmul": [{"n": bench.PROBE_N, "seconds": 2e-3}]}}
    assert bench.cpu_share(profile, [1e-3, 1e-3, 4e-3]) == pytest.approx(2.0)
    assert bench.cpu_share({}, [1e-3]) is None


def test_page_faults_and_the_restore_relayout_are_priced_from_their_figures():
    """The step's page faults (an input read from the run, n_f) cost `page_cost` each in every form's host term;
    FSEP's restore re-layout costs `restore_cost` per restored element C*S_e (S_e = 3*D*F, SwiGLU); neither
    moves the exchanges or the compute, and a GPU preset prices neither (its caching allocator keeps its pages)."""
    bench = _bench()
    hw = this_machine(bench.PROFILE).with_figures("test", page_cost=2e-6, restore_cost=3e-9)
    for c in (bench.CONFIGS[0], bench.FSEP_CONFIGS[0], bench.HP_CONFIGS[0], bench.LOCALITY_CONFIGS[0]):
        base, faulted = bench.predict(c, hw, faults=0), bench.predict(c, hw, faults=1000)
        assert faulted["host_s"] - base["host_s"] == pytest.approx(1000 * 2e-6, rel=1e-9), c
        assert faulted["page_s"] == pytest.approx(2e-3, rel=1e-12) and base["page_s"] == 0
        for key in ("compute_s", "a2a_s", "other_s"):
            assert faulted[key] == base[key], (c, key)
    c = bench.FSEP_CONFIGS[0]
    without = bench.predict(c, hw.with_figures("test", restore_cost=0.0))
    restored = c.slots * 3 * c.D * c.F
    assert bench.predict(c, hw)["host_s"] - without["host_s"] == pytest.approx(3e-9 * restored, rel=1e-9)
    from cost_model.presets import H100

    assert H100.values()["c_page"] == H100.values()["c_restore"] == 0


def test_the_restore_and_first_touch_benchmarks_run_the_runtime_ops():
    """`cost_model.calibrate`'s FSEP restore benchmark runs the runtime's own ops (gather_slices, assemble and their
    backward) and leaves every shard a gradient of its shape; a fresh buffer above glibc's largest mmap threshold
    faults in about one page per 4 KiB on first touch (what `page_cost` divides by)."""
    import resource

    from cost_model import calibrate

    step, shards = calibrate.restore_step(2, 8, 16)
    step()
    assert all(s.grad is not None and s.grad.shape == s.shape for s in shards)
    seconds, faults = calibrate.fresh_fill(calibrate.FRESH_BYTES)
    assert seconds > 0 and faults >= calibrate.FRESH_BYTES // resource.getpagesize() // 2


def test_lina_configs_price_the_models_dense_gradients_under_both_policies():
    """A Lina config's model (`cost_fidelity_lina.DenseMoEStack`) has P_d replicated parameters per layer, as the
    search counts a model's dense parameters; its price is `ep_step` over the layers plus the dense GEMMs (forward
    and backward), and the priority rule changes only how long the all-to-alls wait for the all-reduce."""
    from cost_model.ep import dense_flops
    from cost_model.search import BlockShape, dense_params_of, specs_of

    bench = _bench()
    lina = bench.lina
    hw = this_machine(bench.PROFILE)
    priority, fair = bench.LINA_CONFIGS[:2]
    assert (priority.priority, fair.priority) == (True, False) and priority.micro_op_bytes == fair.micro_op_bytes
    model = lina.DenseMoEStack(priority.D, priority.F, priority.E, priority.K, priority.layers)
    specs = specs_of(model)  # what the search reads of a model: `moepass.detect`'s blocks
    assert len(specs) == priority.layers
    shapes = [BlockShape.of(s, priority.tokens) for s in specs]
    assert dense_params_of(model, shapes) == priority.layers * lina.dense_params(priority.D, priority.E)
    p, f = bench.predict(priority, hw), bench.predict(fair, hw)
    # priority: an all-to-all waits behind at most one micro-op; fair: it shares the link with the whole all-reduce.
    # Pieces short against a slow link: priority waits less; a long piece (gloo's all-reduce latency): more
    slow_link = hw.with_figures("test", allreduce_alpha=1e-5, intra_bw=1e8, inter_bw=1e8)
    assert bench.predict(priority, slow_link)["a2a_s"] < bench.predict(fair, slow_link)["a2a_s"]
    long_pieces = hw.with_figures("test", allreduce_alpha=5e-3)
    assert bench.predict(priority, long_pieces)["a2a_s"] > bench.predict(fair, long_pieces)["a2a_s"]
    dense = 3 * priority.layers * float(dense_flops(priority.tokens, priority.D)) / hw.gemm_rate(priority.D,
                                                                                                  priority.tokens)
    assert p["dense_s"] == pytest.approx(dense, rel=1e-12) and dense > 0
    assert p["other_s"] > 0  # the last layer's dense all-reduce: nothing hides it
    assert p["a2a_s"] != f["a2a_s"]
    for key in ("compute_s", "host_s", "threads_s", "other_s", "fwd_s"):
        assert p[key] == pytest.approx(f[key], rel=1e-12), key
