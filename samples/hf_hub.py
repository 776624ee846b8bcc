"""Every Mixture-of-Experts family of the installed transformers, built tiny from its config (random
weights, fp32, no download); shared by `tests/test_hf_hub.py` and `benchmarks/hf_hub.py`.

Which model types are MoE (`moe_families`): a model type is an MoE family when its own config class,
built with its defaults, has an integer field that counts experts (`EXPERT_COUNT`: `num_experts`,
`num_local_experts`, `n_routed_experts`, `moe_num_experts`) or a sub-config holding one. A composite
config (vision / audio + text) whose experts live only in a sub-config of another model type is
folded into that type (`Family.covered_by`): its MoE blocks are that type's, and its extra towers are
what a tiny build of the wrapper would add. Whether a family really *routes* is not read from the
config: `count_routed` runs one forward and counts the modules that compute a top-k (or argmax, or max)
over E router scores.

How a config is made tiny (`tiny_config`): every field is shrunk by its name (`SHRINK`: widths 32,
4 heads of 8, 2 layers, E = 6 experts, k = 2, vocab 64, LoRA ranks 16 ...) and the shrunk fields are
passed to the config class, so that what it derives from them follows; lists indexed by layer are cut
to the layer count, keeping an MoE layer and (in a hybrid stack) an attention layer; token ids beyond
the vocabulary are moved inside it; dropout is off (train-mode parity is compared). `OVERRIDES` adds
what a family needs beyond the rule, each with its reason (a field the default config leaves unset, a
width that must agree with another). Attention is `eager`, experts `eager` (the per-expert loop: every
family's reference path).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 64, 9, 2
# E differs from every other width a top-k or max may run over (4 heads, head_dim 8, SEQ, SEQ + 1 with an
# attention sink), so a selection over E scores is routing
E, K, LAYERS = 6, 2, 2

# the fields of the roles `Widths` can set: expert count, experts per token, model width, expert hidden width,
# dense / shared-expert hidden width
EXPERTS = r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts)$"
TOP_K = r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k_experts)$"
EXPERT_COUNT = re.compile(EXPERTS)
HIDDEN = r"^(hidden_size|d_model|n_embd|router_hidden_size)$"
EXPERT_FFN = r"(moe_intermediate_size|expert_ffn_hidden_size|moe_hidden_size|share_expert_dim)$"
FFN = r"(intermediate_size|ffn_hidden_size|^d_ff$|_ffn_dim$|intermediate_size_mlp)$"

# field name -> tiny value, first match wins (an int field only; lists indexed by layer are cut separately)
SHRINK: list[tuple[str, Any]] = [
    (EXPERTS, E),
    (TOP_K, K),
    (r"^(n_group|num_expert_group)$", 2),
    (r"^topk_group$", 1),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^(first_k_dense_replace|num_dense_layers|moe_layer_start_index|expert_layer_offset)$", 1),
    (r"^(decoder_sparse_step|moe_layer_interval|expert_layer_period|interleave_moe_layer_step|moe_layer_freq)$", 1),
    (r"^(num_hidden_layers|num_layers|n_layers|decoder_layers|encoder_layers|num_decoder_layers)$", LAYERS),
    (r"^(num_sparse_encoder_layers|num_sparse_decoder_layers)$", 1),
    (r"^encoder_sparse_step$", 2),
    (r"^(vocab_size|unpadded_vocab_size)$", VOCAB),
    (HIDDEN, 32),
    (r"(num_attention_heads|num_heads|_attention_heads|n_heads)$", 4),
    (r"(num_key_value_heads|num_kv_heads)$", 2),
    (r"(^|_)head_dim$|^d_kv$|^kv_channels$", 8),
    (r"^(qk_rope_head_dim|qk_nope_head_dim|v_head_dim|rotary_dim)$", 8),
    (r"^qk_head_dim$", 16),
    (r"lora_rank$", 16),
    (EXPERT_FFN, 16),
    (r"shared_expert[s]?_intermediate_size$|^shared_intermediate_size$", 24),
    (FFN, 48),
    (r"^(max_position_embeddings|model_max_length)$", 64),
    (r"^(sliding_window|sliding_window_size|attention_chunk_size)$", 16),
    (r"^(index_topk|index_n_heads)$", 4),
    (r"^num_nextn_predict_layers$", 0),
    (r"^(linear_num_key_heads|linear_num_value_heads|linear_num_heads|mamba_n_heads|mamba_num_heads)$", 4),
    (r"^(linear_key_head_dim|linear_value_head_dim|linear_head_dim|mamba_d_head|mamba_head_dim)$", 8),
    (r"^(mamba_d_state|ssm_state_size)$", 8),
    (r"^expert_capacity$", 8),
    (r"^(num_kv_shared_layers)$", 0),
    (r"^(vocab_size_per_layer_input|ngram_vocab_size_base)$", VOCAB),
    (r"^(hidden_size_per_layer_input|ple_embed_dim)$", 8),
    (r"^zero_expert_num$", 2),
    (r"^index_kpool$", 2),
    (r"^(mamba_n_groups|n_groups)$", 1),
]
# fields whose None means "use the default" or "no MoE" (not "off"): a tiny value turns them on
FILL_NONE = re.compile(EXPERT_COUNT.pattern[:-2] + r"|num_experts_per_tok|top_k_experts|moe_intermediate_size|n_shared_experts)$")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "eod_token_id", "sep_token_id")

# model type -> config fields a tiny build needs beyond `SHRINK` (each with its reason)
OVERRIDES: dict[str, dict[str, Any]] = {
    "switch_transformers": dict(num_layers=2, num_decoder_layers=2, encoder_sparse_step=2, decoder_sparse_step=2,
                                dropout_rate=0.0),  # experts' dropout: a train-mode difference not rewritten
    # moe_token_dropout: a dropout on each expert's output (train mode), off like every dropout here
    "nllb-moe": dict(encoder_sparse_step=2, decoder_sparse_step=2, dropout=0.0, activation_dropout=0.0,
                     attention_dropout=0.0, expert_capacity=8, moe_token_dropout=0.0),
    "jamba": dict(expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0),
    # the default config leaves rope_theta unset and clip_qkv None, which its attention clamps with
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    "hunyuan_v1_moe": dict(head_dim=8),  # None by default, and the attention raises it to a power
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # None by default, indexed by layer
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),  # None by default, indexed by layer
    "gemma4_text": dict(enable_moe_block=True),  # MoE is off by default
    "unlimited_ocr_text": dict(num_key_value_heads=4),  # its attention does not repeat key / value heads
    "step3p5": dict(sliding_window=16),  # required, unset by default
    # heads x head width = mamba_expand x hidden; the default stack is all Mamba, and the cache needs an attention layer
    "granitemoehybrid": dict(mamba_n_heads=8, layer_types=["linear_attention", "full_attention"]),
    "mistral4": dict(head_dim=16),  # its rope covers head_dim x partial_rotary_factor 0.5 = qk_rope_head_dim
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=24),  # read by the model, not declared
    "qwen4_exp_text": dict(indexer_budget=8, indexer_compress_ratio=2),  # None by default, divided
    # multimodal rope sections must sum to the rotary half-width (4 at head_dim 8)
    "ernie4_5_vl_moe_text": dict(rope_parameters=dict(rope_theta=500000.0, rope_type="default", mrope_section=[1, 1, 2])),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_theta=10000.0, rope_type="default", partial_rotary_factor=1.0,
                                                mrope_section=[2, 1, 1])),
}


@dataclass(frozen=True)
class Family:
    """One MoE model type: its config class, the MoE field that made it one, and how it builds."""

    model_type: str
    config_class: str
    expert_field: str  # the field (dotted through a sub-config) counting experts
    covered_by: str | None = None  # a model type whose config holds the experts (a composite wrapper)


def _expert_field(config: Any, prefix: str = "") -> str | None:
    import transformers

    for name, val in vars(config).items():
        if EXPERT_COUNT.match(name) and (val is None or isinstance(val, int)):
            return prefix + name
    for name, val in vars(config).items():
        if isinstance(val, transformers.PretrainedConfig):
            found = _expert_field(val, f"{prefix}{name}.")
            if found:
                return found
    return None


@functools.cache
def moe_families() -> tuple[Family, ...]:
    """Every model type of the installed transformers whose config declares an expert count (module doc).
    Cached: it builds every config class once with its defaults (seconds)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found: list[Family] = []
    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        try:
            config = getattr(transformers, class_name)()
        except Exception:  # noqa: BLE001  (a config that cannot build with defaults: not enumerable here)
            continue
        where = _expert_field(config)
        if where is None:
            continue
        covered_by = None
        if "." in where:  # experts in a sub-config: covered by that sub-config's own model type, if it has one
            sub = config
            for part in where.split(".")[:-1]:
                sub = getattr(sub, part)
            if sub.model_type in CONFIG_MAPPING_NAMES and sub.model_type != model_type:
                covered_by = sub.model_type
        found.append(Family(model_type, class_name, where, covered_by))
    return tuple(found)


