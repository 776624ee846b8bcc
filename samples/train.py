"""Train the sample MoE LM on real text with moepass: one recipe for every form, copy it and change it.

    python -m moepass train --form ep --nproc 2 --steps 200 --reference --out runs/ep    # spawns 2 ranks
    torchrun --nproc-per-node 8 samples/train.py --form fsep --steps 2000 --ckpt-every 200 --out runs/fsep

What it does, in order (every rank):
1. data: the Python Language Reference text shipped with Python (`pydoc_data.topics`), bytes as tokens,
   packed into sequences of --seq + 1, global batches of --global-batch sequences in a seeded order, this
   rank's slice of each (`moepass.train.data`);
2. model: the sample Mixtral-like LM (`samples.models.tiny_mixtral`; for --form hp its Multi-Head
   LatentMoE twin, where HP keeps the math), or --model hf:<config> (a Hugging Face causal LM built from its
   config, no weights) or --model torchtitan (torchtitan's Qwen3-MoE; `samples/train_models.py`), built
   from --seed, identical on every rank;
3. parallel: `moepass.compile(model, Plan(form=...))` (--form none: the untouched model), then the dense
   gradients averaged by DDP, by moepass's priority scheduler (--grad-sync scheduler) or sharded with
   FSDP2 (--fsdp: `moepass.fully_shard` per layer and on the root; the experts keep their own mesh);
4. optimizer: AdamW (`moepass.train.optim.build_optimizer`), linear warmup then cosine, global grad-norm
   clipping (`moepass.clip_grad_norm_`, plain and DTensor gradients together); a parameter left without a
   gradient (an expert no token chose, skipped by the model's loop) is stepped with a zero one
   (`fill_missing_grads`, as the forms step their one tensor of experts; --unused-grads skip: torch's default);
5. each step: forward, backward, clip, step; the mean loss over the ranks, tokens/s, the bytes moepass's
   all-to-alls and FSEP restores sent; a progress line every --log-every steps;
6. checkpoints every --ckpt-every steps (DCP: model, optimizer, step, RNG, FSEP placement tables, in the
   original model's layout) and --resume (the newest complete one, or a path), also under another --form or
   --nproc (EP at W=4 resumed as FSEP at W=2);
7. --reference: rank 0 also trains the untouched model on the same global batches (whole, one process)
   with the same optimizer and schedule, and logs both losses;
8. at the end rank 0 writes <out>/train_log.json and <out>/loss.png.
Options: --ac (activation checkpointing per layer), --bf16 (autocast), --compile (torch.compile, graph breaks
logged), --ep-size (experts on a dp x ep mesh), --fsdp, --grad-sync scheduler; `--help` lists them all.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepass.cli import check_output_folder, nonnegative_float, nonnegative_int, positive_float, positive_int  # noqa: E402

FORMS = ("none", "single", "ep", "fsep", "hp", "locality", "auto")
STEPS_FILE = "train_steps.json"  # in each checkpoint: the log's steps up to it (rank 0), continued by --resume


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = p.add_argument
    a("--form", default="ep", choices=FORMS, help="parallel form of the MoE blocks; none: the model without moepass")
    a("--nproc", type=positive_int, default=2, help="ranks to spawn when not launched by torchrun (default 2)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when there is one")
    a("--steps", type=positive_int, default=200, help="total optimizer steps (a resumed run continues to this)")
    a("--seed", type=int, default=0, help="model init and data order")
    a("--seq", type=positive_int, default=64, help="tokens per sequence")
    a("--global-batch", type=positive_int, default=8, help="sequences per step over all ranks")
    a("--dim", type=positive_int, default=64)
    a("--ffn-dim", type=positive_int, default=128)
    a("--experts", type=positive_int, default=8)
    a("--top-k", type=positive_int, default=2)
    a("--layers", type=positive_int, default=2)
    a("--heads", type=positive_int, default=4)
    a("--style", default="loop", choices=["loop", "fused", "gshard", "mixed"], help="the sample's MoE style")
    a("--model", default="sample",
      help="sample (the sample LM), hf:<config> (a Hugging Face causal LM built from its config: a tiny one of "
           "samples/hf_models.py such as hf:qwen3_moe, or a hub id / folder read offline) or torchtitan (its "
           "Qwen3-MoE model at --dim/--layers/--heads/--experts/--top-k/--ffn-dim); vocabulary: the 256 bytes")
    a("--lr", type=positive_float, default=3e-3)
    a("--warmup", type=nonnegative_int, default=20, help="linear warmup steps, then cosine to lr/10")
    a("--weight-decay", type=nonnegative_float, default=0.1)
    a("--clip", type=positive_float, default=1.0, help="global grad-norm clip")
    a("--foreach", default="auto", choices=["auto", "on", "off"], help="torch's multi-tensor optimizer kernels")
    a("--ep-size", type=positive_int, default=None, help="Plan.ep_size (data parallel over the rest); default the world")
    a("--nodes", type=positive_int, default=1, help="simulated nodes (Plan.topology: nodes x world/nodes)")
    a("--planner", default="auto", choices=["auto", "static"], help="FSEP placement planner")
    a("--fsdp", action="store_true", help="FSDP2 on the dense parameters (moepass.fully_shard per layer + root)")
    a("--grad-sync", default="ddp", choices=["ddp", "scheduler"],
      help="dense gradients: DDP, or moepass's priority scheduler (Plan(grad_sync='scheduler'); with --fsdp: "
           "schedule_fsdp)")
    a("--bf16", action="store_true", help="autocast to bfloat16 (the router stays fp32)")
    a("--ac", action="store_true", help="activation checkpointing of every decoder layer")
    a("--compile", action="store_true", help="torch.compile (inductor) over the model; graph breaks are logged")
    a("--reference", action="store_true", help="rank 0 also trains the untouched model on the same batches")
    a("--unused-grads", default="zero", choices=["zero", "skip"],
      help="a parameter left without a gradient (an expert no token chose, in a model whose loop skips it): "
           "zero: stepped with a zero gradient, as moepass's forms step their expert tensors (default); skip: "
           "left alone by the optimizer (torch's None gradient)")
    a("--out", default="runs/train", help="folder for train_log.json and loss.png")
    a("--ckpt-dir", default=None, help="checkpoint folder (default <out>/ckpt)")
    a("--ckpt-every", type=nonnegative_int, default=0, help="checkpoint every N steps (0: never)")
    a("--resume", default=None, help="'latest' (newest complete checkpoint in --ckpt-dir) or a checkpoint path")
    a("--log-every", type=positive_int, default=10, help="a progress line every N steps")
    a("--kill-at", type=int, default=None, help=argparse.SUPPRESS)  # tests: the last rank dies after this step
    return p


# ---- the pieces --------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, world: int) -> torch.nn.Module:
    from samples.models import tiny_latent_lm, tiny_mixtral

    if args.model != "sample":
        from samples import train_models

        if args.form == "hp":
            raise SystemExit(f"--form hp trains the sample's Multi-Head LatentMoE twin; --model {args.model} has no "
                             f"latent heads: use another form or --model sample")
        if args.model.startswith("hf:"):
            return train_models.hf_lm(args.model[3:], args.seed)
        if args.model == "torchtitan":
            return train_models.torchtitan_lm(args.seed, dim=args.dim, layers=args.layers, heads=args.heads,
                                              experts=args.experts, top_k=args.top_k, ffn_dim=args.ffn_dim,
                                              seq=args.seq)
        raise SystemExit(f"--model {args.model!r}: use sample, hf:<config> or torchtitan")
    torch.manual_seed(args.seed)
    sizes = dict(vocab_size=256, dim=args.dim, layers=args.layers)
    if args.form == "hp":  # Multi-Head LatentMoE: its heads split over the ranks, HP keeps the math
        heads = world * math.ceil(4 / world)  # latent heads (the attention keeps the sample's 4)
        return tiny_latent_lm(heads=heads, head_dim=args.dim // heads, experts=max(1, args.experts // 2),
                              top_k=args.top_k, latent_ffn_dim=args.ffn_dim // 4, **sizes)
    return tiny_mixtral(style=args.style, ffn_dim=args.ffn_dim, num_experts=args.experts, top_k=args.top_k,
                        heads=args.heads, **sizes)


def build_plan(args: argparse.Namespace, world: int):
    import moepass

    topology = moepass.Topology(args.nodes, world // args.nodes)
    kw: dict[str, Any] = {"grad_sync": "scheduler"} if args.grad_sync == "scheduler" else {}
    if args.form == "single":
        return moepass.Plan(form="single", **kw)
    kw.update(topology=topology, ep_size=args.ep_size)
    if args.form == "fsep":
        kw["planner"] = args.planner
    if args.form == "locality":
        kw.update(mu=0.1, gate="learned")
    if args.form == "auto":
        kw["batch"] = (args.global_batch // world, args.seq)
    return moepass.Plan(form=args.form, **kw)


def parallelize(model: torch.nn.Module, args: argparse.Namespace, world: int):
    """(the compiled model, the module to call): moepass.compile, then DDP / FSDP2 / the priority scheduler
    for the dense gradients."""
    import moepass
    from moepass.runtime.grad_sync import schedule_fsdp

    cm = model if args.form == "none" else moepass.compile(model, build_plan(args, world))
    if args.ac:  # activation checkpointing: each layer's activations recomputed in the backward
        for layer in decoder_layers(cm):
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    if args.fsdp:
        if args.form == "none" and args.unused_grads == "skip":
            raise SystemExit("--form none --fsdp --unused-grads skip: FSDP2 reduce-scatters the gradients a rank "
                             "has, so a loop-style expert no local token chose leaves the ranks out of step; use "
                             "--unused-grads zero (the default)")
        for layer in decoder_layers(cm):
            if args.form == "none":
                touch_every_parameter(layer)
            moepass.fully_shard(layer)
        moepass.fully_shard(cm)
        if args.grad_sync == "scheduler":
            schedule_fsdp(cm)
        return cm, cm
    if world == 1 or (args.grad_sync == "scheduler" and args.form != "none"):
        return cm, cm  # Plan(grad_sync="scheduler"): compile installed GradientSync on the model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [torch.cuda.current_device()] if next(cm.parameters()).is_cuda else None
    # the untouched loop-style MoE gives no gradient to an expert no local token chose; moepass's forms always do
    return cm, DDP(cm, device_ids=device_ids, find_unused_parameters=args.form == "none")


def touch_every_parameter(layer: torch.nn.Module) -> None:
    """The untouched model under FSDP2: every parameter of `layer` gets a gradient on every rank, a zero one
    where the forward never read it (a loop-style MoE skips an expert no local token chose). FSDP2
    reduce-scatters the gradients each rank has, so without this the ranks send different sizes (gloo:
    "Received data size doesn't match expected size"). The layer's first tensor output gains
    0 * (one element of each parameter): the values are unchanged and a used parameter's gradient gains an
    exact zero. Registered before `fully_shard`, the hook runs while FSDP2 holds the parameters unsharded."""

    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        zero = sum(p.reshape(-1)[0] for p in module.parameters() if p.requires_grad) * 0
        if isinstance(out, torch.Tensor):
            return out + zero
        first = next(i for i, o in enumerate(out) if isinstance(o, torch.Tensor))
        return type(out)(o + zero if i == first else o for i, o in enumerate(out)) if isinstance(out, tuple) else out

    layer.register_forward_hook(hook)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's stack of decoder layers: its ModuleList or ModuleDict nearest the root (`layers` of the sample,
    `model.layers` of a Hugging Face LM, `model.layers` of the torchtitan wrapper)."""
    stacks = [(name.count("."), list(m.values() if isinstance(m, torch.nn.ModuleDict) else m))
              for name, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    if not stacks:
        raise SystemExit(f"--ac / --fsdp: {type(model).__name__} holds no ModuleList or ModuleDict of layers")
    return min(stacks, key=lambda s: s[0])[1]


def lm_loss(run: Any, tokens_BS1: torch.Tensor) -> torch.Tensor:
    out = run(tokens_BS1[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits  # a Hugging Face ModelOutput
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens_BS1[:, 1:].reshape(-1))


def comm_bytes() -> tuple[int, int]:
    """(all-to-all bytes, FSEP restore bytes) this rank sent to peers since the last reset."""
    import moepass

    a2a = restore = 0
    for kind, entry in moepass.comm_stats().items():
        if kind == "total":
            continue
        sent = entry["intra"] + entry["inter"]
        if "restore" in kind:
            restore += sent
        else:
            a2a += sent
    return a2a, restore


# ---- the run (every rank) ----------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    import moepass
    from moepass.train import checkpoint, report
    from moepass.train.data import Batches
    from moepass.train.optim import build_optimizer, fill_missing_grads, lr_at, set_lr

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    batches = Batches.from_corpus(args.seq, args.global_batch, args.seed)
    model = build_model(args, world).to(device)
    reference = copy.deepcopy(model) if args.reference and rank == 0 else None
    cm, run = parallelize(model, args, world)
    if args.compile:
        from torch._dynamo import config as dynamo_config

        dynamo_config.capture_dynamic_output_shape_ops = True  # token counts: data-dependent sizes
        run = torch.compile(run)
    foreach = {"auto": None, "on": True, "off": False}[args.foreach]
    optimizer = build_optimizer(cm, args.lr, args.weight_decay, foreach=foreach)
    ref_opt = build_optimizer(reference, args.lr, args.weight_decay, foreach=foreach) if reference else None
    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else nullcontext()


    ckpt_dir = checkpoint_dir(args)
    start = 0
    records: list[dict[str, Any]] = []
    if args.resume:
        path = resume_path(args)
        start, _ = checkpoint.load(path, cm, optimizer)
        records = earlier_steps(path, start) if rank == 0 else []
        if reference is not None and ref_opt is not None:
            saved = torch.load(os.path.join(path, "reference.pt"), weights_only=True)
            reference.load_state_dict(saved["model"])
            ref_opt.load_state_dict(saved["optim"])
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)

    controllers = checkpoint.placements(cm)
    info = getattr(cm, "moepass_info", None)
    forms = {path: type(gm.layout).__name__ if gm.layout is not None else "single"
             for path, gm in (info.rewritten.items() if info is not None else ())}
    if rank == 0:
        print(f"W={world} form={args.form}: blocks {forms or 'untouched'}", flush=True)
    tokens_per_step = args.global_batch * args.seq
    for step in range(start, args.steps):
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        set_lr(optimizer, lr)
        tokens = batches.rank_batch(step, rank, world).to(device)
        moepass.reset_comm_stats()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = lm_loss(run, tokens)
            total = loss + moepass.aux_loss(cm) if args.form == "locality" else loss
        total.backward()
        filled = fill_missing_grads(cm.parameters()) if args.unused_grads == "zero" else 0
        moepass.clip_grad_norm_(list(cm.parameters()), args.clip)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        value = mean.item() / world  # the step's host sync (also ends its timing on a GPU)
        seconds = time.perf_counter() - t0
        a2a, restore = comm_bytes()
        rec = {"step": step + 1, "loss": value, "lr": lr, "seconds": seconds, "tokens_per_s": tokens_per_step / seconds,
               "a2a_bytes": a2a, "restore_bytes": restore, "zero_filled_grads": filled}
        if controllers:  # FSEP: the placement table each block used this step
            rec["placements"] = {path: m.slot_expert.tolist() for path, m in controllers.items()}
        if reference is not None and ref_opt is not None:
            set_lr(ref_opt, lr)
            ref_opt.zero_grad(set_to_none=True)
            with autocast():
                ref_loss = lm_loss(reference, batches.global_batch_at(step).to(device))
            ref_loss.backward()
            if args.unused_grads == "zero":
                rec["ref_zero_filled_grads"] = fill_missing_grads(reference.parameters())
            torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip)
            ref_opt.step()
            rec["ref_loss"] = ref_loss.item()
        records.append(rec)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(report.progress_line(rec, args.steps), flush=True)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            path = os.path.join(ckpt_dir, f"step_{step + 1:06d}")
            if reference is not None:
                os.makedirs(path, exist_ok=True)
                torch.save({"model": reference.state_dict(), "optim": ref_opt.state_dict()},
                           os.path.join(path, "reference.pt"))
            if rank == 0:  # the log so far, continued by a resume from this checkpoint
                report.write_json(os.path.join(path, STEPS_FILE), {"steps": records})
            checkpoint.save(ckpt_dir, cm, optimizer, step + 1)
        if args.kill_at is not None and step + 1 == args.kill_at and rank == world - 1:
            os._exit(17)  # a crash (tests): no clean-up, no final checkpoint

    if rank != 0:
        return None
    breaks = None
    if args.compile:
        from torch._dynamo.utils import counters

        breaks = {reason.split("\n")[0] + " | " + next((ln.strip() for ln in reason.split("\n")
                                                          if "Explanation" in ln), ""): n
                  for reason, n in counters["graph_break"].items()}
        print(f"graph breaks: {sum(breaks.values())}" + "".join(f"\n  {n} x {r}" for r, n in breaks.items()),
              flush=True)
    return finish(args, world, records, start, forms, breaks)


