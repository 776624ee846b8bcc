"""`python -m moepass {demo, explain, search, calibrate, bench, selfcheck, train}` (the `moepass` console script is the same).

Bad input (a target that does not import, a builder that raises or returns no model, an invalid --form) ends
with one line on stderr naming what was wrong and the fix, and exit status 1 (argparse's own usage errors: 2);
`MOEPASS_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from moepass.envflags import flag
from moepass.errors import MoepassError, nearest
from moepass.plan import FORMS


def load_model(target: str, command: str) -> torch.nn.Module:
    """`pkg.module:callable` -> the model the callable returns (or the nn.Module the name holds), the module
    imported from the current directory first, as `python -m` imports (a console script's sys.path[0] is its
    own bin folder). SystemExit with one line naming what went wrong and the fix."""
    where = f"moepass {command}"
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"{where}: {target!r} is not of the form module:callable (e.g. samples.models:tiny_mixtral)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        _debug(err)
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            raise SystemExit(f"{where}: no module {module_name!r} in the current directory ({cwd}) or on "
                             f"PYTHONPATH: run from the folder that holds it, or add that folder to PYTHONPATH"
                             ) from None
        raise SystemExit(f"{where}: importing {module_name!r} raised ModuleNotFoundError: {err} (install it)"
                         ) from None
    except Exception as err:
        _debug(err)
        raise SystemExit(f"{where}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise SystemExit(f"{where}: module {module_name!r} has no {attr!r}.{nearest(attr, names)}")
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            obj = obj()
        except Exception as err:
            _debug(err)
            raise SystemExit(f"{where}: {target}() raised {type(err).__name__}: {err} (fix the builder; "
                             f"MOEPASS_DEBUG=1 shows the traceback)") from None
    if not isinstance(obj, torch.nn.Module):
        raise SystemExit(f"{where}: {target} gave a {type(obj).__name__}, not a torch.nn.Module: name a callable "
                         f"that returns the model (taking no arguments), or a module-level model")
    return obj


def _debug(err: BaseException) -> None:
    """Under MOEPASS_DEBUG=1 the error itself propagates, with its traceback (else the caller's one line)."""
    if flag("MOEPASS_DEBUG"):
        raise err


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

    plan = moepass.Plan(form=args.form)  # a misspelt form: PlanError naming the nearest (main prints it)
    print(moepass.explain(load_model(args.target, "explain"), plan))
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
        for label, ranked in search_scenario(args.scenario):
            print(f"\n== {label}")
            print(ranked.table(limit=args.limit))
        return 0
    if args.target is None:
        raise SystemExit("moepass search: give a model (module:callable) or --scenario FILE")
    result = moepass.search(load_model(args.target, "search"), (args.nodes, args.ranks_per_node), (args.batch, args.seq),
                            profile=args.profile)
    print(result.table(limit=args.limit))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from cost_model.calibrate import run

    return run(args)


def bench_module():
    """benchmarks.bench_all from the source checkout (benchmarks/ is not installed with the package)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "bench_all.py").exists():
        raise SystemExit(f"moepass bench: no benchmarks/ next to {root / 'moepass'}: run it from a source checkout")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.bench_all")


def bench_names(args: argparse.Namespace, known: list[str]) -> list[str]:
    """The benchmarks `bench` runs, in the registry's order; SystemExit naming the unknown ones and the choices."""
    if args.all and args.names:
        raise SystemExit(f"moepass bench: give --all or benchmark names, not both (got --all and {args.names})")
    if not args.all and not args.names:
        raise SystemExit(f"moepass bench: give --all or one or more of {', '.join(known)}")
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise SystemExit(f"moepass bench: unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    return known if args.all else [n for n in known if n in args.names]


def bench(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    runner = bench_module()
    names = bench_names(args, list(runner.BENCHMARKS))
    quick = not args.full
    out = Path(args.out).resolve() if args.out else (runner.QUICK_OUT if quick else runner.RESULTS)
    command = "python -m moepass " + shlex.join(["bench", *(["--all"] if args.all else names),
                                                 *(["--full"] if args.full else []),
                                                 *(["--out", args.out] if args.out else [])])
    with _Progress(len(names)) as progress:
        manifest = runner.run(names, out, quick, command, progress, progress.bar.refresh)
    from benchmarks.report import build

    written = build(out)
    failed = [b["name"] for b in manifest["benchmarks"] if b["status"] != "ok"]
    print(f"{len(names) - len(failed)}/{len(names)} benchmarks ok in {manifest['wall_s']:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; report: {written[0]} (+ {len(written) - 1} files)")
    return 1 if failed else 0


def train(args: argparse.Namespace) -> int:
    from samples.train import run

    return run(args)


def selfcheck(args: argparse.Namespace) -> int:
    from moepass.selfcheck import run

    try:
        return run(json_path=args.json, faults=tuple(args.fault))
    except ValueError as err:
        raise SystemExit(f"moepass {err}") from None


class _Progress:
    """A tqdm bar over the benchmarks (the one running, done / total, elapsed) and a line per finished one."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="benchmark", bar_format="bench {desc:<16} {bar} {n_fmt}/{total_fmt} "
                                                                  "[{elapsed}]", dynamic_ncols=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()

    def __call__(self, name: str, done: int, total: int, last: dict | None) -> None:
        if last is not None:
            load = f"load {last['before']['load'][0]:.2f} -> {last['after']['load'][0]:.2f}"
            self.bar.write(f"{last['name']}: {last['status']} in {last['wall_s']:.0f} s ({load})")
        self.bar.set_description_str(name or "done", refresh=False)
        self.bar.n = done
        self.bar.refresh()


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--form", default="single", help=f"the plan's form: {', '.join(FORMS)} (default single)")
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
    from cost_model.calibrate import add_arguments as calibrate_arguments

    p = sub.add_parser("calibrate", help="measure this machine (gloo all-to-all, matmul) into a JSON profile")
    calibrate_arguments(p)
    p.set_defaults(fn=calibrate)
    p = sub.add_parser("bench", help="run the benchmarks (each its own process) and write one report")
    p.add_argument("names", nargs="*", help="benchmarks to run (see benchmarks/bench_all.py); or --all")
    p.add_argument("--all", action="store_true", help="every benchmark")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer rounds/steps/sizes, still interleaved (default)")
    size.add_argument("--full", action="store_true", help="each benchmark's own default sizes")
    p.add_argument("--out", default=None,
                   help="folder for the JSONs, plots and report (default benchmarks/results/quick, "
                        "--full: benchmarks/results)")
    p.set_defaults(fn=bench)
    p = sub.add_parser("selfcheck", help="does moepass work on this machine? kernels, every form's training step "
                                         "and the collectives, as one table (exit status 1 if anything FAILs)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the table as JSON to PATH")
    p.add_argument("--fault", action="append", default=[], metavar="ITEM",
                   help="make ITEM (kernel:FAMILY or form:FORM) wrong on purpose, to see selfcheck report it")
    p.set_defaults(fn=selfcheck)
    from samples.train import add_arguments as train_arguments

    p = sub.add_parser("train", help="train the sample MoE LM on real text in any form (samples/train.py): "
                                     "checkpoints, resume, --reference, a JSON log and a loss curve")
    train_arguments(p).set_defaults(fn=train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except MoepassError as err:  # bad input (an invalid --form, a plan the model refuses): its one-line message
        _debug(err)
        raise SystemExit(f"moepass {args.command}: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
