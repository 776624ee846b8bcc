"""Recogniser: experts held as one module each (a ModuleList or ModuleDict), whatever calls them.

The expert function comes from one expert's graph (`moepass.detect.experts`), the router from the
block's (`moepass.detect.router`); the experts' weights are stacked per role in expert order. Experts
that are not a known FFN run as they are (`ExpertsSpec.kind="generic"`), their tensors stacked per name.
"""

from __future__ import annotations

from dataclasses import replace

from moepass.detect.candidates import Candidate, output_scales, shared_expert
from moepass.detect.experts import Role, read_expert, read_generic_expert
from moepass.detect.router import router_hypotheses
from moepass.spec import ROUTER_OUTPUT, ExpertsSpec, MoESpec, RouterSpec, TensorSource

NAME = "modulelist-loop"


def stacked_experts_spec(c: Candidate, keys: list[str]) -> ExpertsSpec | str:
    """Experts held as one module each (container entries `keys`), their weights stacked per expert."""
    shapes = [[(name, tuple(p.shape)) for name, p in c.experts.get_submodule(key).named_parameters()] for key in keys]
    other = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
    if other is not None:
        differ = next((f"{a[0]} {a[1]} vs {b[1]}" for a, b in zip(shapes[0], shapes[other]) if a != b),
                      f"{len(shapes[0])} vs {len(shapes[other])} tensors")
        return (f"its experts differ in shape (expert {keys[0]} and expert {keys[other]}: {differ}): moepass "
                f"stacks the experts of a block, which needs one shape for all")
    fn = read_expert(c.experts.get_submodule(keys[0]), c.hidden_dim)
    if isinstance(fn, str):
        return generic_experts_spec(c, keys, fn)
    prefix = f"{c.experts_path}." if c.experts_path else ""

    def stacked(role: Role | None, bias: bool = False) -> TensorSource | None:
        name = None if role is None else role.bias if bias else role.weight
        if role is None or name is None:
            return None
        # the rows of one expert's [out, in] weight are dim 1 of the stacked [E, out, in]
        return TensorSource.stack([f"{prefix}{key}.{name}" for key in keys], chunk=role.chunk,
                                  interleave=role.interleave, chunk_dim=1)

    w_gate, w_down = stacked(fn.gate), stacked(fn.down)
    assert w_gate is not None and w_down is not None
    return ExpertsSpec(
        num_experts=c.num_ffn_experts, hidden_dim=fn.hidden_dim, ffn_dim=fn.ffn_dim,
        activation=fn.activation,  # type: ignore[arg-type]
        w_gate=w_gate, w_up=stacked(fn.up), w_down=w_down,
        b_gate=stacked(fn.gate, bias=True), b_up=stacked(fn.up, bias=True), b_down=stacked(fn.down, bias=True),
        container=c.experts_path,
    )


def generic_experts_spec(c: Candidate, keys: list[str], not_ffn: str) -> ExpertsSpec | str:
    """Experts that are not a known FFN (`not_ffn` says why) run as they are: the first one as the template,
    each tensor stacked over the experts (`moepass.generic_experts`); or why they cannot."""
    generic = read_generic_expert([c.experts.get_submodule(k) for k in keys], c.hidden_dim)
    if isinstance(generic, str):
        return f"{not_ffn}; nor can they run as generic experts: {generic}"
    if len({name.replace(".", "_") for name in generic.tensors}) != len(generic.tensors):
        return f"{not_ffn}; nor can they run as generic experts: their tensor names {list(generic.tensors)} collide"
    prefix = f"{c.experts_path}." if c.experts_path else ""
    tensors = tuple((name, TensorSource.stack([f"{prefix}{key}.{name}" for key in keys])) for name in generic.tensors)
    return ExpertsSpec(num_experts=c.num_ffn_experts, hidden_dim=c.hidden_dim, ffn_dim=generic.ffn_dim,
                       activation="gelu", container=c.experts_path, kind="generic", template=f"{prefix}{keys[0]}",
                       template_class=generic.class_name, tensors=tensors)


def expert_variants(c: Candidate, experts: ExpertsSpec) -> list[ExpertsSpec]:
    """`experts` with what the block adds around the FFN experts, as hypotheses (the check decides):
    zero-compute experts when the router scores R > E experts (the R - E router ids after the FFN
    experts, or before them, all identity or all zero), and a per-expert output scale (`output_scales`)."""
    R, E = c.num_experts, experts.num_experts
    kinds: list[dict[str, tuple[int, ...]]] = [{}]
    if R > E:
        kinds = [{kind: ids} for ids in (tuple(range(E, R)), tuple(range(R - E)))
                 for kind in ("identity_experts", "zero_experts")]
    scales: list[TensorSource | None] = [TensorSource.param(p) for p in output_scales(c)] + [None]
    return [replace(experts, output_scale=scale, **kind) for scale in scales for kind in kinds]  # type: ignore[arg-type]


def block_specs(c: Candidate, name: str, experts: ExpertsSpec, routers: list[RouterSpec], **fields: object
                ) -> list[MoESpec] | str:
    """The MoESpecs of `routers` x `experts` (and its `expert_variants`), with the side outputs the block
    returns (router logits)."""
    read = tuple(c.side_outputs)  # what its outputs after the hidden states look like (`candidates.side_outputs`)
    side: tuple[str, ...] = read if read and not any(k.startswith("?") for k in read) else \
        ("router_logits",) if c.outputs == 2 else ()
    if len(side) + 1 < c.outputs:
        unknown = [k[1:] for k in read if k.startswith("?")]
        return f"the block returns {c.outputs} values; {', '.join(unknown) or 'some'} not reproduced"
    if "router_logits" in side and routers and routers[0].logits_from == "selection":
        return "the block returns router logits, but its router module returns a selection, not logits"
    if any(k.startswith(ROUTER_OUTPUT) for k in side):  # it returns what its router module returned: only the
        routers = [r for r in routers if r.logits_from in ("module", "selection")]  # routers calling it qualify
    fields.setdefault("shared", shared_expert(c))
    fields.setdefault("input_names", c.input_names)
    return [MoESpec(path=c.path, recogniser=name, router=r, experts=x, side_outputs=side, **fields)  # type: ignore[arg-type]
            for x in expert_variants(c, experts) for r in routers]


def recognise(c: Candidate) -> list[MoESpec] | str:
    if c.experts_kind not in ("modulelist", "moduledict") or c.router is None or c.graph is None:
        return "experts are not a ModuleList / ModuleDict"
    experts = stacked_experts_spec(c, list(c.expert_names))
    if isinstance(experts, str):
        return experts
    routers = router_hypotheses(c.graph, c.router)
    if isinstance(routers, str):
        return routers
    return block_specs(c, NAME, experts, routers)


