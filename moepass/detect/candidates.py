"""Candidates: modules that may be MoE blocks, from the module tree's structure alone; then their graph.

An *expert group* is E same-shaped things at any depth: a ModuleList / ModuleDict of identical modules
(each with linear layers), or >= 2 three-dimensional parameters of one module sharing a leading dim E.
The candidate block of a group is its nearest ancestor that also holds (at any depth, outside the
group) a two-dimensional [E, D] parameter: something that can score E experts; failing that at every
ancestor, an [O, D] one with E < O <= 2E (not an embedding): a router that also scores O - E
zero-compute experts (identity / zero), which `loop_experts.expert_variants` places as hypotheses. A module that says it
is an MoE block (a `moepass_spec(path)` method: `moepass.detect.self_described`) is a candidate too.
Nothing here reads a name: the names of the block's attributes are whatever the user chose.

`capture_candidate` then records the block's forward on a probe (`moepass.detect.capture`): the
selection over E scores found in that graph is what makes it an MoE block, and the router facts
(`moepass.detect.router`) come from it. Detection never edits the model: the graph is of a probe copy.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from moepass.detect.block_outputs import (  # noqa: F401  (re-exported)
    input_module,
    input_weighted,
    load_counter,
    output_bias,
    output_module,
    output_scales,
    shared_expert,
    side_outputs,
)
from moepass.detect.candidate import GRAPH, PROBE_TOKENS, SELF_DESCRIBED, SPEC_METHOD, Candidate, within  # noqa: F401
from moepass.detect.capture import (
    Selection,
    capture,
    downstream,
    expert_choice,
    selection,
    upstream,
    value,
)
from moepass.detect.check import probe_copy, token_ids
from moepass.detect.graph_candidates import GraphBlock, router_weight
from moepass.detect.router import read_router
from moepass.module_copy import module_aliases


@dataclass(frozen=True)
class _Group:
    path: str  # absolute path of the experts container (or of the module owning the 3-D weights)
    kind: str
    num_experts: int
    names: tuple[str, ...] = ()
    fused: tuple[tuple[str, tuple[int, ...]], ...] = ()
    flat: tuple[tuple[str, int], ...] = ()  # fused tensors stored [E·n, ...]: (name, n); `fused` holds [E, n, ...]


def _listed(path: str, module: nn.Module, holds_group: Callable[[str, nn.Module], bool]) -> _Group | None:
    """A ModuleList / ModuleDict of identical modules with >= 2 linears each (and no expert group inside:
    `holds_group(entry path, entry)`)."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 1:
        return None
    held = [(key, m) for key, m in module._modules.items() if m is not None]
    if len({type(m) for _, m in held}) > 1:  # entries holding no parameter (a dropout beside the experts) are no experts
        held = [(key, m) for key, m in held if next(m.parameters(), None) is not None]
    entries = [m for _, m in held]
    if not entries or len({type(m) for m in entries}) != 1 \
            or sum(isinstance(m, nn.Linear) for m in entries[0].modules()) < 2:
        return None
    if any(holds_group(f"{path}.{key}" if path else key, e) for key, e in held):
        return None  # e.g. a list of decoder layers, each holding an MoE block
    kind = "moduledict" if isinstance(module, nn.ModuleDict) else "modulelist"
    return _Group(path, kind, len(entries), tuple(key for key, _ in held))


def _reaches(module: nn.Module, ids: set[int]) -> bool:
    """Whether `module` or a module below it (what `module.modules()` yields) is one of `ids`."""
    seen: set[int] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if id(m) in ids:
            return True
        seen.add(id(m))
        todo.extend(c for c in m._modules.values() if c is not None and id(c) not in seen)
    return False


