"""The whole Hub: every MoE family of the installed transformers, built tiny, detected and compiled under
`Plan(form="single")`; writes docs/HF_FAMILIES.md (and benchmarks/results/hf_hub.json).

    python benchmarks/hf_hub.py [--only mixtral qwen2_moe ...] [--no-write]

Families and how each is built: `samples/hf_hub.py` (its module doc gives the rule). For each family the
row says whether it built, the MoE blocks one forward shows (modules computing a top-k / argmax / max
over E router scores, counted under a TorchFunctionMode), what detection reported for them (accepted,
rejected, or no report line at all), and the verdict: exact under single (eval output, train loss and
every parameter gradient equal to the original's in fp32, rtol 1e-5 / atol 1e-6), rejected (detection's
reason), not reported, mismatch, crash. `CAUSES` holds what reading each non-exact family's code found
(the cause and the way out); it is keyed by family and checked against the verdict computed here, so a
stale entry shows up as such in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from samples import hf_hub as H  # noqa: E402

# family -> (verdict it was read under, cause, way out): what reading the family's code found
CAUSES: dict[str, tuple[str, str, str]] = {
    "muse_spark_text": ("rejected", "its router module's own selection could be read as it is (the logits it returns are "
                        "scaled by `output_multiplier`, which only the logits-module recognisers need); what no "
                        "MoESpec describes is around and inside the experts: they run at `moe_hidden_size` (16) "
                        "behind a projection and a norm the block applies to the tokens first (`pre_expert_proj`, "
                        "`pre_expert_norm`), a projection after the combine (`post_expert_proj`), and a norm on each "
                        "expert's output before its weight (`has_post_expert_norm`), so the fused layouts are read at "
                        "the block's width 32 and fail",
                        "MoESpec fields for a module chain before the experts and after the combine, and a per-expert "
                        "output norm in ExpertsSpec (the distributed forms would refuse it with a PlanError at first); "
                        "not done here"),
    "ernie4_5_vl_moe_text": ("rejected", "the MoE layer sends text and vision tokens to two expert sets "
                             "(`text_moe`, `vision_moe`) by token type; the candidate is the text set alone, whose "
                             "forward returns the tokens flattened to 1-D",
                             "a spec for modality-split experts (token-type dispatch); out of scope of the single "
                             "rewrite"),
    "dots3_note_text": ("not built", "a heterogeneous per-layer config: the model reads `kv_lora_rank` globally, "
                        "which the per-layer config refuses (AmbiguousGlobalPerLayerAttributeError)",
                        "shrink `per_layer_config` layer by layer (not done here)"),
    "dots3_note_vision_encoder": ("not built", "a vision encoder (MoE inside a vision tower): needs pixel values and "
                                  "grid sizes, and its per-layer config is keyed by layers 25-41",
                                  "a vision probe; out of scope of the text-token probes"),
    "longcat_flash": ("not built", "its latent attention splits the key / value projection into widths the shrunk "
                      "config does not produce (8 vs 8 + 8); not pursued", "a consistent tiny MLA config"),
    "qwen3_omni_moe_talker_text": ("not built", "the talker's model has no `embed_tokens` (it does not take text `input_ids` "
                                   "as built here)",
                                   "build it through the omni model; its MoE is Qwen3-MoE's (covered)"),
    "qwen4_exp_text": ("not built", "its sparse-attention indexer (QSA) needs fields the default config leaves unset "
                       "(`indexer_budget`, `indexer_compress_ratio`, `indexer_n_heads`, ...)", "a complete tiny QSA config"),
    "vitpose_backbone": ("not built", "no model class takes its config (a backbone); its `num_experts` linears are "
                         "picked by a dataset index passed in (`indices == i`), not by a router", "not a routed MoE"),
    "doge": ("no top-k routing", "product-key expert retrieval (PEER-style): the router scores 2 x floor(sqrt(E)) "
             "sub-keys, takes a top-k over each half, then a top-k over the k x k sums; each expert is one neuron "
             "(a row of the [E, D] `down_embed` and `up_embed` tables), not an FFN. No selection runs over E expert "
             "scores (with E = 6 only 4 ids are reachable), so it is no MoE block by moepass's definition",
             "not a top-k routed MoE (a product-key memory layer): left as it is"),
}


def run(only: list[str] | None = None) -> list[H.Outcome]:
    outcomes = []
    for family in H.moe_families():
        if only and family.model_type not in only:
            continue
        if family.covered_by is not None:
            outcomes.append(H.Outcome(family))
            continue
        start = time.perf_counter()
        out = H.evaluate(family)
        print(f"{family.model_type:28s} {out.verdict:20s} {time.perf_counter() - start:5.1f} s", flush=True)
        outcomes.append(out)
    return outcomes


def _cell(text: str, limit: int = 400) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _reason(out: H.Outcome) -> tuple[str, str]:
    """(cause, way out) for a non-exact row: CAUSES when its verdict still holds, else what detection said."""
    known = CAUSES.get(out.family.model_type)
    if known is not None and known[0] == out.verdict:
        return known[1], known[2]
    if out.verdict == "not built":
        return out.why_not_built, "a tiny config this family accepts (see samples/hf_hub.py OVERRIDES)"
    if out.crash:
        return out.crash, ""
    if out.not_reported:
        return f"no report line covers {out.not_reported}", ""
    if out.rejected:
        path, reason = next(iter(out.rejected.items()))
        closest = [part for part in reason.split("; ") if "closest" in part]
        return f"{path}: {(closest or [reason])[0]}", "not analysed yet"
    if out.parity:
        return out.parity, ""
    if not out.routed:
        return "one forward computes no top-k / argmax / max over E scores", "not a top-k routed MoE"
    return "", ""


def markdown(outcomes: list[H.Outcome]) -> str:
    own = [o for o in outcomes if o.family.covered_by is None]
    built = [o for o in own if o.built]
    exact = [o for o in built if o.verdict == "exact under single"]
    alone = [o for o in exact if o.left_alone]
    counts: dict[str, int] = {}
    for o in own:
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    import transformers

    lines = [
        "# Hugging Face MoE families under moepass",
        "",
        f"transformers {transformers.__version__}: {len(outcomes)} model types declare experts, "
        f"{len(own)} of them their own MoE blocks ({len(outcomes) - len(own)} composite wrappers are covered by "
        f"their text model type). **Built {len(built)}, exact under single {len(exact)}, "
        f"{len(exact)}/{len(built)} = {100 * len(exact) / max(len(built), 1):.0f} %.** "
        + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ". "
        f"Blocks in the built families: {sum(o.expected for o in built)} routed, "
        f"{sum(len(o.accepted) for o in built)} accepted, {sum(len(o.rejected) for o in built)} rejected, "
        f"{sum(len(o.left_alone) for o in built)} left alone (no MoE FFN block: attention experts), "
        f"{sum(len(o.not_reported) for o in built)} not reported. "
        f"{len(alone)} of the exact families leave such blocks as they are ({', '.join(o.family.model_type for o in alone)}"
        f"): every MoE FFN block rewritten and exact, the attention-expert blocks not rewritten (their reason column "
        f"says so).",
        "",
        "Generated by `python benchmarks/hf_hub.py` (families and tiny configs: `samples/hf_hub.py`; the exact "
        "ones are asserted by `tests/test_hf_hub.py`). A model type is listed when its config class, built with "
        "its defaults, has a field counting experts (`num_experts`, `num_local_experts`, `n_routed_experts`, "
        "`moe_num_experts`), itself or in a sub-config. Each family is built from its config with random "
        "weights, fp32, eager attention and eager experts, dropout off, E = 6 experts, k = 2, width 32, "
        "2 layers. Detection runs as `moepass.detect(model)` (its forward recorded on synthesized token ids); a "
        "model whose forward cannot run on those alone (an encoder-decoder needs decoder ids) is detected on its own "
        "batch, `moepass.detect(model, example_inputs=batch)`. "
        "*Expected*: the modules one forward shows computing a top-k / argmax / max over E router scores. "
        "*Detected*: accepted / rejected report lines covering them; *not reported*: routed modules no "
        "report line covers; *left alone*: blocks detection reports as no MoE FFN block (their selection drives an "
        "attention: attention experts), not rewritten. *Exact under single*: `moepass.compile(model, Plan(form=\"single\"))` gives the "
        "original's eval output, train loss and every parameter gradient (rtol 1e-5, atol 1e-6); an expert no token "
        "reaches keeps `grad=None` under a per-expert loop and gets an exact zero gradient after the rewrite (batched, "
        "as transformers' own batched expert kernels and every EP form compute it): parity takes the two as equal "
        "(an optimizer with weight decay or momentum then steps such an expert after the rewrite, not before).",
        "",
        "| family | built | model class | expected | detected (acc / rej / not rep. [/ left alone]) | verdict | reason "
        "| way out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in own:
        cause, way = ("", "") if o.verdict == "exact under single" else _reason(o)
        if o.verdict == "exact under single" and o.left_alone:
            path, why = next(iter(o.left_alone.items()))
            cause = (f"its MoE FFN blocks are rewritten and exact; {len(o.left_alone)} block(s) left as they are, "
                     f"not rewritten: {path}: {why}")
            way = "attention experts are out of scope of an MoE-block rewrite (token-wise experts)"
        counted = f"{len(o.accepted)} / {len(o.rejected)} / {len(o.not_reported)}" + (
            f" / {len(o.left_alone)}" if o.left_alone else "")
        lines.append(
            f"| {o.family.model_type} | {'yes' if o.built else 'no'} | {o.model_class} | "
            f"{o.expected if o.built else ''} | "
            f"{counted if o.built else ''} | "
            f"{o.verdict} | {_cell(cause)} | {_cell(way)} |")
    lines += ["", "Composite configs whose experts live in another model type's config (covered by that row):", ""]
    lines += [f"- {o.family.model_type} ({o.family.expert_field}) → {o.family.covered_by}"
              for o in outcomes if o.family.covered_by is not None]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    torch.set_num_threads(1)  # tiny models: one thread is faster, and far faster on shared cores
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    outcomes = run(args.only)
    text = markdown(outcomes)
    if args.no_write or args.only:
        print(text)
        return 0
    (ROOT / "docs" / "HF_FAMILIES.md").write_text(text)
    rows = [dict(family=o.family.model_type, covered_by=o.family.covered_by, built=o.built, verdict=o.verdict,
                 model_class=o.model_class, expected=sorted(o.routed), accepted=o.accepted, rejected=o.rejected,
                 not_reported=o.not_reported, why_not_built=o.why_not_built, crash=o.crash, parity=o.parity,
                 seconds=round(o.seconds, 2)) for o in outcomes]
    (ROOT / "benchmarks" / "results" / "hf_hub.json").write_text(
        json.dumps(dict(seconds=round(time.perf_counter() - start, 1), rows=rows), indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