@dataclass(frozen=True)
class Widths:
    """The MoE block's sizes to build a family at instead of the tiny ones (`tiny_config(widths=...)`): model
    width D, expert hidden width F, experts E, experts per token K — each applied to the fields the SHRINK
    table gives that role, where the config has them (the rest of the model stays tiny)."""

    D: int | None
    F: int | None
    E: int | None
    K: int | None  # None: that role keeps its tiny value

    def roles(self) -> dict[str, int]:
        """SHRINK pattern -> this size, for the given roles' patterns (set exactly, not capped by the default)."""
        roles = {EXPERTS: self.E, TOP_K: self.K, HIDDEN: self.D, EXPERT_FFN: self.F, FFN: self.F}
        return {pattern: size for pattern, size in roles.items() if size is not None}


def tiny_config(family: Family, widths: Widths | None = None) -> Any:
    """The family's config made tiny (module doc): the shrunk fields are passed to the config class, so
    that what it derives from them (per-layer lists) follows; lists it keeps at the old length are cut.
    `widths`: the MoE block at these sizes instead (the rest of the model tiny)."""
    import transformers

    cls = getattr(transformers, family.config_class)
    default = cls()
    before = getattr(default, "num_hidden_layers", None)
    fields = {**_shrunk(default, widths.roles() if widths is not None else {}),
              **{k: v for k, v in OVERRIDES.get(family.model_type, {}).items() if "." not in k}}
    config = cls(**fields)
    for name, val in fields.items():  # a class that ignores a keyword it does not declare
        setattr(config, name, val)
    for name, val in OVERRIDES.get(family.model_type, {}).items():
        if "." in name:
            owner, attr = name.rsplit(".", 1)
            setattr(config.get_text_config() if owner == "text" else getattr(config, owner), attr, val)
    _fit_layers(config, before, default)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def _shrunk(config: Any, roles: dict[str, int]) -> dict[str, Any]:
    """The tiny values of the config's fields (sub-configs shrunk in place and passed as they are); a field
    whose SHRINK pattern is in `roles` takes that value exactly."""
    import transformers

    fields: dict[str, Any] = {}
    for name, val in vars(config).items():
        if name.startswith("_") or isinstance(val, bool):
            continue
        if isinstance(val, transformers.PretrainedConfig):
            for sub_name, sub_val in _shrunk(val, roles).items():
                setattr(val, sub_name, sub_val)
            fields[name] = val
            continue
        if not isinstance(val, int) and not (val is None and FILL_NONE.match(name)):
            continue
        for pattern, tiny in SHRINK:
            if re.search(pattern, name):
                exact = val is None or tiny == 0 or EXPERT_COUNT.match(name)  # else 0 (off) stays 0
                fields[name] = roles[pattern] if pattern in roles else tiny if exact else min(val, tiny)
                break
    for name, val in vars(config).items():  # train-mode parity is checked with dropout off
        if re.search(r"dropout|pdrop", name) and isinstance(val, float) and val > 0:
            fields[name] = 0.0
    if getattr(config, "kv_lora_rank", None):  # latent attention: one key / value head per query head
        fields["num_key_value_heads"] = fields.get("num_attention_heads", 4)
    if isinstance(getattr(config, "mlp_only_layers", None), list):
        fields["mlp_only_layers"] = []
    vocab = fields.get("vocab_size", VOCAB)
    for name in TOKEN_IDS:
        val = getattr(config, name, None)
        if isinstance(val, int) and val >= vocab:
            fields[name] = min(vocab - 1, TOKEN_IDS.index(name))
        elif isinstance(val, list):
            fields[name] = [v if v < vocab else vocab - 1 for v in val]
    return fields


