"""`python -m moepass {demo, explain, search, calibrate, bench, selfcheck, train}` (the `moepass` console script is the same).

Bad input (a target that does not import, a builder that raises or returns no model, an invalid --form) ends
with one line on stderr naming what was wrong and the fix, and exit status 1 (argparse's own usage errors: 2);
`MOEPASS_DEBUG=1` shows the traceback instead. Numbers are checked by the options' `type=` validators
(`positive_int`, ...) and output paths before the work starts (`check_output_folder`, `check_output_file`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# moepass's sibling packages, imported from where moepass itself was loaded (a source checkout or
# site-packages) before anything puts the current directory on sys.path: a user's samples.py or lowering.py
# there cannot shadow them (`python -m moepass` puts the current directory first on sys.path).
OWN_PACKAGES = ("cost_model", "lowering", "samples")
OWN_ROOT = str(Path(__file__).resolve().parents[1])


def import_own_packages() -> None:
    """Import OWN_PACKAGES from OWN_ROOT (a submodule such as samples.train then resolves inside them)."""
    sys.path.insert(0, OWN_ROOT)
    try:
        for name in OWN_PACKAGES:
            importlib.import_module(name)
    finally:
        sys.path.remove(OWN_ROOT)


import_own_packages()

import torch  # noqa: E402

from moepass.envflags import FLAGS, flag, parse  # noqa: E402
from moepass.errors import MoepassError, nearest  # noqa: E402
from moepass.plan import FORMS  # noqa: E402

# ---- option validators (argparse `type=`) and output checks, shared by every subcommand -------------------


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """An option's value as an int >= 1 (argparse `type=`)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use a whole number >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An option's value as an int >= 0 (argparse `type=`)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use a whole number >= 0")
    return value


def positive_float(text: str) -> float:
    """An option's value as a finite float > 0 (argparse `type=`)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use a number > 0")
    return value


def nonnegative_float(text: str) -> float:
    """An option's value as a finite float >= 0 (argparse `type=`)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use a number >= 0")
    return value


def _number(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use a finite number")
    return value


def form_name(text: str) -> str:
    """--form's value: one of moepass.plan.FORMS (a wrong case or a typo: the nearest one suggested)."""
    if text not in FORMS:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: use one of {', '.join(FORMS)}."
                                         f"{nearest(text.lower(), FORMS)}")
    return text


def profile_choice(text: str) -> str | Path:
    """search --profile: a preset name, or a calibration profile file (returned as a Path)."""
    from cost_model.presets import PRESET_NAMES

    if text in PRESET_NAMES:
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: give a calibration profile file "
                                         f"(`moepass calibrate --out FILE` writes one) or a preset")
    if os.path.isfile(text):
        return Path(text)
    if text.endswith(".json") or os.sep in text:
        raise argparse.ArgumentTypeError(f"no file {text!r}: give an existing calibration profile "
                                         f"(`moepass calibrate --out FILE` writes one) or a preset")
    raise argparse.ArgumentTypeError(f"{text!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a calibration "
                                     f"profile file.{nearest(text.lower(), PRESET_NAMES)}")


