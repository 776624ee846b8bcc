"""The layers of the first-party packages, bottom to top: the one table `docs/ARCHITECTURE.md` draws and
`tests/test_layers.py` enforces.

A module may import modules of its own layer (without a cycle) and of the layers its layer `uses`; nothing
else, counting every import: at module level, inside functions and under `TYPE_CHECKING`. An entry names
one module (`moepass.plan`) or a package and everything under it (`moepass.runtime.*`); an exact name wins
over a package, a longer package over a shorter one. Every module of `PACKAGES` is in exactly one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

PACKAGES = ("moepass", "lowering", "cost_model")


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # module names, or "pkg.*": the package and every module under it
    uses: tuple[str, ...]  # the layers below that its modules may import
    holds: str  # one line: what the layer is


LAYERS = (
    Layer("core",
          ("moepass.errors", "moepass.spec", "moepass.activations", "moepass.envflags", "moepass.plan", "moepass.plan_options",
           "moepass.dialect", "moepass.eager", "moepass.grouped_ffn", "moepass.ffn_autograd", "moepass.generic_experts",
           "moepass.module_copy", "moepass.block_state", "moepass.row_ops", "moepass.process_state",
           "moepass.dialect_ffn", "moepass.nn.*", "moepass.layers", "moepass.operands", "cost_model.presets"),
          (),
          "plain data and the dialect: block specs, Plan, errors, hardware figures, the moe:: op schemas with "
          "their torch references, the expert FFN, moepass's own blocks; no torch.distributed call"),
    Layer("lowering", ("lowering.*",), ("core",),
          "Triton kernel families for dialect ops, each with its eligibility and torch fallback"),
    Layer("cost", ("cost_model.*",), ("core",),
          "cost formulas (sympy / numbers), the scenario files, the timeline"),
    Layer("runtime", ("moepass.runtime.*", "moepass.determinism"), ("core", "cost"),
          "what the rewritten graphs call at run time: process groups, collectives, expert layouts, the FSEP "
          "placement controller and its planner (priced by the cost formulas), the HP and locality ops, the "
          "priority scheduler, the deterministic-mode scope, the single form's choice of the faster of graph and "
          "block"),
    Layer("passes",
          ("moepass.detect.*", "moepass.canonical", "moepass.passes", "moepass.pipeline", "moepass.agreement",
           "moepass.rewrite.*",
           "moepass.schedule", "moepass.lower", "moepass.verify"),
          ("core", "lowering", "cost", "runtime"),
          "detection, the canonical graph, each form's rewrite, the schedule and lower passes, the pipeline, the "
          "ranks' agreement on what to rewrite"),
    Layer("face",
          ("moepass", "moepass.__main__", "moepass.api", "moepass.backend.*", "moepass.cli", "moepass.inspect",
           "moepass.selfcheck.*", "moepass.train.*", "moepass.fsdp", "moepass.checkpoint", "cost_model.search",
           "cost_model.search_forms", "cost_model.search_result", "cost_model.systems", "cost_model.model_cases",
           "cost_model.system_plans", "cost_model.scenario_search",
           "cost_model.simulate", "cost_model.calibrate", "cost_model.__main__"),
          ("core", "lowering", "cost", "runtime", "passes"),
          "what users call: compile / explain / detect, the torch.compile backend, checkpoints, the CLI, "
          "selfcheck, the plan search and the simulator"),
)

BY_NAME = {layer.name: layer for layer in LAYERS}


def _specificity(entry: str, module: str) -> int:
    """How closely `entry` matches `module`: -1 not at all; an exact name beats any package."""
    if entry == module:
        return 10_000
    if entry.endswith(".*"):
        package = entry[:-2]
        if module == package or module.startswith(package + "."):
            return len(package)
    return -1


def layer_of(module: str) -> Layer | None:
    """The layer of a first-party module (None: the table does not place it)."""
    best, best_score = None, -1
    for layer in LAYERS:
        for entry in layer.modules:
            score = _specificity(entry, module)
            if score > best_score:
                best, best_score = layer, score
    return best


def may_import(importer: str, imported: str) -> bool:
    """Whether `importer` may import `imported` (both placed by the table)."""
    a, b = layer_of(importer), layer_of(imported)
    assert a is not None and b is not None, (importer, imported)
    return a.name == b.name or b.name in a.uses


def markdown() -> str:
    """The table as docs/ARCHITECTURE.md shows it (a test keeps the two equal)."""
    rows = ["| layer | modules | may import | holds |", "|---|---|---|---|"]
    for layer in LAYERS:
        modules = ", ".join(f"`{m}`" for m in layer.modules)
        rows.append(f"| {layer.name} | {modules} | {', '.join(layer.uses) or '—'} | {layer.holds} |")
    return "\n".join(rows) + "\n"