def _fit_layers(config: Any, before: int | None, default: Any) -> None:
    """Cut lists indexed by layer (still `before` long) to the layer count; a `*layer_types` list keeps
    the default's most common kind (the MoE MLP of `mlp_layer_types`) and, in a hybrid stack, one
    attention layer (the cache needs one): the last layers take them."""
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        return
    for name, val in list(vars(config).items()):
        if isinstance(val, list) and before and len(val) == before and len(val) != n:
            setattr(config, name, val[:n])
    for name, val in list(vars(config).items()):
        full = vars(default).get(name)
        if not name.endswith("layer_types") or not isinstance(val, list) or len(val) != n or not isinstance(full, list):
            continue
        kinds = [v for v in full if isinstance(v, str)]
        wanted = [max(kinds, key=kinds.count)] if kinds else []
        wanted += [v for v in kinds if "attention" in v and "linear" not in v][:1]
        if "mlp" in name:
            wanted += [v for v in kinds if "moe" in v or "sparse" in v][-1:]
        val = list(val)
        for i, kind in enumerate(k for k in dict.fromkeys(wanted) if k not in val):
            val[-1 - i] = kind
        setattr(config, name, val)


def model_class(family: Family) -> Any:
    """The class a family is built as: the auto mapping's causal LM, else seq2seq LM, else bare model; a
    config no auto mapping lists (a text part of a composite model): the class of its modeling module
    whose `config_class` it is, a ...ForCausalLM first."""
    import importlib

    import transformers
    from transformers.models.auto import modeling_auto as A

    for mapping in (A.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, A.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                    A.MODEL_MAPPING_NAMES):
        name = mapping.get(family.model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name:
            return getattr(transformers, name)
    config_class = getattr(transformers, family.config_class)
    package = config_class.__module__.rsplit(".", 1)[0]
    modeling = importlib.import_module(f"{package}.modeling_{package.rsplit('.', 1)[1]}")
    owned = [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, nn.Module)
             and getattr(c, "config_class", None) is config_class and "Pretrained" not in c.__name__
             and "PreTrained" not in c.__name__]
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "Model"):
        found = [c for c in owned if c.__name__.endswith(suffix)]
        if found:
            return found[0]
    raise ValueError(f"no model class of {package} takes {family.config_class}")


