"""`python -m moepass {demo, explain, search, calibrate}`."""

from __future__ import annotations

import argparse
import importlib
import sys

import torch


def _load(target: str):
    """`pkg.module:callable` → the object the callable returns (a model)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise SystemExit(f"moepass: {target!r} is not of the form module:callable (e.g. samples.models:tiny_mixtral)")
    obj = getattr(importlib.import_module(module_name), attr)
    return obj() if callable(obj) and not isinstance(obj, torch.nn.Module) else obj


def demo(args: argparse.Namespace) -> int:
    from samples.demo import run

    status = run(style=args.style, steps=args.steps, show_graph=not args.no_graph)
    if args.no_ep:
        return status
    from samples.demo_ep import main as demo_ep

    print("\n== expert parallel: 4 gloo ranks as 2 simulated nodes x 2 ==")
    return status or demo_ep(["--style", "loop" if args.style == "mixed" else args.style])


def explain(args: argparse.Namespace) -> int:
    import moepass

    print(moepass.explain(_load(args.target), moepass.Plan(form=args.form)))
    return 0


def search(args: argparse.Namespace) -> int:
    import moepass

    if args.scenario:
        from cost_model.scenarios import cases
        from cost_model.search import search_scenario

        read = cases(args.scenario)
        print(f"scenario {read.scenario.get('name', args.scenario)}: hardware {read.hardware.name}")
        for figure, source in read.filled.items():
            print(f"  filled {figure}: {source}")
        for assumption in read.assumptions:
            print(f"  assumed: {assumption}")
        for label, result in search_scenario(args.scenario):
            print(f"\n== {label}")
            print(result.table(limit=args.limit))
        return 0
    if args.target is None:
        raise SystemExit("moepass search: give a model (module:callable) or --scenario FILE")
    result = moepass.search(_load(args.target), (args.nodes, args.ranks_per_node), (args.batch, args.seq),
                            profile=args.profile)
    print(result.table(limit=args.limit))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from cost_model.calibrate import main as calibrate_main

    return calibrate_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moepass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="detect, compile and check parity on the built-in sample model")
    p.add_argument("--style", default="mixed", choices=["loop", "fused", "gshard", "mixed"])
    p.add_argument("--steps", type=int, default=3, help="training steps compared against the original")
    p.add_argument("--no-graph", action="store_true", help="do not print the rewritten graph")
    p.add_argument("--no-ep", action="store_true", help="skip the 4-rank expert-parallel part")
    p.set_defaults(fn=demo)
    p = sub.add_parser("explain", help="report what moepass would do to a model")
    p.add_argument("target", help="module:callable returning an nn.Module, e.g. samples.models:tiny_mixtral")
    p.add_argument("--form", default="single")
    p.set_defaults(fn=explain)
    p = sub.add_parser("search", help="rank plans with the cost model")
    p.add_argument("target", nargs="?", help="module:callable returning an nn.Module")
    p.add_argument("--scenario", help="a published set-up (e.g. ../shared/scenarios/lina_priority.json)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--profile", default=None, help="a100 | h100 | ascend910a | a calibration JSON (default: this machine)")
    p.add_argument("--limit", type=int, default=12)
    p.set_defaults(fn=search)
    p = sub.add_parser("calibrate", help="measure this machine (gloo all-to-all, matmul) into a JSON profile")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for cost_model.calibrate")
    p.set_defaults(fn=calibrate)
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
