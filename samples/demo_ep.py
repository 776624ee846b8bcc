"""Expert parallel on 4 gloo ranks (2 simulated nodes × 2 ranks): parity and bytes by link.

    python samples/demo_ep.py [--style loop|fused|gshard] [--nodes 2] [--world 4]

Every rank builds the same tiny Mixtral-like LM, compiles it with `Plan(form="ep")` and runs one
training step on its slice of a global batch. Rank 0 also runs the original model on the whole batch
(the single-process reference) and the demo prints the largest differences (loss, outputs, every
gradient) and the bytes each rank sent, split intra-node / inter-node by the topology. Checks its own
result: exit code 0 when EP equals the reference within fp32 rtol 1e-5.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH_PER_RANK, SEQ = 2, 16
CFG = dict(vocab_size=128, dim=64, ffn_dim=128, num_experts=8, top_k=2, layers=2, heads=4)


def _rank_main(rank: int, world: int, port: int, nodes: int, style: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put(_step(rank, world, nodes, style))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _step(rank: int, world: int, nodes: int, style: str) -> dict:
    import moepass
    from moepass.runtime.grads import all_reduce_replicated_grads
    from samples.models import tiny_mixtral

    torch.manual_seed(0)
    model = tiny_mixtral(style=style, **CFG)
    cm = moepass.compile(model, moepass.Plan(form="ep", topology=moepass.Topology(nodes, world // nodes)))
    tokens = torch.randint(0, CFG["vocab_size"], (world * BATCH_PER_RANK, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    moepass.reset_comm_stats()
    logits = cm(mine[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
    loss.backward()
    stats = moepass.comm_stats()
    all_reduce_replicated_grads(cm)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= world
    # the reference: the original model on the concatenated batch, global mean loss (GShard's capacity
    # is per batch, and under EP per rank: its reference runs the model on each rank's slice)
    if style == "gshard":
        ref_logits = torch.cat([model(s[:, :-1]) for s in tokens.split(BATCH_PER_RANK)])
    else:
        ref_logits = model(tokens[:, :-1])
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, ref_logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    ref_mine = ref_logits[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    grad_err, grad_rel = 0.0, 0.0
    for g, want in _logical_grads(cm, ref_grads).values():
        grad_err = max(grad_err, (g - want).abs().max().item())
        grad_rel = max(grad_rel, ((g - want).abs() / (want.abs() + 1e-6)).max().item())
    return {
        "rank": rank, "stats": stats,
        "loss": (global_loss.item(), ref_loss.item()),
        "out_err": (logits - ref_mine).abs().max().item(),
        "grad_err": grad_err, "grad_rel": grad_rel,
        "ok": bool(torch.allclose(logits, ref_mine, rtol=1e-5, atol=1e-6)
                   and abs(global_loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
                   and grad_err <= 1e-6 + 1e-5 * max(g.abs().max().item() for g in ref_grads.values())),
    }


def _logical_grads(cm, ref_grads: dict) -> dict:
    """{original name: (this rank's gradient, the reference's matching rows)}."""
    import moepass

    return {name: (grad, ref_grads[name] if rows is None else ref_grads[name][rows])
            for name, (grad, rows) in moepass.logical_grads(cm).items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print(results: list[dict], nodes: int, world: int, style: str) -> None:
    print(f"moepass EP demo: tiny Mixtral-like LM ({style} experts, E={CFG['num_experts']} K={CFG['top_k']} "
          f"D={CFG['dim']}), {world} gloo ranks = {nodes} simulated nodes x {world // nodes}")
    ep_loss, ref_loss = results[0]["loss"]
    print(f"  loss   EP {ep_loss:.8f}   reference (1 process, whole batch) {ref_loss:.8f}   "
          f"|diff| {abs(ep_loss - ref_loss):.2e}")
    print(f"  max |output diff| {max(r['out_err'] for r in results):.2e}   max |grad diff| "
          f"{max(r['grad_err'] for r in results):.2e}")
    print("  bytes sent in one training step (forward + backward):")
    print(f"    {'rank':>4} {'kind':<13} {'intra-node':>11} {'inter-node':>11} {'self':>9}")
    for r in results:
        for kind in ("counts", "dispatch", "combine", "combine_bwd", "dispatch_bwd", "total"):
            s = r["stats"].get(kind)
            if s:
                print(f"    {r['rank']:>4} {kind:<13} {s['intra']:>11} {s['inter']:>11} {s['self']:>9}")
    intra = sum(r["stats"]["total"]["intra"] for r in results)
    inter = sum(r["stats"]["total"]["inter"] for r in results)
    print(f"  all ranks: {intra} B intra-node, {inter} B inter-node "
          f"({100 * inter / max(intra + inter, 1):.0f}% crosses nodes)")
    print("  parity: " + ("OK (fp32, rtol 1e-5)" if all(r["ok"] for r in results) else "MISMATCH"))


def main(argv: list[str] | None = None) -> int:
    from moepass.cli import positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] + " (spawns --world ranks on this machine)")
    parser.add_argument("--style", default="loop", choices=["loop", "fused", "gshard"])
    parser.add_argument("--world", type=positive_int, default=4, help="gloo ranks to spawn (default 4)")
    parser.add_argument("--nodes", type=positive_int, default=2, help="simulated nodes; must divide --world")
    args = parser.parse_args(argv)
    if args.world % args.nodes:
        parser.error(f"--nodes {args.nodes} does not divide --world {args.world}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    try:
        mp.start_processes(_rank_main, args=(args.world, port, args.nodes, args.style, results),
                           nprocs=args.world, start_method="spawn")
    except Exception as err:  # a rank failed: its traceback is printed by torch
        print(f"moepass EP demo failed: {err}", file=sys.stderr)
        return 1
    out = sorted((results.get() for _ in range(args.world)), key=lambda r: r["rank"])
    _print(out, args.nodes, args.world, args.style)
    return 0 if all(r["ok"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