def build(family: Family, seed: int = 0, widths: Widths | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny random-init model of `family` (fp32, train mode) and one batch (input ids, labels when the
    model takes them, decoder ids for an encoder-decoder); `widths`: its MoE block at those sizes."""
    import inspect

    config = tiny_config(family, widths)
    cls = model_class(family)
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32)
    model.float().train()
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", VOCAB)
    ids = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ), generator=gen)
    batch = {"input_ids": ids}
    params = inspect.signature(model.forward).parameters
    if "labels" in params and cls.__name__.endswith(("ForCausalLM", "ForConditionalGeneration")):
        batch["labels"] = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ), generator=gen)
    if getattr(config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ), generator=gen)
    return model, batch


def output_of(out: Any) -> torch.Tensor:
    """The tensor parity is checked on: the logits, else the last hidden state."""
    for name in ("logits", "last_hidden_state"):
        val = getattr(out, name, None)
        if isinstance(val, torch.Tensor):
            return val
    return out[0] if isinstance(out, tuple) else out


def loss_of(out: Any) -> torch.Tensor:
    """The training loss: the model's own when it computes one, else the mean square of its output."""
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else output_of(out).float().square().mean()


class _Selections(TorchFunctionMode):
    """Records the module path of every top-k / argmax / max over a last dim of `widths`."""

    def __init__(self, widths: set[int], where: Callable[[], str]):
        super().__init__()
        self.widths, self.where, self.paths = widths, where, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk, torch.argmax, torch.Tensor.argmax, torch.max, torch.Tensor.max) \
                and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1 \
                and args[0].is_floating_point() and args[0].shape[-1] in self.widths:
            dim = args[2] if func in (torch.topk, torch.Tensor.topk) and len(args) > 2 else \
                args[1] if func not in (torch.topk, torch.Tensor.topk) and len(args) > 1 else \
                kwargs.get("dim", -1 if func in (torch.topk, torch.Tensor.topk) else None)
            if dim in (-1, args[0].dim() - 1):
                self.paths.setdefault(self.where(), func.__name__)
        return func(*args, **kwargs)


