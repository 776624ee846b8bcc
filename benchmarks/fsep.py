"""FSEP vs EP vs FSDP at W=2: load balance under skewed routing, training-step time, parameter memory (issue 14).

    .venv/bin/python benchmarks/fsep.py                  # full run (~25 min here, plus --wait-load)
    .venv/bin/python benchmarks/fsep.py --quick          # smoke run (< 1 min): a small layer (T=128, D=128,
                                                         # F=256), 2 timed steps; JSON + plot to the temp dir
    .venv/bin/python benchmarks/fsep.py --wait-load 1.0  # first wait for the shared cores to quieten down

Writes benchmarks/results/fsep.json and fsep_load.png (unless --out; the plot goes next to the JSON as
<name>_load.png) and prints tables.

The layer. One Hugging Face `MixtralSparseMoeBlock` (fused gate/up experts, SwiGLU, softmax top-K
router, dropless), fp32, D=256, F=512, E=8, K=2 (issue 12's layer), at W=2 gloo ranks x 1 thread (this
machine's 2 cores), with T = 8192 tokens per rank (the headline) and T = 2048, one launch each
(`--tokens`). Why so many: FSEP's restore brings C*S*b bytes of weights to every device each layer
whatever T is, while a device's forward expert GEMMs do 6*T*K*D*F FLOPs on average, so the FLOPs per
restored byte grow with T: 51 at T=512, 205 at T=2048, 820 at T=8192, ~33000 in the paper's setup (32k
tokens per GPU, K=2, C=2, bf16). This machine does ~55 GFLOP/s per core and a restore all_to_all runs at
0.6-0.85 GB/s on gloo loopback (both measured in the run: `floor`, `collectives`), ~80 FLOPs per byte,
and gloo's transfers run on the same core as the rank's GEMMs (one core per rank), so nothing overlaps
here: every restored byte is paid in full. At T=512 the restore alone costs more than the forward expert
GEMMs; at T=2048 they cost ~2.5x the restore; T=8192 is the smallest regime of the four where the
restore is a small part of the step, still 40x below the paper's. Seeded weights: experts N(0, 1/D) (gate/up) and N(0, 1/F) (down), router
N(0, 1/D). The router is frozen (requires_grad False): the routing skew is the controlled variable and
must not drift while the experts train.

Routing scenarios: the block's own router makes the skew. Every input token has feature 0 equal to 1
(the other features N(0, 1); a pool of 16 seeded batches per rank, cycled step by step), so the
router's weight column 0 is a per-expert logit bias b. b starts at log p and is calibrated
(b += 0.5 (log p - log share), through the block's router module on the whole pool) until the realised
share of each expert in the T*K assignments is within 0.001 of the target p:
  zipf      p_e ~ 1/(E-e)^1.2: expert 7 the hottest, then 6, ... This order is EP's worst split of these
            shares at W=2 (the 4 hottest on rank 1; EP's max/mean over all 35 splits is in the JSON),
            and FSEP's initial table (which replicates experts 0 and 1) is wrong for it, so the
            planner has to move the replicas
  real_l0   a recorded skew: `samples.models.tiny_mixtral` (2 MoE layers, E=8, top-2, vocab 256)
  real_l1   trained for 200 Adam steps (lr 3e-3, 8 x 128 bytes per step, seed 0, 1 thread) on a fixed
            byte stream, the standard library's argparse.py (sha256 in the JSON); each layer's
            per-expert assignment counts over the last 10 steps, replayed with its own expert ids
  balanced  p_e = 1/E
The realised shares are printed and stored twice: on the calibration pool, and in the run (the FSEP
controller's last 5 steps of counts, gathered from both ranks by the FSEP graph itself).

Systems (same weights, same input sequence, Adam lr 1e-4 on the expert weights):
  fsep  moepass.compile(block, Plan(form="fsep", topology=Topology(1, 2), slots_per_device=5,
        planner="auto")): each rank keeps half of every expert and restores C=5 whole experts per step
        (10 slots for 8 experts); the planner re-places them from the last 5 steps' counts, one step late.
  ep    moepass.compile(block, Plan(form="ep", topology=Topology(1, 2))): experts 0-3 on rank 0, 4-7 on 1.
  fsdp  moepass.compile(block, Plan(form="single")) (the same expert kernels), then FSDP2 `fully_shard`
        on it inside a root wrapper (reshard_after_forward=True, as for every layer of a deep model but
        the root): all E experts all-gathered in the forward and again in the backward, their gradients
        reduce-scattered; data parallel (each rank computes its own tokens with every expert).

Load balance. With `controller.track_loads = True` the FSEP controller records, per step, the rows each
device computed under the installed table and the rows plain EP would have computed for the same counts
(`cost_model.fsep.ep_device_rows`); max/mean rows per device per step over the timed steps.

Step time. One step = zero_grad + forward + backward + Adam step; loss = (y * probe).sum(), a fixed
random probe; x requires grad. Every step starts after a barrier; its time is the max over the ranks.
Per scenario: `--warmup` untimed steps of each system in turn (the planner needs its 5-step history and
installs one step late), then `--rounds` rounds of fsep, ep, fsdp, floor (A B C D A B C D ...), `--steps`
timed steps each; a system's round figure is the median of its steps. The JSON holds the median and
range of the round figures, the ratios ep/fsep and fsdp/fsep (of the medians, and the median of the
per-round ratios, which cancels load drift between rounds), per-rank forward / backward / optimizer
medians, and every step's global loss (the three systems run the same math: their losses agree).

Compute floor, timed in the same rounds: a SwiGLU expert step's six GEMMs at the run's sizes, as plain
`torch.mm(out=)` on R rows (forward [R, D]x[D, 2F] and [R, F]x[F, D]; backward dA, dW_down, dX,
dW_gate_up), R = T*K (a perfectly balanced device) and R = the median most-loaded device's rows of EP
and of FSEP. Both ranks run it at once (both cores busy, as in a step); max over the ranks.

Where the time goes, per scenario: the collectives alone at the run's sizes (FSEP's restore
all_to_all, FSDP's all_gather and reduce_scatter of all experts, EP's dispatch of T*K rows; barrier,
max over ranks, bytes and GB/s), and a torch.profiler table (self CPU time per op and step, each rank)
of `--profile-steps` steps per system.

Memory (FSEP, per layer): measured = the local shards of the expert DTensor parameters + the restored
expert tensors of one forward (an `fx.Interpreter` over the block's graph records every node whose name
ends in `_slots`; distinct storages counted once) vs the formula (E*S)/W + C*S, S = 3*D*F elements per
expert (fp32); EP's and FSDP's local expert bytes alongside.

Machine load: the 1-minute load average before and after every scenario (it includes this
benchmark's own 2 busy ranks; the cores are shared with other jobs).

Shape legend: T tokens per rank, D model width, F expert hidden width, E experts, K top-k, W ranks,
C slots per device, S elements per expert, R expert rows, N pool batches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.ep_layer import host_info  # noqa: E402
from benchmarks.ep_step import summary  # noqa: E402
from benchmarks.fsep_layer import (  # noqa: E402
    POOL,
    W,
    calibrate,
    ep_split_spread,
    init_block,
    input_pool,
    record_real_router,
    zipf_shares,
)
from benchmarks.fsep_worker import LR, SYSTEMS, worker  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = HERE / "results" / "fsep.json"
SCENARIOS = ("zipf", "real_l0", "real_l1", "balanced")
SKEWED = ("zipf", "real_l0", "real_l1")
LAYERS = {  # C slots per device; T (tokens per rank) from --tokens
    "full": dict(D=256, F=512, E=8, K=2, C=5),
    "quick": dict(D=128, F=256, E=8, K=2, C=5),
}
TOKENS = {"full": (8192, 2048), "quick": (128,)}  # the first is the headline layer (see module doc)
REAL_ROUTER = {  # training of the model whose router skew is recorded
    "full": dict(steps=200, record=10, batch=8, seq=128, lr=3e-3),
    "quick": dict(steps=40, record=10, batch=8, seq=128, lr=3e-3),
}
ZIPF_S = 1.2
GOALS = {"fsep_max_over_mean": 1.15, "ep_over_fsep_skewed": 1.2, "fsep_over_ep_balanced": 1.10}
# what the benchmark measures, in its results file
WHAT = ("FSEP vs EP vs FSDP2 on one HF Mixtral MoE layer at W=2 gloo ranks x 1 thread: max/mean rows per "
        "device under skewed routing (Zipf(1.2), two recorded router skews) and balanced routing; train-step "
        "time (fwd + bwd + Adam) in interleaved rounds with the compute floor; FSEP parameter memory per "
        "rank measured vs (E*S)/W + C*S")



# ----------------------------------------------------------------------------------------------
# Orchestrator
# ----------------------------------------------------------------------------------------------


def prepare(layer: dict, real: dict, directory: Path) -> tuple[Path, dict]:
    """Calibrate the router of every scenario; save states, pool and probe for the workers."""
    block = init_block(layer)
    pool = input_pool(layer)
    probe = torch.randn(W, layer["T"], layer["D"], generator=torch.Generator().manual_seed(2))
    E = layer["E"]
    targets = {"zipf": zipf_shares(E, ZIPF_S), "real_l0": real["shares"][0], "real_l1": real["shares"][1],
               "balanced": [1.0 / E] * E}
    states, scenarios = {}, {}
    for name in SCENARIOS:
        cal = calibrate(block, pool, targets[name])
        states[name] = {k: v.clone() for k, v in block.state_dict().items()}
        scenarios[name] = {"calibration": cal, "ep_max_over_mean_by_split": ep_split_spread(cal["realised"])}
        print(f"{name:9s} target   " + " ".join(f"{v:.3f}" for v in cal["target"]), flush=True)
        print(f"{'':9s} realised " + " ".join(f"{v:.3f}" for v in cal["realised"])
              + f"   (max |diff| {cal['max_abs_error']:.4f}, {cal['iterations']} iterations, "
              f"EP max/mean {scenarios[name]['ep_max_over_mean_by_split']['identity_order']:.3f})", flush=True)
    path = directory / "fsep_data.pt"
    torch.save({"layer": layer, "pool": pool, "probe": probe, "states": states}, path)
    return path, scenarios


def launch(data: Path, args, directory: Path) -> tuple[dict | None, str]:
    """One torchrun launch of W ranks running every scenario; (result or None, log tail if it failed)."""
    result = directory / "result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={W}",
           str(Path(__file__).resolve()), "--worker", "--data", str(data), "--result", str(result),
           "--scenarios", *args.scenarios, "--warmup", str(args.warmup), "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--profile-steps", str(args.profile_steps), "--comm-reps", str(args.comm_reps)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    text = proc.stdout + proc.stderr
    lines = [ln for ln in text.splitlines() if ln.strip() and "returned a view tensor" not in ln
             and not ln.startswith(("  output = self._register", "[fsep rank"))]
    log = f"exit code {proc.returncode}\n" + "\n".join(lines[-60:])
    if result.exists() and text.count("worker finished") == W:
        return json.loads(result.read_text()), ("" if proc.returncode == 0 else log)
    return None, log


def ms(values: list[float]) -> dict:
    s = summary([1e3 * v for v in values])
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def aggregate(name: str, res: dict, layer: dict) -> dict:
    """Per scenario: loads, step times and ratios, floors, phases, memory, collectives, profile, parity."""
    T, D, F, E, K, C = (layer[k] for k in ("T", "D", "F", "E", "K", "C"))
    first, last = res["timed_fsep_steps"]
    timed_loads = [r for r in res["loads"] if first <= r["step"] <= last]

    def balance(key: str) -> dict:
        values = [max(r[key]) / (sum(r[key]) / len(r[key])) for r in timed_loads]
        return {**summary(values), "per_step": values}

    rounds = {k: [statistics.median(v) for v in per_round] for k, per_round in res["times_s"].items()}
    step = {s: {**ms(rounds[s]), "round_medians_ms": [1e3 * v for v in rounds[s]],
                "all_steps_ms": [1e3 * v for r in res["times_s"][s] for v in r]} for s in SYSTEMS}
    floors = {k[len("floor_"):]: {**ms(v), "rows": res["floor_rows"][k[len("floor_"):]]}
              for k, v in rounds.items() if k.startswith("floor_")}
    ratios = {}
    for fsep in ("fsep", "fsep_keep"):
        for other in ("ep", "fsdp"):
            ratios[f"{other}/{fsep}"] = step[other]["median_ms"] / step[fsep]["median_ms"]
            ratios[f"{other}/{fsep}_per_round_median"] = statistics.median(
                a / b for a, b in zip(rounds[other], rounds[fsep]))
    for s in SYSTEMS:
        ratios[f"{s}/floor_balanced"] = step[s]["median_ms"] / floors["balanced"]["median_ms"]
    warm = res["warmup_steps"]
    phases = {}
    for s in SYSTEMS:
        window = slice(warm, warm + len(step[s]["all_steps_ms"]))  # the timed steps
        phases[s] = [{p: 1e3 * statistics.median(ph[i] for ph in rank["phases"][s][window])
                      for i, p in enumerate(("forward_ms", "backward_ms", "optimizer_ms"))} for rank in res["ranks"]]
    losses = {s: [sum(v) / W for v in zip(*(rank["losses"][s] for rank in res["ranks"]))] for s in SYSTEMS}
    n = min(len(v) for v in losses.values())
    parity = {s: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[s][:n], losses["ep"][:n]))
              for s in ("fsep", "fsep_keep", "fsdp")}
    S = 3 * D * F
    mem = res["ranks"][0]["memory"]
    measured = mem["fsep_local_expert_bytes"] + mem["fsep_restored"]["bytes"]
    formula = (E * S // W + C * S) * 4
    counts = torch.tensor(res["run_counts_last_5_steps"], dtype=torch.float64)
    sources = {}
    solves = [d["solve_ms"] for d in res["decisions"][1:]]
    for d in res["decisions"][1:]:
        sources[d["source"]] = sources.get(d["source"], 0) + 1
    restore_shape = str([[W * C, S // W]])  # the restore's [W*C, S/W] buffer, as the profiler prints it
    own_floor = {"fsep": floors["fsep_max_rows"], "fsep_keep": floors["fsep_max_rows"], "ep": floors["ep_max_rows"],
                 "fsdp": floors["balanced"]}
    where = {
        "step_minus_own_floor_ms": {s: step[s]["median_ms"] - own_floor[s]["median_ms"] for s in SYSTEMS},
        "own_floor": "the GEMMs alone on the system's most-loaded device rows (fsdp: T*K, data parallel)",
        "fsep_restore_bytes_to_each_peer": C * S // W * 4,
        "fsep_restore_alone_fwd_plus_bwd_ms": 2 * res["collectives"]["fsep_restore"]["ms"],
        "fsep_restore_wait_in_step_ms_per_rank": [rank["profile"]["fsep"]["wait_self_ms_by_shape"].get(restore_shape)
                                                  for rank in res["ranks"] if rank["profile"]],
    }
    return {
        "max_over_mean": {"ep": balance("ep"), "fsep": balance("fsep"),
                          "timed_steps": len(timed_loads)},
        "run_shares_last_5_steps": (counts.sum(0) / counts.sum()).tolist(),
        "step_ms": step, "ratios": ratios, "floor": floors, "where_time_goes": where, "phases_per_rank": phases,
        "parity_max_rel_loss_diff_vs_ep": parity, "losses_first_steps": {s: v[:3] for s, v in losses.items()},
        "memory_per_layer": {
            "fsep_measured_bytes": measured, "fsep_formula_bytes": formula, "measured/formula": measured / formula,
            "fsep_local_shards_bytes": mem["fsep_local_expert_bytes"],
            "fsep_restored_bytes": mem["fsep_restored"]["bytes"],
            "fsep_restored_nodes": mem["fsep_restored"]["nodes"],
            "formula": f"(E*S)/W + C*S = ({E}*{S})/{W} + {C}*{S} elements x 4 bytes (S = 3*D*F)",
            "ep_local_expert_bytes": mem["ep_local_expert_bytes"],
            "fsdp_local_expert_bytes": mem["fsdp_local_expert_bytes"],
            "fsdp_gathered_bytes_during_layer": E * S * 4,
        },
        "planner": {"decisions_by_candidate": sources, "final_table": res["decisions"][-1]["table"],
                    "initial_table": res["decisions"][0]["table"],
                    "solve_ms": summary(solves) if solves else None,
                    "max_wait_ms": max((d["wait_ms"] for d in res["decisions"][1:]), default=0.0),
                    "config": res["planner_config"]},
        "collectives": res["collectives"],
        "profile_per_rank": [rank["profile"] for rank in res["ranks"]],
        "load1": {"before": res["load1_before"], "after": res["load1_after"]},
        "wall_s": res["wall_s"],
        "loads_per_step": res["loads"],
    }


def goals(results: dict) -> dict:
    """Each issue-14 goal per scenario: the measured figure and whether it is met."""
    out: dict = {"fsep_max_over_mean<=1.15": {}, "ep/fsep>=1.2 (skewed)": {}}
    for s, r in results.items():
        if s not in SKEWED:
            continue
        mm = r["max_over_mean"]
        out["fsep_max_over_mean<=1.15"][s] = {"fsep": mm["fsep"]["median"], "ep": mm["ep"]["median"],
                                             "met": mm["fsep"]["median"] <= GOALS["fsep_max_over_mean"]}
        ratio = r["ratios"]
        out["ep/fsep>=1.2 (skewed)"][s] = {
            fsep: {"ratio": ratio[f"ep/{fsep}"], "per_round_median": ratio[f"ep/{fsep}_per_round_median"],
                   "met": ratio[f"ep/{fsep}"] >= GOALS["ep_over_fsep_skewed"]} for fsep in ("fsep", "fsep_keep")}
    if "balanced" in results:
        ratio = results["balanced"]["ratios"]
        out["fsep/ep<=1.10 (balanced)"] = {
            fsep: {"ratio": 1 / ratio[f"ep/{fsep}"], "per_round_median": 1 / ratio[f"ep/{fsep}_per_round_median"],
                   "met": 1 / ratio[f"ep/{fsep}"] <= GOALS["fsep_over_ep_balanced"]} for fsep in ("fsep", "fsep_keep")}
    return out


def run_layer(layer: dict, real: dict, args) -> tuple[dict | None, list[dict], dict]:
    """Calibrate, launch (one retry) and aggregate one layer size; (results or None, failures, load info)."""
    waited = common.wait_for_load(args.wait_load, args.wait_max) if args.wait_load else 0.0
    load = {"waited_s": waited, "load1_start": os.getloadavg()[0]}
    failures: list[dict] = []
    res = None
    with tempfile.TemporaryDirectory(prefix="fsep_") as tmpdir:
        tmp = Path(tmpdir)
        data, routing = prepare(layer, real, tmp)
        for attempt in range(2):  # one retry: a failed launch is recorded, not hidden
            t = time.perf_counter()
            res, log = launch(data, args, tmp)
            load["launch_wall_s"] = time.perf_counter() - t
            if res is not None:
                if log:
                    failures.append({"T": layer["T"], "attempt": attempt, "measured": True, "log": log})
                break
            failures.append({"T": layer["T"], "attempt": attempt, "measured": False, "log": log})
            print(f"T={layer['T']}: launch FAILED (attempt {attempt}):\n{log[-3000:]}", flush=True)
    load["load1_end"] = os.getloadavg()[0]
    if res is None:
        return None, failures, load
    results = {name: aggregate(name, r, layer) for name, r in res["scenarios"].items()}
    for name, r in results.items():
        r["routing"] = routing[name]
    return results, failures, load


def orchestrate(args) -> int:
    mode = "quick" if args.quick else "full"
    base = LAYERS[mode]
    t0 = time.perf_counter()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    torch.set_num_threads(1)
    real = record_real_router(REAL_ROUTER[mode])
    print(f"real router ({real['steps']} steps, loss {real['loss_first']:.2f} -> {real['loss_last']:.2f}): "
          + "; ".join(f"layer {i} shares " + " ".join(f"{v:.3f}" for v in s) for i, s in enumerate(real["shares"])),
          flush=True)
    by_tokens, failures, loads = {}, [], {}
    for T in args.tokens:
        layer = {**base, "T": T}
        print(f"\n== T={T} tokens per rank ==", flush=True)
        results, fails, load = run_layer(layer, real, args)
        failures += fails
        loads[f"T={T}"] = load
        if results is not None:
            by_tokens[f"T={T}"] = {"layer": {**layer, "W": W, "S": 3 * layer["D"] * layer["F"]},
                                   "goals": goals(results), "results": results}
            table(f"T={T}", by_tokens[f"T={T}"], args)
    during = [v for entry in by_tokens.values() for r in entry["results"].values() for v in r["load1"].values()]
    doc = {
        **common.results_header("fsep", WHAT, args.argv, started),
        "quick": args.quick,
        "layer_common": {**base, "W": W, "dtype": "float32", "block": "transformers MixtralSparseMoeBlock",
                         "router": "frozen; feature 0 of every token = 1, its weight column the calibrated "
                                   "per-expert bias", "optimizer": f"Adam lr {LR} on the expert weights",
                         "pool_batches": POOL, "tokens_per_rank": list(args.tokens),
                         "headline": f"T={args.tokens[0]}"},
        "systems": {
            "fsep": f"moepass Plan(form='fsep', topology=Topology(1, 2), slots_per_device={base['C']}, planner='auto')",
            "fsep_keep": f"moepass Plan(form='fsep', topology=Topology(1, 2), slots_per_device={base['C']}, "
                         f"planner='auto', keep_restored=True): the backward reuses the forward's restored experts",
            "ep": "moepass Plan(form='ep', topology=Topology(1, 2))",
            "fsdp": "moepass Plan(form='single') + FSDP2 fully_shard (non-root unit, reshard_after_forward=True)",
        },
        "step_definition": "zero_grad + forward + backward + Adam step; barrier before each step, time = max over "
                           "ranks",
        "warmup_steps": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps,
        "interleaved": "per round: " + ", ".join([*SYSTEMS, "floors"]) + f", {args.steps} steps each",
        "goals_targets": GOALS,
        "real_router": real,
        "by_tokens": by_tokens,
        "failures": failures,
        "load_average": {"wait_load": args.wait_load, "per_launch": loads,
                         "load1_during": summary(during) if during else None,
                         "note": "sampled before/after each scenario; includes this benchmark's own 2 busy ranks; "
                                 "2 cores shared with other jobs"},
        "machine": host_info(),
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "fsep_quick.json" if args.quick else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    png = out.with_name(out.stem + "_load.png")
    if by_tokens:
        plot(doc, next(iter(by_tokens)), png)
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0 if len(by_tokens) == len(args.tokens) else 1


def table(key: str, entry: dict, args) -> None:
    lay, results = entry["layer"], entry["results"]
    loads = [v for r in results.values() for v in r["load1"].values()]
    print(f"\nFSEP benchmark {key}: D={lay['D']} F={lay['F']} E={lay['E']} K={lay['K']} W={lay['W']} C={lay['C']}; "
          f"{args.rounds} rounds x {args.steps} steps; load1 {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'scenario':9s} {'max/mean EP':>11s} {'FSEP':>6s} | {'fsep ms':>17s} {'fsep_keep ms':>17s} {'ep ms':>17s} "
          f"{'fsdp ms':>17s} | {'ep/fsep':>7s} {'ep/keep':>7s} {'fsdp/fsep':>9s} | {'floor bal':>9s} {'ep max':>6s} "
          f"{'fsep max':>8s}")
    for name, r in results.items():
        mm, st, fl = r["max_over_mean"], r["step_ms"], r["floor"]
        cell = lambda s: f"{st[s]['median_ms']:6.1f} [{st[s]['min_ms']:.0f},{st[s]['max_ms']:.0f}]"  # noqa: E731
        print(f"{name:9s} {mm['ep']['median']:11.3f} {mm['fsep']['median']:6.3f} | {cell('fsep'):>17s} "
              f"{cell('fsep_keep'):>17s} {cell('ep'):>17s} {cell('fsdp'):>17s} | {r['ratios']['ep/fsep']:7.2f} "
              f"{r['ratios']['ep/fsep_keep']:7.2f} {r['ratios']['fsdp/fsep']:9.2f} | "
              f"{fl['balanced']['median_ms']:9.1f} {fl['ep_max_rows']['median_ms']:6.1f} "
              f"{fl['fsep_max_rows']['median_ms']:8.1f}")
    print("max/mean: rows per device per timed step (median); ms: median [range] of round medians; floor: the "
          "expert GEMMs alone on T*K rows (bal) and on the most-loaded device's rows")
    for name, r in results.items():
        m, c = r["memory_per_layer"], r["collectives"]
        print(f"{name:9s} memory measured {m['fsep_measured_bytes'] / 2**20:.2f} MiB vs formula "
              f"{m['fsep_formula_bytes'] / 2**20:.2f} MiB; alone: restore {c['fsep_restore']['ms']:.1f} ms, all_gather "
              f"{c['fsdp_all_gather']['ms']:.1f} ms, reduce_scatter {c['fsdp_reduce_scatter']['ms']:.1f} ms, dispatch "
              f"{c['ep_dispatch']['ms']:.1f} ms; planner {r['planner']['decisions_by_candidate']}; loss vs EP "
              + ", ".join(f"{k} {v:.1e}" for k, v in r["parity_max_rel_loss_diff_vs_ep"].items()))
    for goal, v in entry["goals"].items():
        print(f"goal {goal}: {v}")


def plot(doc: dict, key: str, path: Path) -> None:
    """Rows per device per step, EP (dashed) vs FSEP (solid), one panel per scenario, for layer `key`."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entry = doc["by_tokens"][key]
    results, lay = entry["results"], entry["layer"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False, sharey=True)
    for ax, (name, r) in zip(axes[0], results.items()):
        loads = r["loads_per_step"]
        steps = [x["step"] for x in loads]
        for rank, color in zip(range(lay["W"]), ("tab:blue", "tab:orange")):
            ax.plot(steps, [x["ep"][rank] for x in loads], "--", color=color, label=f"EP device {rank}")
            ax.plot(steps, [x["fsep"][rank] for x in loads], "-", color=color, label=f"FSEP device {rank}")
        ax.axhline(lay["T"] * lay["K"], color="black", lw=0.8, ls=":", label="mean (T*K)")
        ax.axvspan(0, doc["warmup_steps"] + 0.5, color="0.9", label="warm-up (untimed)")
        mm = r["max_over_mean"]
        ax.set_title(f"{name}: max/mean EP {mm['ep']['median']:.2f}, FSEP {mm['fsep']['median']:.2f}", fontsize=9)
        ax.set_xlabel("FSEP training step")
    axes[0][0].set_ylabel("expert rows computed per device")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(f"Per-device expert rows per step, W={lay['W']}, E={lay['E']}, K={lay['K']}, C={lay['C']}, "
                 f"T={lay['T']} per rank ({doc['started'][:10]})", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


COUNTS = {"--rounds": (10, 1, "interleaved rounds per scenario"), "--steps": (3, 2, "timed steps per system per round"),
          "--warmup": (10, 7, "untimed steps per system"), "--profile-steps": (3, 0, "profiled steps per system"),
          "--comm-reps": (10, 3, "repetitions per collective")}


def main(argv: list[str] | None = None) -> int:
    p = common.benchmark_parser(__doc__, "small layer, 1 round of 2 steps, JSON to the temp dir", COUNTS)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="tokens per rank, one launch each; the first is the headline (default 8192 2048; --quick 128)")
    p.add_argument("--out", default=None, help=f"JSON path (default {OUT.relative_to(ROOT)})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the launch")
    common.add_wait_options(p)
    # internal: the worker of the launch
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = common.parse_args(p, argv, COUNTS)
    args.tokens = args.tokens or list(TOKENS["quick" if args.quick else "full"])
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
