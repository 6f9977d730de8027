"""Hugging Face causal LMs (GPT-2, the decoder families of models/hf_families.py) run unmodified under behemoth's init and plans.

The model is built on the meta device from its transformers config (parameters only; buffers such as
Llama's rotary frequencies are real), so `materialize` draws every parameter from (seed, name) exactly as
for behemoth's GPT, or the weights of a local `save_pretrained` directory are copied in afterwards.
Nothing is downloaded. Modules are only replaced by name; the transformers classes are not edited.

With `hf.weights`, the folder's config.json *is* the model: every field goes to transformers as written
(norm epsilon, biases, activation, RoPE settings, dropout, tied head, ...), so the model is the one
`from_pretrained` builds. Options the user sets override their fields and are listed at launch
(`config_overrides`); a field behemoth cannot honour is refused before launch (`config_problems`).
Without weights, the config is made from the `model` and `hf` sections.

Tensor-parallel rules: each decoder family brings its own `base_model_tp_plan` (HF style names, mapped to
behemoth's); GPT-2 has none, so behemoth ships one (its fused c_attn is a transposed Conv1D holding [q|k|v]).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.hf_families import FAMILIES, family_name, family_problems, unsupported, zero_norm_names
from behemoth.models.init import ADAPTER, FULL_NAME, TAKE_LOCAL, InitSpec
from behemoth.models.safetensors_io import StoredTensor, read_index, read_into, read_tensors
from behemoth.models.shape import ModelShape

ARCHS = ("gpt2", *FAMILIES)
LLAMA_LIKE = tuple(FAMILIES)  # the standard layout: the same embedding, decoder layers, norms and head
# transformers' style names -> behemoth's (see parallel/tensor/plan.py)
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "vocab",
    "sequence_parallel": "sequence_norm",
    "packed_colwise": "packed_colwise:2",
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "grad_sum",
}
GPT2_TP_PLAN = {
    "transformer.wte": "vocab",
    "transformer.wpe": "position_embedding",
    "transformer.h.0": "sequence_input",
    "transformer.h.*.ln_1": "sequence_norm",
    "transformer.h.*.attn.c_attn": "packed_colwise:3",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.ln_2": "sequence_norm",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "transformer.ln_f": "sequence_norm",
    "lm_head": "vocab",
}
LLAMA_EXTRA_PLAN = {  # what Llama's own plan leaves out: embedding, head, norms, the sequence split
    "model.embed_tokens": "vocab",
    "model.layers.0": "sequence_input",
    "model.layers.*.input_layernorm": "sequence_norm",
    "model.layers.*.post_attention_layernorm": "sequence_norm",
    "model.norm": "sequence_norm",
    "lm_head": "vocab",
}
# config.json keys that say nothing about the model's computation (bookkeeping, generation, outputs)
NOT_MODEL = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "model_type",
    "dtype",
    "torch_dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "task_specific_params",
    "attn_implementation",
}
DROPOUT_KEYS = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), **{k: f.dropout_keys for k, f in FAMILIES.items()}}
BIAS_KEYS = {"gpt2": (), **{k: f.bias_keys for k, f in FAMILIES.items()}}


class HFConfig(BaseModel):
    """A Hugging Face architecture instead of behemoth's GPT; its shape comes from the `model` section or `weights`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str | None = Field(None, description=f"transformers family (model=hf:NAME): {', '.join(ARCHS)}")
    weights: str | None = Field(None, description="local save_pretrained directory (config.json + *.safetensors) to start from")
    kv_heads: int | None = Field(None, ge=1, description="Llama key/value heads (grouped-query attention; default n_head)")
    ffn: int | None = Field(None, ge=1, description="MLP width (default mlp_ratio x d_model)")
    rope_theta: float = Field(10000.0, gt=0, description="Llama rotary base")

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str | None) -> str | None:
        if v is not None and v not in ARCHS:
            raise ValueError(f"hf.arch={v!r} is not a family behemoth trains: {unsupported(v)}")
        return v


def read_weights_config(weights: str) -> dict[str, Any]:
    """config.json of a local save_pretrained directory, as a mapping."""
    path = Path(weights).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BehemothError(
            f"hf.weights={weights} has no readable config.json ({err.__class__.__name__})",
            "point hf.weights at a directory written by save_pretrained",
        ) from None
    if not isinstance(config, dict):
        raise BehemothError(
            f"hf.weights={weights}: config.json holds a {type(config).__name__}, not a mapping",
            "point hf.weights at a directory written by save_pretrained",
        )
    return config