def count_routed(model: nn.Module, batch: dict[str, torch.Tensor], experts: int = E) -> dict[str, str]:
    """The MoE blocks one eval forward shows: module path -> the selection call, for every module (its
    innermost one) that calls a top-k / argmax / max over the last dim of E scores (or E + 1: a skip
    expert, or E + the config's zero-compute experts)."""
    stack: list[str] = []
    names = {id(m): p for p, m in model.named_modules()}
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda mod, _a: stack.append(names[id(mod)]) and None))
        handles.append(m.register_forward_hook(lambda _m, _a, _o: stack.pop() and None))
    config = getattr(model, "config", None)
    zero = getattr(config, "zero_expert_num", None) or 0
    mode = _Selections({experts, experts + 1, experts + zero}, lambda: stack[-1] if stack else "")
    was = model.training
    try:
        model.eval()
        with torch.no_grad(), mode:
            model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return mode.paths


# --- what moepass makes of a family ------------------------------------------------------------------------

RTOL, ATOL = 1e-5, 1e-6


@dataclass
class Outcome:
    """A family's row: built or not (and why), the MoE blocks one forward shows (`count_routed`), what
    detection reported for them, and the single-form parity of the compiled model."""

    family: Family
    built: bool = False
    why_not_built: str = ""
    model_class: str = ""
    routed: dict[str, str] = field(default_factory=dict)  # selecting module -> its call
    accepted: list[str] = field(default_factory=list)  # block paths covering a routed module
    rejected: dict[str, str] = field(default_factory=dict)  # block path -> reason
    not_reported: list[str] = field(default_factory=list)  # routed modules no report line covers
    # block path -> reason: rejected by design, no MoE FFN block (`BlockReport.left_alone`: attention experts); left as
    # it is, which keeps the model exact, and named in the table's reason column (not counted as a rejection)
    left_alone: dict[str, str] = field(default_factory=dict)
    crash: str = ""  # detect or compile raised
    parity: str = ""  # "" exact; else what differed
    seconds: float = 0.0

    @property
    def expected(self) -> int:
        return len(self.routed)

    @property
    def verdict(self) -> str:
        if not self.built:
            return "not built"
        if self.crash:
            return "crash"
        if not self.routed:
            return "no top-k routing"
        if self.not_reported:
            return "not reported"
        if self.rejected:
            return "rejected"
        if self.parity:
            return "mismatch"
        return "exact under single"


def _block_of(path: str, blocks: list[str]) -> str | None:
    """The block (one of `blocks`) that holds the module at `path`, if any."""
    inside = [b for b in blocks if b == "" or path == b or path.startswith(b + ".")]
    return max(inside, key=len) if inside else None


def _step(model: nn.Module, batch: dict[str, torch.Tensor], router_logits: bool) -> Any:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = model(**batch, output_router_logits=True) if router_logits else model(**batch)
    loss_of(out).backward()
    return out


# An expert no token reaches: a per-expert loop never calls it, so its parameters keep `grad=None`; the rewrite
# computes every expert's gradient batched (as transformers' own batched expert kernels do, and as every EP form
# must: another rank's tokens may reach it), so they get an exact zero. Both say "no gradient signal"; parity
# takes None against an all-zero gradient as equal (an optimizer with weight decay or momentum steps such an
# expert after the rewrite and not before: the table's header says so).
UNROUTED = "None in the original, zero after the rewrite"


