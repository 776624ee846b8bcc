"""Train a tiny Hugging Face Mixtral (random init) with moepass expert parallel, step by step against
the single-process reference.

    torchrun --standalone --nproc-per-node 4 samples/train_ep.py [--steps 5] [--nodes 2] [--ep-size 4]

Every rank builds the same model (same seed). `moepass.compile(model, Plan(form="ep"))` shards the
experts over the EP group; DDP averages the replicated (non-expert) gradients and ignores the expert
parameters, whose gradients moepass already reduces. Rank 0 also trains an untouched copy of the
model on the concatenation of all ranks' batches (the reference) with the same optimizer. Each step
prints both losses and both global gradient norms; exits 1 if they ever differ beyond fp32 rtol 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH_PER_RANK, SEQ = 2, 16


def tiny_mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=None, help="simulated nodes (default: torchrun's)")
    parser.add_argument("--ep-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import MixtralForCausalLM

    import moepass
    from moepass.runtime.grads import clip_grad_norm_

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = moepass.Topology.from_env() if args.nodes is None else moepass.Topology(args.nodes, world // args.nodes)

    torch.manual_seed(0)
    model = MixtralForCausalLM(tiny_mixtral_config())
    report = moepass.detect(model)
    if rank == 0:
        print(report.summary())
    reference = copy.deepcopy(model) if rank == 0 else None
    cm = moepass.compile(model, moepass.Plan(form="ep", ep_size=args.ep_size, topology=topology), report=report)
    ddp = DDP(cm)  # non-expert gradients averaged over the world; expert parameters ignored
    opt = torch.optim.AdamW(cm.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None

    ok = True
    for step in range(args.steps):
        tokens = torch.randint(0, 128, (world * BATCH_PER_RANK, SEQ), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
        moepass.reset_comm_stats()
        opt.zero_grad()
        loss = ddp(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = clip_grad_norm_(cm.parameters(), max_norm=1.0)
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        if reference is not None:
            ref_opt.zero_grad()
            ref_loss = reference(input_ids=tokens, labels=tokens).loss
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0)
            ref_opt.step()
            same = (torch.allclose(global_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
                    and torch.allclose(norm, ref_norm, rtol=1e-5, atol=1e-6))
            ok &= same
            s = moepass.comm_stats()["total"]
            print(f"step {step}: loss EP {global_loss.item():.7f}  reference {ref_loss.item():.7f}  "
                  f"|diff| {abs(global_loss.item() - ref_loss.item()):.1e}   grad norm EP {norm.item():.6f}  "
                  f"reference {ref_norm.item():.6f}   rank0 bytes intra {s['intra']} inter {s['inter']}"
                  + ("" if same else "   MISMATCH"), flush=True)
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, src=0)
    if rank == 0:
        print("EP training matches the single-process reference" if ok else "EP training DIFFERS from the reference")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