def config_class(arch: str) -> type:
    import transformers

    return transformers.GPT2Config if arch == "gpt2" else getattr(transformers, FAMILIES[arch].config)


def shape_fields(arch: str, c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model-section fields, hf-section fields) that a config.json's shape sets; a missing key names itself."""
    try:
        if arch in LLAMA_LIKE:
            model = dict(
                n_layer=c["num_hidden_layers"],
                n_head=c["num_attention_heads"],
                d_model=c["hidden_size"],
                context=c["max_position_embeddings"],
                vocab_size=c["vocab_size"],
                tie_embeddings=c.get("tie_word_embeddings", False),
            )
            hf = dict(kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], ffn=c["intermediate_size"], rope_theta=rope_theta_of(c))
            if FAMILIES[arch].moe:
                from behemoth.models.hf_moe import mixtral_moe_fields, moe_objective

                model["moe"], model["moe_objective"] = mixtral_moe_fields(c), moe_objective(c)
            return model, hf
        model = dict(
            n_layer=c["n_layer"],
            n_head=c["n_head"],
            d_model=c["n_embd"],
            context=c["n_positions"],
            vocab_size=c["vocab_size"],
            tie_embeddings=c.get("tie_word_embeddings", True),
        )
        return model, dict(ffn=c.get("n_inner") or 4 * c["n_embd"])
    except KeyError as err:
        raise BehemothError(f"a {arch} config.json without {err.args[0]!r}", "save the model's config with save_pretrained") from None