def check_output_folder(path: str | os.PathLike[str], where: str) -> None:
    """Create folder `path` (and its parents) now and check it is writable; SystemExit with one line naming
    `where` (e.g. "moepass train: --out") otherwise. Called before the work that writes there starts."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        _debug(err)
        raise SystemExit(f"{where} {os.fspath(path)}: cannot create the folder ({err.strerror}): choose a "
                         f"writable folder") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SystemExit(f"{where} {os.fspath(path)}: the folder is not writable: choose a writable folder")


def check_output_file(path: str | os.PathLike[str], where: str) -> None:
    """File `path` can be written later: its folder created now and writable, and `path` not a folder."""
    if os.path.isdir(path):
        raise SystemExit(f"{where} {os.fspath(path)}: is a folder: give a file path")
    check_output_folder(os.path.dirname(os.path.abspath(path)), f"{where} {os.fspath(path)}: its folder")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr (the error and where to read the usage),
    exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def check_environment() -> None:
    """Every boolean MOEPASS_* flag that is set parses (a typo such as MOEPASS_DEBUG=maybe: one line)."""
    for name in FLAGS:
        try:
            parse(name, os.environ.get(name))
        except ValueError as err:
            raise SystemExit(f"moepass: {err}") from None


def load_model(target: str, command: str) -> torch.nn.Module:
    """`pkg.module:callable` -> the model the callable returns (or the nn.Module the name holds), the module
    imported from the current directory first, as `python -m` imports (a console script's sys.path[0] is its
    own bin folder). SystemExit with one line naming what went wrong and the fix."""
    where = f"moepass {command}"
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"{where}: {target!r} is not of the form module:callable (e.g. samples.models:tiny_mixtral)")
    path_hint = module_path_hint(module_name, attr)
    if path_hint:
        raise SystemExit(f"{where}: {target!r} names a file, not a module: {path_hint}")
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
        names = [n for n, v in vars(module).items() if not n.startswith("_") and (
            isinstance(v, torch.nn.Module) or callable(v) and getattr(v, "__module__", None) == module.__name__)]
        hint = nearest(attr, names) or (f" It defines {', '.join(sorted(names))}." if names else
                                        " It defines no callable or nn.Module.")
        raise SystemExit(f"{where}: module {module_name!r} has no {attr!r}.{hint}")
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


def module_path_hint(module_name: str, attr: str) -> str:
    """For a target written as a file path (`mymodels.py:build`, `./pkg/m.py:build`, `pkg/m:build`): how to
    name it as a module instead; "" for a dotted module name."""
    if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name
            or module_name.startswith(".")):
        return ""
    path = module_name[:-3] if module_name.endswith(".py") else module_name
    if os.path.isabs(path):
        folder, name = os.path.split(path)
        return f"run from {folder} (or add it to PYTHONPATH) and give {name}:{attr}"
    parts = [part for part in path.replace(os.sep, "/").split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        return "give the dotted module name (pkg.module:callable) from the folder that holds the package"
    return f"give the dotted module name, {'.'.join(parts)}:{attr}, from the folder that holds it"


def _debug(err: BaseException) -> None:
    """Under MOEPASS_DEBUG=1 the error itself propagates, with its traceback (else the caller's one line)."""
    if flag("MOEPASS_DEBUG"):
        raise err


def demo(args: argparse.Namespace) -> int:  # the EP part: 4 gloo ranks (samples/demo_ep.py)
    from samples.demo import run

    status = run(style=args.style, steps=args.steps, show_graph=not args.no_graph)
    if args.no_ep:
        return status
    from samples.demo_ep import main as demo_ep

    print("\n== expert parallel: 4 gloo ranks as 2 simulated nodes x 2 ==")
    return status or demo_ep(["--style", "loop" if args.style == "mixed" else args.style])


def explain(args: argparse.Namespace) -> int:
    import moepass

    given = {"ep_size": args.ep_size, "mu": args.mu, "batch": tuple(args.batch) if args.batch else None}
    if args.form == "locality" and args.mu is None:
        raise SystemExit("moepass explain: --form locality needs --mu M (the locality loss weight, >= 0; 0: a "
                         "plain top-1 switch router)")
    if args.form == "auto" and args.batch is None:
        raise SystemExit("moepass explain: --form auto needs --batch BATCH SEQ (tokens per rank the cost model "
                         "prices)")
    # an option the form does not use: PlanError naming it and the form (main prints it)
    plan = moepass.Plan(form=args.form, **{k: v for k, v in given.items() if v is not None})
    print(moepass.explain(load_model(args.target, "explain"), plan))
    return 0


def search(args: argparse.Namespace) -> int:
    import moepass

    if args.scenario:
        from cost_model.scenarios import cases
        from cost_model.search import search_scenario

        if not os.path.isfile(args.scenario):
            raise SystemExit(f"moepass search: --scenario {args.scenario}: no such file: give a scenario JSON "
                             f"(e.g. ../shared/scenarios/lina_priority.json from the repository root)")
        try:
            read = cases(args.scenario)
        except (ValueError, KeyError) as err:  # json.JSONDecodeError is a ValueError
            _debug(err)
            raise SystemExit(f"moepass search: --scenario {args.scenario}: not a valid scenario: "
                             f"{type(err).__name__}: {err}") from None
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
    model = load_model(args.target, "search")
    try:
        result = moepass.search(model, (args.nodes, args.ranks_per_node), (args.batch, args.seq),
                                profile=args.profile)
    except (ValueError, FileNotFoundError) as err:  # e.g. a model with no MoE blocks, a bad profile file
        _debug(err)
        raise SystemExit(f"moepass search: {args.target}: {err} (`moepass explain {args.target}` shows what "
                         f"detection found)") from None
    print(result.table(limit=args.limit))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from cost_model.calibrate import run

    check_output_file(args.out, "moepass calibrate: --out")
    return run(args)


def bench_module():
    """benchmarks.bench_all from the source checkout (benchmarks/ is not installed with the package)."""
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

    runner = bench_module()
    names = bench_names(args, list(runner.BENCHMARKS))
    quick = not args.full
    out = Path(args.out).resolve() if args.out else (runner.QUICK_OUT if quick else runner.RESULTS)
    check_output_folder(out, "moepass bench: --out" if args.out else "moepass bench: its default output folder")
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

    if args.json:
        check_output_file(args.json, "moepass selfcheck: --json")
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
    parser = OneLineParser(prog="moepass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="detect, compile and check parity on the built-in sample model, then expert "
                                    "parallel on 4 spawned gloo ranks (--no-ep skips them)",
                       description="The sample model detected, compiled and trained beside the original (one "
                                   "process), then its expert-parallel form on 4 gloo ranks this command spawns "
                                   "on this machine (2 simulated nodes x 2; --no-ep skips that part).")
    p.add_argument("--style", default="mixed", choices=["loop", "fused", "gshard", "mixed"])
    p.add_argument("--steps", type=positive_int, default=3, help="training steps compared against the original")
    p.add_argument("--no-graph", action="store_true", help="do not print the rewritten graph")
    p.add_argument("--no-ep", action="store_true", help="skip the 4-rank expert-parallel part")
    p.set_defaults(fn=demo)
    p = sub.add_parser("explain", help="report what moepass would do to a model")
    p.add_argument("target", help="module:callable returning an nn.Module, e.g. samples.models:tiny_mixtral")
    p.add_argument("--form", default="single", type=form_name,
                   help=f"the plan's form: {', '.join(FORMS)} (default single)")
    p.add_argument("--ep-size", type=positive_int, default=None,
                   help="Plan.ep_size for ep/fsep/locality: the graphs built on a fake world of that size "
                        "(default 1: no process group)")
    p.add_argument("--batch", type=positive_int, nargs=2, metavar=("BATCH", "SEQ"), default=None,
                   help="Plan.batch, tokens per rank the cost model prices (--form auto needs it)")
    p.add_argument("--mu", type=nonnegative_float, default=None,
                   help="Plan.mu, the locality loss weight (--form locality needs it)")
    p.set_defaults(fn=explain)
    p = sub.add_parser("search", help="rank plans with the cost model")
    p.add_argument("target", nargs="?", help="module:callable returning an nn.Module")
    p.add_argument("--scenario", help="a published set-up (e.g. ../shared/scenarios/lina_priority.json, relative "
                                      "to the repository root)")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--ranks-per-node", type=positive_int, default=8)
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=positive_int, default=4096)
    p.add_argument("--profile", type=profile_choice, default=None,
                   help="a100 | h100 | ascend910a | this-machine | a calibration JSON (default: this machine)")
    p.add_argument("--limit", type=positive_int, default=12, help="rows of the table shown")
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
                   help="folder for the JSONs, plots and report (default: inside the source checkout, "
                        "benchmarks/results/quick, --full: benchmarks/results)")
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
    check_environment()
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except MoepassError as err:  # bad input (an invalid --form, a plan the model refuses): its one-line message
        _debug(err)
        raise SystemExit(f"moepass {args.command}: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