def _fused(path: str, own: list[tuple[str, nn.Parameter]]) -> _Group | None:
    """>= 2 three-dimensional parameters of one module (`own`: its `named_parameters(recurse=False)`)
    sharing a leading dim E."""
    params3 = {n: tuple(p.shape) for n, p in own if p.dim() == 3}
    if len(params3) >= 2 and len({s[0] for s in params3.values()}) == 1:
        return _Group(path, "fused", next(iter(params3.values()))[0], fused=tuple(params3.items()))
    return None


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`module.named_parameters(recurse=False)`, read from its parameter table (no generator per module)."""
    own = [(name, p) for name, p in module._parameters.items() if p is not None]
    if len(own) < 2 or len({id(p) for _, p in own}) == len(own):
        return own
    first: dict[int, tuple[str, nn.Parameter]] = {}  # one parameter under two names: the first name
    for name, p in own:
        first.setdefault(id(p), (name, p))
    return list(first.values())


def _describes_itself(module: nn.Module) -> bool:
    """`callable(getattr(module, SPEC_METHOD, None))`, without the failing attribute lookup (nn.Module's
    `__getattr__` raising) for a module whose class and instance dict do not hold the name."""
    cls: type[nn.Module] = type(module)
    if SPEC_METHOD not in vars(module) and SPEC_METHOD not in module._modules and not hasattr(cls, SPEC_METHOD) \
            and cls.__getattr__ is nn.Module.__getattr__ and cls.__getattribute__ is object.__getattribute__:
        return False  # parameters and buffers (the rest `__getattr__` finds) are tensors: never callable
    return callable(getattr(module, SPEC_METHOD, None))


class ModuleTree:
    """A model's modules (`named_modules()`: path -> module, in its order) and each one's own parameters,
    read in one walk that detection shares (a deep model has 10k modules: every further walk costs).

    When no module and no parameter is reachable twice (`plain`: N modules, N - 1 child links, each
    parameter held once), a module's `named_parameters` is its slice of this table, and the modules below
    it are the paths below its own; otherwise both are read from the module itself (`named_parameters`,
    its children), as torch walks them."""

    def __init__(self, model: nn.Module):
        self.modules = dict(model.named_modules())
        self.paths = list(self.modules)
        self.index = {path: i for i, path in enumerate(self.paths)}
        self.own: dict[str, list[tuple[str, nn.Parameter]]] = {}  # named_parameters(recurse=False)
        self.held: dict[str, list[tuple[str, nn.Parameter]]] = {}  # the same by model path (prefix=path)
        links = 0
        for path, m in self.modules.items():
            own = self.own[path] = _own_parameters(m)
            self.held[path] = [(f"{path}.{name}" if path else name, p) for name, p in own]
            links += len(m._modules) - list(m._modules.values()).count(None)
        ids = {id(p) for own in self.own.values() for _, p in own}
        self.plain = links == len(self.modules) - 1 and len(ids) == sum(map(len, self.own.values()))
        # modules reachable at several paths (one block shared by two layers): first path -> the others, and
        # each other path -> the first (a tree, N modules and N - 1 links, has none: not walked again)
        self.shared = module_aliases(model) if links != len(self.modules) - 1 else {}
        self.aliases = {other: first for first, others in self.shared.items() for other in others}

    def canonical(self, path: str) -> str:
        """The path `modules` knows a module by: an alias (a path through a shared module) mapped to the module's
        first path, the rest of the path kept."""
        if path in self.modules or not self.aliases:
            return path
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            head = ".".join(parts[:i])
            if head in self.aliases:
                return ".".join([self.aliases[head], *parts[i:]])
        return path

    def named_parameters(self, path: str) -> list[tuple[str, nn.Parameter]]:
        """`modules[path].named_parameters(prefix=path)`: the parameters below `path`, by their model paths."""
        if not self.plain:
            return list(self.modules[path].named_parameters(prefix=path))
        found = []
        for sub in self.paths[self.index[path]:]:  # the subtree: the paths that follow it while inside it
            if not within(sub, path):
                break
            found.extend(self.held[sub])
        return found

    def holds(self, paths: list[str]) -> Callable[[str, nn.Module], bool]:
        """`holds(path, module)`: whether `module` (at `path`) or a module below it is one of the modules at
        `paths` (plain: one of them lies at or below `path`)."""
        if self.plain:
            above = {".".join(parts[:i]) for parts in (p.split(".") for p in paths) for i in range(len(parts) + 1)}
            return lambda path, _module: path in above
        ids = {id(self.modules[p]) for p in paths}
        return lambda _path, module: _reaches(module, ids)


def _relative(path: str, root: str) -> str:
    return path if root == "" else path[len(root) + 1:] if path != root else ""


def _widths(group: _Group, modules: dict[str, nn.Module]) -> set[int]:
    """The widths D the experts of a group may take as input."""
    if group.kind == "fused":
        return {d for _, shape in group.fused for d in shape[1:]}
    container = modules[group.path]
    first = container.get_submodule(group.names[0])
    return {m.in_features for m in first.modules() if isinstance(m, nn.Linear)}


def _grouped(tree: ModuleTree, groups: list[_Group]) -> set[str]:
    """The paths of every parameter that belongs to an expert group."""
    found: set[str] = set()
    for g in groups:
        if g.kind == "fused":
            found.update(f"{g.path}.{name}" if g.path else name for name, _ in g.fused)
        else:
            found.update(name for name, _ in tree.named_parameters(g.path))
    return found


def _router_weight(block_path: str, tree: ModuleTree, group: _Group, grouped: set[str],
                   widths: set[int], wider: bool = False) -> tuple[str, int, int] | None:
    """(path relative to the block of the module holding an [O, D] weight outside every expert group, D, O):
    D one of the experts' input widths, O the group's E experts, or with `wider` E < O <= 2E (zero-compute
    experts beside the FFN experts; never an embedding table); a weight beside fused expert weights (e.g. an
    [E, F] bias) last."""
    E = group.num_experts
    block = tree.modules[block_path]
    found = []
    for full, p in tree.named_parameters(block_path):
        if p.dim() != 2:  # e.g. a learnable temperature (0-d), a bias
            continue
        name = _relative(full, block_path)
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        rows_fit = E < p.shape[0] <= 2 * E and not isinstance(block.get_submodule(owner), nn.Embedding) \
            if wider else p.shape[0] == E
        if rows_fit and p.shape[1] in widths and full not in grouped:
            beside = group.kind == "fused" and (f"{block_path}.{owner}" if block_path else owner).strip(".") == group.path
            found.append((beside, owner, int(p.shape[1]), int(p.shape[0])))
    return min(found, key=lambda f: f[0])[1:] if found else None


def expert_groups(tree: ModuleTree) -> list[_Group]:
    """Every expert group of the model (see the module doc), in module order."""
    modules = tree.modules
    fused = {path: _fused(path, tree.own[path]) for path in modules}
    containers = {path for path, m in modules.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
    holds_group = tree.holds([path for path in modules if path in containers or fused[path] is not None])
    return [g for path, m in modules.items()
            for g in (_listed(path, m, holds_group) if path in containers else None, fused[path]) if g is not None]


def find_candidates(model: nn.Module, tree: ModuleTree | None = None,
                    blocks: list[GraphBlock] | None = None) -> list[Candidate]:
    """Every module that looks like an MoE block (outermost first, not nested): from the structure, and
    from `blocks`, the ones the model's recorded forward shows (`graph_candidates`), which decide where a
    block is anchored and add those the structure does not see. `tree`: the model's, when the caller has
    read it already."""
    if tree is None:
        tree = ModuleTree(model)
    modules = tree.modules
    groups = expert_groups(tree)
    grouped = _grouped(tree, groups)
    found: dict[str, Candidate] = {}
    for path, module in modules.items():
        if _describes_itself(module):  # it says what it is (checked like any other)
            found[path] = Candidate(path, module, 0, router_path="", experts_path="", experts_kind=SELF_DESCRIBED)
    for group in groups:
        parts = group.path.split(".") if group.path else []
        # ancestors nearest first (the owner of fused weights may itself be the block); an [E, D] weight at any
        # of them before a wider one
        ancestors = [".".join(parts[:i]) for i in range(len(parts) - (group.kind != "fused"), -1, -1)]
        for block_path, wider in [(a, wider) for wider in (False, True) for a in ancestors]:
            router = _router_weight(block_path, tree, group, grouped, _widths(group, modules), wider)
            if router is None:
                continue
            if block_path not in found:
                found[block_path] = Candidate(
                    block_path, modules[block_path], router[2], router_path=router[0],
                    experts_path=_relative(group.path, block_path), experts_kind=group.kind,
                    fused_params=dict(group.fused), expert_names=group.names, hidden_dim=router[1],
                    ffn_experts=group.num_experts)
            break
    ordered = [found[p] for p in modules if p in found]
    structural = [c for c in ordered if not any(within(c.path, o.path) and o.path != c.path for o in ordered)]
    if not blocks:
        return structural
    return anchored(structural, blocks, tree, groups)


def anchored(structural: list[Candidate], blocks: list[GraphBlock], tree: ModuleTree,
             groups: list[_Group]) -> list[Candidate]:
    """The structural candidates, re-anchored where the recorded forward shows the block elsewhere: each
    graph block is a candidate at its own path (a structural candidate there gets its recorded call; one
    above or below it is replaced, its experts kept when they are among the block's expert tensors); a graph
    block whose experts match no structural group is a candidate of kind GRAPH, reported with what it reads.
    Structural candidates the forward did not reach stay as they are."""
    by_path = {c.path: c for c in structural}
    replaced: set[str] = set()
    found: dict[str, Candidate] = {}
    for block in blocks:
        path = tree.canonical(block.path)
        if path != block.path:  # a module shared by several paths, recorded at another one
            if path in found:
                continue
            block = replace(block, path=path)
        here = by_path.get(block.path)
        if here is not None:
            here.call, here.graph_block = block.call, block
            found[block.path] = here
            continue
        replaced.update(c.path for c in structural if within(c.path, block.path) or within(block.path, c.path))
        found[block.path] = _graph_candidate(block, tree, groups)
    for c in structural:
        if c.path not in found and c.path not in replaced:
            found[c.path] = c
    return [found[p] for p in tree.paths if p in found]


def _spread_group(block: GraphBlock, path: str) -> _Group | None:
    """A fused group the structure cannot see: >= 2 three-dimensional [E, ...] tensors the block reads per
    expert, held by different modules (one per expert role); anchored at the module holding them all."""
    E = block.num_experts
    held = [p for p in block.expert_params if len(block.shapes.get(p, ())) == 3 and block.shapes[p][0] == E
            and within(p, path)]
    owners = {p.rsplit(".", 1)[0] if "." in p else "" for p in held}
    if len(held) < 2 or len(owners) < 2:
        return None
    root = ".".join(os.path.commonprefix([o.split(".") for o in owners]))
    if not within(root, path):
        root = path
    return _Group(root, "fused", E, fused=tuple((_relative(p, root), block.shapes[p]) for p in held))


def _flat_group(block: GraphBlock, path: str) -> _Group | None:
    """A fused group stored flattened: >= 2 two-dimensional [E·n, X] tensors (n > 1) the block reads per expert
    (each viewed as [E, n, X] in its forward), anchored at the module holding them all; read as [E, n, X]."""
    E = block.num_experts
    held = [p for p in block.expert_params if within(p, path) and len(block.shapes.get(p, ())) == 2
            and block.shapes[p][0] % E == 0 and block.shapes[p][0] > E]
    if len(held) < 2 or len(held) != len(block.expert_params):
        return None
    owners = {p.rsplit(".", 1)[0] if "." in p else "" for p in held}
    root = ".".join(os.path.commonprefix([o.split(".") for o in owners]))
    if not within(root, path):
        root = path
    n = {p: block.shapes[p][0] // E for p in held}
    return _Group(root, "fused", E, fused=tuple((_relative(p, root), (E, n[p], block.shapes[p][1])) for p in held),
                  flat=tuple((_relative(p, root), n[p]) for p in held))


def _graph_candidate(block: GraphBlock, tree: ModuleTree, groups: list[_Group]) -> Candidate:
    """The candidate at a graph block's path: its experts the structural group inside it whose tensors it reads
    per expert (most of them), its router the module holding the weight its scores read."""
    path, E = block.path, block.num_experts
    read = set(block.expert_params)
    inside = [(len(read & {n for n, _ in tree.named_parameters(g.path)}), g) for g in groups
              if within(g.path, path) and g.path != path or g.kind == "fused" and g.path == path]
    inside = [(n, g) for n, g in inside if n]
    weight = router_weight(block)
    router_path = _relative(weight.rsplit(".", 1)[0] if "." in weight else "", path) if weight else ""
    shape = block.shapes.get(weight, ()) if weight else ()
    call_x = block.call.args[0] if block.call is not None and block.call.args else None
    width = int(shape[1] if len(shape) == 2 and shape[0] == E else shape[0] if len(shape) == 2 else 0) or (
        int(call_x.shape[-1]) if isinstance(call_x, torch.Tensor) and call_x.dim() else 0)
    module = tree.modules[path]
    spread = _spread_group(block, path) or (None if inside else _flat_group(block, path))
    if not inside and spread is None:
        return Candidate(path, module, E, router_path=router_path, experts_path="", experts_kind=GRAPH,
                         hidden_dim=width, call=block.call, graph_block=block)
    group = max(inside, key=lambda ng: ng[0])[1] if inside else spread
    assert group is not None
    return Candidate(path, module, E, router_path=router_path, experts_path=_relative(group.path, path),
                     experts_kind=group.kind, fused_params=dict(group.fused), flattened=dict(group.flat),
                     expert_names=group.names, hidden_dim=width, ffn_experts=group.num_experts, call=block.call,
                     graph_block=block)


def further_inputs(block: nn.Module) -> tuple[str, ...]:
    """The names of the block's required positional inputs after the hidden states (e.g. the token ids a
    hash router is keyed by): probed with token ids (`check.token_ids`)."""
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(p.name for p in positional[1:] if p.default is p.empty)


def recorded_arguments(c: Candidate) -> tuple[tuple[str, ...], list[Any], tuple[int, ...]] | str | None:
    """The block's inputs as the model called it (`Candidate.call`), when it passed more than the hidden
    states: (every positional name in the block's signature up to the last one given, their values as
    given or defaulted, the hidden states' shape); None when it passed the hidden states alone (or its call
    was not recorded); or why the call cannot be reproduced (keyword-only or `**kwargs` arguments)."""
    call = c.call
    if call is None or len(call.args) + len(call.kwargs) <= 1:
        return None
    try:
        signature = inspect.signature(c.module.forward)
        params, bound = list(signature.parameters.values()), signature.bind(*call.args, **call.kwargs)
    except (TypeError, ValueError) as err:
        return f"its recorded call does not match its forward's signature: {err}"
    if not params or not isinstance(bound.arguments.get(params[0].name), torch.Tensor):
        return None  # the hidden states (its first parameter, given by position or by name) are not a tensor
    given = [p for p in params if p.name in bound.arguments]
    extra = [p.name for p in given if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if extra:
        return (f"the model passes it {extra} (keyword-only, *args or **kwargs), which moepass cannot pass through "
                f"yet: pass them positionally, or leave the block alone with Plan(blocks={{{c.path!r}: None}})")
    last = max(params.index(p) for p in given)
    names, values = [], []
    for p in params[:last + 1]:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.name not in bound.arguments and p.default is p.empty:
            return f"its recorded call lacks {p.name!r}"
        names.append(p.name)
        values.append(bound.arguments.get(p.name, p.default))
    names[0] = "hidden_states"
    return tuple(names), values, tuple(values[0].shape)


MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.einsum)
ATTENTION = (torch.nn.functional.scaled_dot_product_attention,)


def _token_mixing(c: Candidate, probe: nn.Module) -> str | None:
    """Why the candidate is no MoE FFN block, when its recorded call (`Candidate.call`, keywords included), replayed
    on the probe, shows the selection driving work that mixes tokens: an attention (scaled dot-product, or a
    product of two activations giving [..., S, S] scores over the S positions) downstream of the selection. Its
    experts are then not functions of one token (a mixture of attention experts: per-expert projections around an
    attention), which no MoESpec describes: the block is left as it is. None when not so, or not probed."""
    call = c.call
    if call is None:
        return None
    try:  # state objects it would update (a cache the model passed) are left at their defaults: not replayed
        signature = inspect.signature(c.module.forward)
        bound = signature.bind(*call.args, **call.kwargs)
        for name, param in signature.parameters.items():
            if name in bound.arguments and param.default is not param.empty and not _plain(bound.arguments[name]):
                bound.arguments[name] = param.default
        args = tree_map(probe_value, tuple(bound.args))
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 3:  # [..., S, D] hidden states
            return None
        kwargs = tree_map(probe_value, dict(bound.kwargs))
        cap = capture(probe, *args, kwargs=kwargs)
    except Exception:  # noqa: BLE001  (not probed: the kwargs reason stands)
        return None
    found = selection(cap, c.num_experts)
    return None if found is None else mixes_tokens(c, found, args[0].shape[-2])


def mixes_tokens(c: Candidate, found: Selection, S: int) -> str | None:
    """Why the block is no MoE FFN block when its selection (`found`, in its probe graph) drives an attention over
    its S positions (`_token_mixing`); else None."""
    for node in downstream(found.node):
        val = value(node)
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            continue
        activations = [a for a in node.all_input_nodes if a.op != "get_attr" and isinstance(value(a), torch.Tensor)
                       and not all(u.op == "get_attr" for u in upstream(a) if u.op in ("get_attr", "placeholder"))]
        scores = node.target in MATMULS and len(activations) >= 2 and val.dim() >= 2 and val.shape[-2:] == (S, S)
        if node.target in ATTENTION or scores:
            return (f"a mixture of attention experts: the selection over E={c.num_experts} scores drives per-expert "
                    f"projections around an attention ({getattr(node.target, '__name__', node.target)} giving "
                    f"{list(val.shape)} over the {S} positions), so its experts are not functions of one token and "
                    f"no MoESpec describes it: not an MoE FFN block; left as it is (moepass rewrites token-wise "
                    f"experts)")
    return None


def _plain(value: Any) -> bool:
    """Tensors, constants and tuples / lists / dicts of them (not a state object such as a cache)."""
    if isinstance(value, (tuple, list)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(map(_plain, value.values()))
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device))


def probe_value(value: Any) -> Any:
    """A recorded argument as the fp32 probe takes it: tensors detached and cloned (floating ones in fp32)."""
    if isinstance(value, torch.Tensor):  # on the CPU, as the probe copy is
        value = value.detach().to("cpu", copy=True)
        return value.float() if value.is_floating_point() else value
    return value


def capture_candidate(c: Candidate, seed: int = 0) -> str | None:
    """Record the candidate's forward on a probe copy and read its selection and router; the reason it is
    not an MoE block (no selection over its E experts) or None. A block the model called with more than its
    hidden states is probed with those arguments (`recorded_arguments`); the ones its selection does not read
    are passed through as recorded (`Candidate.passthrough`)."""
    probe = probe_copy(c.module, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    recorded = recorded_arguments(c)
    if isinstance(recorded, str):
        mixing = _token_mixing(c, probe)  # probed as the model called it, keywords included: what it is
        if mixing is not None:
            c.left_alone = True
            return mixing
        return recorded
    if recorded is None:  # the probe's shape when one is set (an outlined block called on [T, D] tokens)
        x = torch.randn(*(c.probe_shape or (*PROBE_TOKENS, c.hidden_dim)), generator=gen)
        c.input_names = ("hidden_states", *further_inputs(c.module))
        extras: list[Any] = [token_ids(probe, PROBE_TOKENS, gen) for _ in c.input_names[1:]]
    else:
        c.input_names, values, shape = recorded
        x = torch.randn(*shape, generator=gen)  # the hidden states as the model passed them
        extras = [probe_value(v) for v in values[1:]]
    try:
        c.graph = capture(probe, x, *extras, names=c.input_names)
    except Exception as err:  # the user's block fails on probe inputs: reject, never raise
        return f"probing the block failed: {type(err).__name__}: {err}"
    c.selection = selection(c.graph, c.num_experts)
    # else the selection the model's recorded forward showed (over its own E), or one over the expert group's E
    # alone (the router scores more than the group: a shared expert scored beside them, a sink)
    others = [n for n in (c.graph_block.num_experts if c.graph_block is not None else 0, c.ffn_experts)
              if n and n != c.num_experts]
    for other in others if c.selection is None else []:
        c.selection = selection(c.graph, other)
        if c.selection is not None:
            c.num_experts = other
            break
    if c.selection is None:
        chosen = expert_choice(c.graph, c.num_experts)
        if chosen is not None:
            c.left_alone = True
            return (f"expert-choice routing: each of its E={c.num_experts} experts picks its top-{chosen} tokens (a "
                    f"top-k over the tokens of [E, T] scores); moepass rewrites token-choice blocks (each token "
                    f"picks its experts), so this block runs as it is")
        return f"no top-k / argmax over E={c.num_experts} scores in the block's graph: not an MoE selection"
    mixing = mixes_tokens(c, c.selection, x.shape[-2]) if x.dim() >= 3 else None
    if mixing is not None:  # attention experts: no MoE FFN block
        c.left_alone = True
        return mixing
    if recorded is not None:  # what the selection reads is a further input (token ids); the rest passes through
        read = {n.target for n in upstream(c.selection.node) if n.op == "placeholder"}
        # a floating input (a state the previous layer computed) is passed as recorded too, read or not: only
        # token ids can be drawn afresh
        c.passthrough = {name: v for name, v in zip(c.input_names[1:], extras) if name not in read
                         or isinstance(v, torch.Tensor) and v.is_floating_point()}
    if c.passthrough:
        c.probe_shape = tuple(x.shape)
    c.router = read_router(c.graph, c.selection, c.num_experts)
    if c.router.weight is not None:  # the graph says which [E, D] weight scores the experts
        c.router_path = c.router.weight.rsplit(".", 1)[0] if "." in c.router.weight else ""
    out = c.graph.output
    c.outputs = len(out) if isinstance(out, tuple) else 1
    first = out[0] if isinstance(out, tuple) and out else out
    c.flat_output = isinstance(first, torch.Tensor) and x.dim() > 2 and tuple(first.shape) == (
        math.prod(x.shape[:-1]), x.shape[-1])
    c.input_weighted = input_weighted(c)
    c.load_counter = load_counter(probe, (x, *extras), c.num_experts, c.selection.k)
    c.output_bias = output_bias(c)
    c.output_module = output_module(c)
    c.input_module = input_module(c)
    c.side_outputs = side_outputs(c)
    return None


def find_dense_mlps(model: nn.Module, moe_paths: list[str], tree: ModuleTree | None = None) -> list[str]:
    """Modules shaped like a dense FFN outside any MoE block: 2 or 3 linear children D -> F (-> F) and
    F -> D (F != D; gate and up may be one D -> 2F linear), beside parameter-free ones (activation, dropout).
    `tree`: the model's, when the caller has read it already."""
    dense: list[str] = []
    if "" in moe_paths:
        return dense
    blocks, inside = set(moe_paths), tuple(p + "." for p in moe_paths)
    for path, module in (ModuleTree(model) if tree is None else tree).modules.items():
        if path in blocks or path.startswith(inside) or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(module.children())
        linears = [c for c in children if isinstance(c, nn.Linear)]
        if not 2 <= len(linears) <= 3 or any(next(c.parameters(), None) is not None for c in children
                                             if not isinstance(c, nn.Linear)):
            continue
        for out in linears:  # the down projection F -> D, declared anywhere (torchtitan: w1, w2, w3)
            ins = [i for i in linears if i is not out]
            D, F = out.out_features, out.in_features
            widths = sorted(i.out_features for i in ins)
            if F != D and all(i.in_features == D for i in ins) and widths in ([F], [2 * F], [F, F]):
                dense.append(path)
                break
    return dense