def parity(model: nn.Module, compiled: nn.Module, batch: dict[str, torch.Tensor]) -> str:
    """What differs between the compiled model and the original in fp32 ("" when nothing does): the eval
    output, the train-mode loss (with the router logits recorded when the model takes
    `output_router_logits`: its auxiliary losses included) and every parameter's gradient."""
    with torch.no_grad():
        model.eval(), compiled.eval()
        ref, got = output_of(model(**batch)), output_of(compiled(**batch))
    if not torch.allclose(got, ref, rtol=RTOL, atol=ATOL):
        return f"eval output differs by {(got - ref).abs().max().item():.2e}"
    import inspect

    takes = "output_router_logits" in inspect.signature(model.forward).parameters \
        or hasattr(getattr(model, "config", None), "output_router_logits")
    try:
        ref, got = _step(model, batch, takes), _step(compiled, batch, takes)
    except TypeError:  # the model does not take the keyword after all
        ref, got = _step(model, batch, False), _step(compiled, batch, False)
    a, b = loss_of(ref), loss_of(got)
    if not torch.allclose(b, a, rtol=RTOL, atol=ATOL):
        return f"train loss {b.item():.6g} vs {a.item():.6g}"
    ref_params, got_params = dict(model.named_parameters()), dict(compiled.named_parameters())
    if ref_params.keys() != got_params.keys():
        return f"parameter names differ: {sorted(ref_params.keys() ^ got_params.keys())[:3]}"
    for name, p in ref_params.items():
        q = got_params[name]
        if p.grad is None and q.grad is not None and not q.grad.any():
            continue  # an expert no token reached: the original's loop skipped it, the rewrite computed zero (`UNROUTED`)
        if (p.grad is None) != (q.grad is None):
            return f"gradient of {name} is {'missing' if q.grad is None else 'extra'}"
        if p.grad is not None and not torch.allclose(q.grad, p.grad, rtol=RTOL, atol=ATOL):
            return f"gradient of {name} differs by {(q.grad - p.grad).abs().max().item():.2e}"
    return ""


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def evaluate(family: Family, compile_: bool = True) -> Outcome:
    """Build `family` tiny, count its routed blocks, detect, and (`compile_`) compile the accepted blocks
    under `Plan(form="single")` and check parity. Never raises: a failure is recorded in the outcome."""
    import time

    import moepass

    out = Outcome(family)
    start = time.perf_counter()
    try:
        model, batch = build(family)
        out.routed = count_routed(model, batch)
    except Exception as err:  # noqa: BLE001  (a family that does not build tiny: its reason is the row)
        out.why_not_built = _error(err)
        return out
    out.built, out.model_class = True, type(model).__name__
    try:
        report = moepass.detect(model)
        if report.recording.startswith("forward not recorded"):  # e.g. an encoder-decoder needs decoder ids too:
            report = moepass.detect(model, example_inputs=batch)  # its own batch, as its user would pass it
    except Exception as err:  # noqa: BLE001
        out.crash = f"detect raised {_error(err)}"
        return out
    accepted = [d.path for d in report.details if d.accepted]
    rejected = {d.path: d.reason for d in report.details if not d.accepted}
    # a block outlined from its host's forward (`moepass.detect.outline`) holds the host's router and experts
    outlined = {f"{o.host}.{name}": path for path, o in report.outlines.items() for name in o.block_of_names()}
    alone = {d.path for d in report.details if not d.accepted and d.left_alone}
    for path in out.routed:
        held = _block_of(path, list(outlined))
        block = outlined[held] if held is not None else _block_of(path, list(accepted) + list(rejected))
        if block is None:
            out.not_reported.append(path)
        elif block in alone:
            out.left_alone[block] = rejected[block]
        elif block in rejected:
            out.rejected[block] = rejected[block]
        elif block not in out.accepted:
            out.accepted.append(block)
    if compile_ and out.accepted:
        try:
            plan = moepass.Plan(form="single", keep_original_if_slower=False)  # the rewritten graph's parity
            compiled = moepass.compile(model, plan, report=report)
            out.parity = parity(model, compiled, batch)
        except Exception as err:  # noqa: BLE001
            out.crash = f"compile / parity raised {_error(err)}"
    out.seconds = time.perf_counter() - start
    return out