def shape_from_weights(weights: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(arch, model-section fields, hf-section fields) described by a weights directory's config.json."""
    c = read_weights_config(weights)
    arch = family_name(c)
    if arch not in ARCHS:
        raise BehemothError(f"hf.weights={weights} holds a {unsupported(arch)}", "convert it to one of those families or use another model")
    return (arch, *shape_fields(arch, c))


def rope_theta_of(c: dict[str, Any]) -> float:
    params = c.get("rope_parameters") or {}
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def moe_objective_of(arch: str | None) -> dict[str, Any]:
    """The model.moe objective fields of a transformers MoE family built from options (its config class's defaults)."""
    if arch not in FAMILIES or not FAMILIES[arch].moe:
        return {}
    from behemoth.models.hf_moe import moe_objective

    return moe_objective({})


def config_problems(weights: str) -> list[str]:
    """Why a weights folder's config.json cannot be trained as written (empty: every field is honoured)."""
    c = read_weights_config(weights)
    arch = family_name(c)
    if arch not in ARCHS:
        return [f"hf.weights={weights} holds a {unsupported(arch)}"]
    known = set(config_class(arch)().to_dict()) | NOT_MODEL
    out = [
        f"hf.weights={weights}: config.json field {k}={c[k]!r} is not a {arch} setting transformers knows; "
        "remove it or use the transformers version that wrote it"
        for k in sorted(set(c) - known)
    ]
    heads = [a for a in c.get("architectures") or [] if not a.endswith(("ForCausalLM", "LMHeadModel"))]
    if heads:
        out.append(f"hf.weights={weights} is a {heads[0]}, not a causal language model; behemoth trains next-token prediction")
    for key in ("is_encoder_decoder", "add_cross_attention"):
        if c.get(key):
            out.append(f"hf.weights={weights}: config.json sets {key}=true, which behemoth's decoder-only training cannot honour")
    if c.get("quantization_config"):
        out.append(f"hf.weights={weights} holds quantized weights (quantization_config); export them in floating point first")
    return out


def base_config(model_cfg: Any, hf: HFConfig) -> dict[str, Any]:
    """The transformers config as a dict: the weights' config.json, or one made from behemoth's model section."""
    if hf.weights:
        return read_weights_config(hf.weights)
    common = dict(
        vocab_size=model_cfg.vocab_size,
        tie_word_embeddings=model_cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **dict.fromkeys(DROPOUT_KEYS[hf.arch], model_cfg.dropout_p),
    )
    if model_cfg.bias is not None:
        common.update(dict.fromkeys(BIAS_KEYS[hf.arch], model_cfg.bias))
    ffn = hf.ffn or model_cfg.mlp_ratio * model_cfg.d_model
    if hf.arch in LLAMA_LIKE:
        extra = {}
        if FAMILIES[hf.arch].moe:
            from behemoth.models.hf_moe import mixtral_config_fields

            extra = mixtral_config_fields(model_cfg.moe)
        return dict(
            hidden_size=model_cfg.d_model,
            intermediate_size=ffn,
            num_hidden_layers=model_cfg.n_layer,
            num_attention_heads=model_cfg.n_head,
            num_key_value_heads=hf.kv_heads or model_cfg.n_head,
            max_position_embeddings=model_cfg.context,
            rope_parameters={"rope_type": "default", "rope_theta": hf.rope_theta},
            **common,
            **extra,
        )
    return dict(n_embd=model_cfg.d_model, n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, n_inner=ffn, n_positions=model_cfg.context, **common)


def config_overrides(model_cfg: Any, hf: HFConfig) -> dict[str, tuple[Any, Any]]:
    """With hf.weights: config.json key -> (its value, the value behemoth runs with) for every field an option changes
    (model.dropout, model.bias; model.n_layer only for the one-block copy that times a layer)."""
    if not hf.weights:
        return {}
    base = base_config(model_cfg, hf)
    wanted: dict[str, Any] = {"num_hidden_layers" if hf.arch in LLAMA_LIKE else "n_layer": model_cfg.n_layer}
    if model_cfg.dropout is not None:
        wanted.update(dict.fromkeys(DROPOUT_KEYS[hf.arch], model_cfg.dropout))
    if model_cfg.bias is not None:
        wanted.update(dict.fromkeys(BIAS_KEYS[hf.arch], model_cfg.bias))
    if FAMILIES.get(hf.arch, FAMILIES["llama"]).moe:
        from behemoth.models.hf_moe import moe_overrides

        wanted.update(moe_overrides(model_cfg.moe, base))
    defaults = config_class(hf.arch)().to_dict()
    return {k: (base.get(k, defaults.get(k)), v) for k, v in wanted.items() if base.get(k, defaults.get(k)) != v}


def model_problems(model_cfg: Any, hf: HFConfig, plan: Any = None) -> list[str]:
    """Why this Hugging Face model cannot be built as asked (under `plan`, a ParallelPlan, when given): an option its
    family has no field for, a config.json field behemoth cannot honour, a split or objective the layout cannot run."""
    out = []
    if hf.arch == "gpt2" and model_cfg.bias is False:
        out.append("model.bias=false: GPT-2 always has biases; leave model.bias unset or use model=hf:llama")
    if hf.arch == "gpt2" and plan is not None and plan.tp > 1 and plan.tp_mode == "3d":
        out.append("parallel.tp_mode=3d: hf gpt2 has no 3-D plan (its tied head has no cube layout); use parallel.tp_mode=1d or 2d")
    if hf.arch == "gpt2" and hf.kv_heads not in (None, model_cfg.n_head):
        out.append(f"hf.kv_heads={hf.kv_heads}: GPT-2 has no grouped-query attention; leave hf.kv_heads unset")
    if hf.arch in FAMILIES and model_cfg.bias is not None and not BIAS_KEYS[hf.arch]:
        out.append(f"model.bias={str(model_cfg.bias).lower()}: hf {hf.arch} has no bias option; leave model.bias unset")
    moe_family = hf.arch in FAMILIES and FAMILIES[hf.arch].moe
    if model_cfg.moe.enabled or moe_family:
        from behemoth.models.hf_moe import moe_model_problems

        out += moe_model_problems(model_cfg.moe, hf.arch, plan)
    out += config_problems(hf.weights) if hf.weights else []
    if not out and hf.arch in FAMILIES:
        tp, tp_mode = (plan.tp, plan.tp_mode) if plan is not None else (1, "1d")
        out += family_problems(transformers_config(model_cfg, hf), hf.arch, tp, tp_mode)
    return out


def transformers_config(model_cfg: Any, hf: HFConfig) -> Any:
    """The transformers config behemoth builds `hf.arch` from (SDPA attention, no KV cache while training)."""
    fields = {**base_config(model_cfg, hf), **{k: new for k, (_, new) in config_overrides(model_cfg, hf).items()}}
    fields = {k: v for k, v in fields.items() if k not in ("attn_implementation", "use_cache", "model_type")}
    return config_class(hf.arch)(**fields, attn_implementation="sdpa", use_cache=False)


def hf_shape(config: Any, arch: str) -> ModelShape:
    """The shape of a transformers config, in behemoth's terms."""
    if arch in LLAMA_LIKE:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        experts = getattr(config, "num_local_experts", 0) if FAMILIES[arch].moe else 0
        return ModelShape(
            arch,
            config.num_hidden_layers,
            config.hidden_size,
            heads,
            config.num_key_value_heads or heads,
            head_dim,
            config.intermediate_size,
            config.vocab_size,
            config.max_position_embeddings,
            bool(config.tie_word_embeddings),
            gated=True,
            experts=(experts,) * config.num_hidden_layers if experts else (),
            top_k=config.num_experts_per_tok if experts else 0,
        )
    return ModelShape(
        "gpt2",
        config.n_layer,
        config.n_embd,
        config.n_head,
        config.n_head,
        config.n_embd // config.n_head,
        config.n_inner or 4 * config.n_embd,
        config.vocab_size,
        config.n_positions,
        bool(config.tie_word_embeddings),
        gated=False,
    )


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise BehemothError("hf.arch needs the transformers package, which is not installed", "pip install 'behemoth[hf]'") from None


def build_hf(config: Any, arch: str) -> nn.Module:
    """The transformers model on the meta device: parameters without storage, buffers real (on the CPU)."""
    import transformers

    cls = transformers.GPT2LMHeadModel if arch == "gpt2" else getattr(transformers, FAMILIES[arch].causal_lm)
    with torch.device("meta"):
        model = cls(config)
    rebuild_meta_buffers(model)
    return model


def rebuild_meta_buffers(model: nn.Module) -> None:
    """Modules whose buffers were computed on meta (rotary frequencies, Gemma's embedding scale) are built again on the
    CPU from their config (the scale from the value it was made with)."""
    for name, module in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            if hasattr(module, "scalar_embed_scale") and set(module._buffers) == {"embed_scale"}:
                module._buffers["embed_scale"] = torch.tensor(module.scalar_embed_scale)
                continue
            if not hasattr(module, "config") or any(True for _ in module.parameters(recurse=False)):
                raise BehemothError(f"{name} ({type(module).__name__}) has buffers behemoth cannot rebuild", "report this model")
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            model.set_submodule(name, fresh)


def hf_init_spec(model: nn.Module, arch: str):
    """transformers' own initialization, by parameter name: N(0, 0.02); GPT-2 residual projections 0.02/sqrt(2L); norms
    at 1 (Gemma's, which scale by 1 + w, at 0)."""
    std = getattr(model.config, "initializer_range", 0.02)
    n_layer = model.config.num_hidden_layers
    zeros = zero_norm_names(model)

    def spec(name: str) -> InitSpec:
        if name.endswith(".bias") or name in zeros:
            return InitSpec("zeros")
        if "norm" in name or ".ln_" in name:
            return InitSpec("ones")
        if arch == "gpt2" and name.endswith("c_proj.weight"):
            return InitSpec("normal", std / math.sqrt(2 * n_layer))
        return InitSpec("normal", std)

    return spec


def hf_tp_plan(model: nn.Module, arch: str) -> dict[str, str]:
    """behemoth's tensor-parallel plan for a transformers model: the family's own rules, mapped, or GPT-2's from behemoth.
    A family whose rules behemoth cannot map gets an empty plan (model_problems refuses tp > 1 for it)."""
    if arch == "gpt2":
        return dict(GPT2_TP_PLAN)
    if FAMILIES[arch].no_tp:
        return {}
    own = getattr(model.config, "base_model_tp_plan", None) or {}
    extra = LLAMA_EXTRA_PLAN
    if FAMILIES[arch].moe:  # its experts are split by parallel/expert/, which also enters their tensor-parallel region
        from behemoth.models.hf_moe import MOE_EXTRA_PLAN

        own = {k: v for k, v in own.items() if ".experts" not in k}
        extra = {**LLAMA_EXTRA_PLAN, **MOE_EXTRA_PLAN}
    unknown = sorted({s for s in own.values() if s not in HF_STYLES})
    if unknown:
        raise BehemothError(f"{arch}'s base_model_tp_plan uses styles {unknown} behemoth does not map", f"known: {', '.join(HF_STYLES)}")
    prefix = model.base_model_prefix
    return {**{f"{prefix}.{k}": HF_STYLES[v] for k, v in own.items()}, **extra}


def transposed_linears(model: nn.Module) -> frozenset[str]:
    """Modules that hold a linear weight as [in, out] (GPT-2's Conv1D) instead of nn.Linear's [out, in]."""
    from transformers.pytorch_utils import Conv1D

    return frozenset(n for n, m in model.named_modules() if isinstance(m, Conv1D))


def norm_modules(model: nn.Module) -> frozenset[str]:
    """Every normalization module on the residual stream: LayerNorm, or the RMSNorm class of a transformers family (not
    the per-head q/k norms inside attention, which run in the tensor-parallel region)."""
    return frozenset(
        n for n, m in model.named_modules() if (isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")) and ".self_attn." not in n
    )


def adapt_attention_width(model: nn.Module, tp: int) -> None:
    """GPT-2 splits c_attn's output by its `split_size` attribute (the full width); under TP a rank holds 1/t of it."""
    for block in model.transformer.h:
        block.attn.split_size = block.attn.embed_dim // tp


def tensor_parallel_hook(arch: str) -> Any:
    """What a family's modules need after the tensor-parallel split (None: nothing)."""
    if arch == "gpt2":
        return adapt_attention_width
    if FAMILIES[arch].embed_scale:
        from behemoth.models.hf_families import keep_embed_scale

        return keep_embed_scale
    return None


def hf_logits(model: nn.Module, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits (`positions`: the tokens' position ids); an MoE family's auxiliary loss is behemoth's
    (models/moe.py), not computed again here."""
    extra = {} if positions is None else {"position_ids": positions}
    if getattr(model.config, "output_router_logits", None) is not None:
        return model(input_ids=idx, use_cache=False, output_router_logits=False, **extra).logits
    return model(input_ids=idx, use_cache=False, **extra).logits


@torch.no_grad()
def load_weights(model: nn.Module, weights: str, params: dict[str, torch.Tensor] | None = None) -> int:
    """Copy a save_pretrained directory's safetensors into the (materialized, possibly split) parameters, or into
    `params` by name (a hydra trial's views into its shards; `model` on meta then); a tensor that takes a whole stored
    tensor of its dtype is read straight into its storage (the weights are resident once)."""
    files = sorted(Path(weights).expanduser().glob("*.safetensors"))
    if not files:
        raise BehemothError(f"hf.weights={weights} holds no *.safetensors file", "save the model with save_pretrained(..., safe_serialization=True)")
    params = params or {getattr(p, FULL_NAME, n): p for n, p in model.named_parameters() if not hasattr(p, ADAPTER)}  # adapters: not in the folder
    index = read_index(files)
    direct = {k for k, p in params.items() if k in index and _takes_whole(p, index[k])}
    for key in direct:
        read_into(index[key], params[key].data)
    loaded = set(direct)
    for key, full in stored_tensors(files, set(params) - direct, getattr(model.config, "model_type", None)):
        p = params[key]
        p.copy_(getattr(p, TAKE_LOCAL, lambda t: t)(full).to(p.dtype))
        loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise BehemothError(f"hf.weights={weights} lacks {len(missing)} parameter(s), e.g. {missing[0]}", "save the whole model")
    return len(loaded)


def _takes_whole(p: torch.Tensor, entry: StoredTensor) -> bool:
    """A CPU parameter holding the whole stored tensor in its dtype (no split, no cast): read into it directly."""
    return not hasattr(p, TAKE_LOCAL) and p.device.type == "cpu" and p.dtype == entry.dtype and p.is_contiguous() and tuple(p.shape) == entry.shape


def stored_tensors(files: list[Path], wanted: set[str], model_type: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every wanted parameter in the files; a Mixtral's per-expert tensors are stacked first
    (only those of the layers whose experts are wanted are read)."""
    layers = {w[: w.index(".mlp.")] for w in wanted if ".mlp." in w}

    def keep(k: str) -> bool:
        if k in wanted:
            return True
        if model_type != "mixtral":
            return False
        from behemoth.models.hf_moe import LEGACY

        m = LEGACY.match(k)
        return m is not None and m.group(1) in layers

    if model_type == "mixtral":
        from behemoth.models.hf_moe import from_legacy
    tensors = read_tensors(files, keep)
    if model_type == "mixtral":
        tensors = from_legacy(tensors)
    return ((k, t) for k, t in tensors if k in wanted)