def finish(args: argparse.Namespace, world: int, records: list[dict[str, Any]], start: int,
           forms: dict[str, str], graph_breaks: dict[str, int] | None = None) -> dict[str, Any]:
    from moepass.train import report
    from moepass.train.data import corpus_tokens

    timed = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    diffs = [abs(r["loss"] - r["ref_loss"]) for r in records if "ref_loss" in r]
    log = {
        "command": " ".join(sys.argv), "world": world,
        "args": {k: v for k, v in vars(args).items() if not callable(v)}, "start_step": start, "blocks": forms,
        "graph_breaks": graph_breaks,
        "corpus": {"source": "pydoc_data.topics (Python Language Reference, stdlib)", "bytes": corpus_tokens().numel(),
                   "tokenizer": "utf-8 bytes", "python": sys.version.split()[0]},
        "machine": {"torch": torch.__version__, "cpu_count": os.cpu_count(), "load": os.getloadavg(),
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
        "summary": {"final_loss": records[-1]["loss"] if records else None,
                    "tokens_per_s_median": statistics.median(timed) if timed else None,
                    "max_abs_dloss": max(diffs) if diffs else None},
        "steps": records,
    }
    report.write_json(os.path.join(args.out, "train_log.json"), log)
    curves = {args.form: [(r["step"], r["loss"]) for r in records]}
    if diffs:
        curves["reference"] = [(r["step"], r["ref_loss"]) for r in records]
    if records:
        try:
            report.plot(os.path.join(args.out, "loss.png"), curves,
                        f"{args.model} MoE LM on pydoc topics, form={args.form}, W={world}")
        except ImportError:  # the log above has every figure; the picture needs matplotlib
            print("no loss.png: matplotlib is not installed (pip install matplotlib)", flush=True)
    print(f"wrote {os.path.join(args.out, 'train_log.json')}"
          + (f"; max |loss - reference| over {len(diffs)} steps: {max(diffs):.3e}" if diffs else ""), flush=True)
    return log


def checkpoint_dir(args: argparse.Namespace) -> str:
    return args.ckpt_dir or os.path.join(args.out, "ckpt")


def resume_path(args: argparse.Namespace) -> str:
    """The checkpoint --resume names ('latest': the newest complete one in the checkpoint folder)."""
    from moepass.train import checkpoint

    if args.resume != "latest":
        return args.resume
    path = checkpoint.latest(checkpoint_dir(args))
    if path is None:
        raise SystemExit(f"moepass train: --resume latest: no complete checkpoint in {checkpoint_dir(args)}: "
                         f"train with --ckpt-every N first, or give --ckpt-dir / --out of the earlier run")
    return path


def checkpoint_step(path: str) -> int:
    """The step of the complete checkpoint at `path` (its COMPLETE marker holds it); SystemExit otherwise."""
    from moepass.train.checkpoint import MARKER

    if not os.path.isdir(path):
        raise SystemExit(f"moepass train: --resume {path}: no such checkpoint folder: give 'latest' or the path of "
                         f"a step_N folder a run with --ckpt-every wrote")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise SystemExit(f"moepass train: --resume {path}: not a complete checkpoint (no {MARKER} marker): give "
                         f"'latest' or a step_N folder whose save finished")
    with open(marker) as f:
        return int(f.read().strip() or 0)


def earlier_steps(path: str, start: int) -> list[dict[str, Any]]:
    """The log's steps up to `start` saved with the checkpoint at `path` (none for one saved without them)."""
    import json

    file = os.path.join(path, STEPS_FILE)
    if not os.path.isfile(file):
        return []
    with open(file) as f:
        return [r for r in json.load(f)["steps"] if r["step"] <= start]


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before any rank starts: the world against the batch, the output folders, the
    checkpoint --resume names. SystemExit with one line naming the option otherwise."""
    from moepass.train.launch import under_torchrun

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    if args.global_batch % world:
        raise SystemExit(f"moepass train: --global-batch {args.global_batch} is not a multiple of the world size "
                         f"{world} (--nproc): use a multiple of {world}")
    if args.nodes > world or world % args.nodes:
        raise SystemExit(f"moepass train: --nodes {args.nodes} does not divide the world size {world} (--nproc)")
    check_output_folder(args.out, "moepass train: --out")
    if args.ckpt_every:
        check_output_folder(checkpoint_dir(args), "moepass train: --ckpt-dir")
    if not args.resume:
        return
    path = resume_path(args)
    step = checkpoint_step(path)
    if args.steps <= step:
        raise SystemExit(f"moepass train: --steps {args.steps}: the checkpoint {path} is at step {step}: give "
                         f"--steps above {step} (the total steps, counted from the start)")
    if args.reference and not os.path.isfile(os.path.join(path, "reference.pt")):
        raise SystemExit(f"moepass train: --reference: the checkpoint {path} has no reference model (its run had "
                         f"no --reference): resume without --reference")


def resolve_device(args: argparse.Namespace) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def main(argv: list[str] | None = None) -> int:
    args = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    from moepass.train.launch import run as launch

    check_args(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch(train, args, args.nproc, resolve_device(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
