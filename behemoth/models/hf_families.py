"""The transformers decoder families behemoth trains through one adapter, and what each needs beyond the standard layout.

A family qualifies when its causal LM is the standard layout: `model.embed_tokens`, a list of decoder
layers at `model.layers` (each called as transformers' own model calls it: hidden states, the causal
mask, positions and the rotary embedding's cos/sin), a final norm `model.norm` and `lm_head`. Its
tensor-parallel split is the family's own `base_model_tp_plan`, mapped to behemoth's styles. What a
family does beside that layout is listed here (Gemma scales the embeddings and keeps RMSNorm weights
as offsets from 1) or, where behemoth cannot express it, refused before launch with the reason.
A folder's family comes from its config.json `model_type`, or from `architectures` when the type is
unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from behemoth.models.layered import KVCacheStep, LayeredView, Positions, _positions, _with_cache


@dataclass(frozen=True)
class Family:
    """One transformers decoder family: its classes, its option fields, and what it adds to the standard layout."""

    config: str  # transformers config class
    causal_lm: str  # transformers causal-LM class
    dropout_keys: tuple[str, ...] = ("attention_dropout",)  # fields model.dropout sets
    bias_keys: tuple[str, ...] = ()  # fields model.bias sets (empty: the family has no such option)
    moe: bool = False  # its MLPs are mixtures of experts (models/hf_moe.py)
    zero_norms: bool = False  # RMSNorm computes x * (1 + w): its weights start at 0
    embed_scale: bool = False  # embeddings are multiplied by sqrt(hidden_size) (inside the embedding module)
    no_tp: str = ""  # why tensor parallelism cannot split it (empty: it can)
    tp2d: bool = False  # the standard layout's 2-D and 3-D plans split it (RMSNorm of the Llama kind, no per-head norms)
    head_norms: bool = False  # RMSNorms of q and k over head_dim, one weight for every head (Qwen3's q_norm, k_norm)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", bias_keys=("attention_bias", "mlp_bias"), tp2d=True),
    "mistral": Family("MistralConfig", "MistralForCausalLM", tp2d=True),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", tp2d=True),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", bias_keys=("attention_bias",), tp2d=True, head_norms=True),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", bias_keys=("attention_bias",), zero_norms=True, embed_scale=True, tp2d=True),
    "phi3": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"),
        no_tp="its fused qkv_proj is sliced by the full head count in forward (its own tp plan gathers the outputs instead of "
        "splitting them); use dp, ZeRO, pp or offload",
    ),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", moe=True),
}
# families transformers has that the standard adapter cannot run as transformers defines them
REFUSED: dict[str, str] = {
    "gemma2": "alternates sliding-window and global attention layers and soft-caps attention and final logits",
    "gemma3": "alternates sliding-window and global attention layers with two rotary embeddings",
    "granite": "scales embeddings, residuals, attention and logits by multipliers outside the standard layout",
    "qwen2_moe": "has a sigmoid-gated shared expert beside its routed experts, which behemoth's MoE layer does not express yet",
    "qwen3_moe": "routed experts with per-layer sparse steps, which behemoth's MoE layer does not express yet",
}


def family_name(c: dict[str, Any]) -> str | None:
    """A config.json's family: its model_type, or the family whose causal-LM class `architectures` names."""
    kind = c.get("model_type")
    if kind in FAMILIES or kind == "gpt2":
        return kind
    for arch in c.get("architectures") or []:
        for name, fam in FAMILIES.items():
            if arch == fam.causal_lm:
                return name
    return kind


def unsupported(name: Any) -> str:
    """Why a family is not trained (for a refusal line)."""
    reason = REFUSED.get(name) if isinstance(name, str) else None
    known = ", ".join(["gpt2", *FAMILIES])
    return f"{name!r} model{', which ' + reason if reason else ''}; behemoth trains {known}"


def attention_window(config: Any) -> int | None:
    """The sliding window every layer uses (None: full causal attention), as the family's own model builds its mask;
    raises ValueError when layers differ (`layer_types` mixing sliding and full attention)."""
    types = set(getattr(config, "layer_types", None) or [])
    if types - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types {sorted(types)}")
    if len(types) > 1:
        raise ValueError("layer_types mixes sliding_attention and full_attention layers")
    if types == {"full_attention"}:
        return None
    return getattr(config, "sliding_window", None) or None


# The standard layout as a 2-D tensor-parallel plan (parallel/tensor/twod.py), every parameter in the q x q decomposition.
# Attention needs nothing more: rank (i, j)'s q/k/v blocks hold whole heads of column j (the query heads j*H/q.., the
# key/value heads j*KV/q.. they read, when q divides H and KV), transformers' attention reshapes by head_dim (so it
# runs on the local heads and keeps H/KV query heads per key/value head) and applies RoPE by the tokens' positions,
# the same for every sequence of row i; SwiGLU's gate and up blocks are column j's of each, multiplied in place.
DECODER_TP2D_PLAN: dict[str, str] = {
    "model.embed_tokens": "embedding",
    "model.layers.*.input_layernorm": "norm",
    "model.layers.*.self_attn.q_proj": "linear",
    "model.layers.*.self_attn.k_proj": "linear",
    "model.layers.*.self_attn.v_proj": "linear",
    "model.layers.*.self_attn.o_proj": "linear",
    "model.layers.*.post_attention_layernorm": "norm",
    "model.layers.*.mlp.gate_proj": "linear",
    "model.layers.*.mlp.up_proj": "linear",
    "model.layers.*.mlp.down_proj": "linear",
    "model.norm": "norm",
    "lm_head": "linear",
}


# 3-D (parallel/tensor/threed.py): q/k/v and gate/up go from the residual layout (features on the cube's A axis) to the
# inner one (on B, whole heads of whole sequences, as on a grid column), o_proj and down_proj come back; RoPE reads the
# positions of whole sequences and the norms sum along A, so the layers run unchanged, as under 2-D.
DECODER_TP3D_PLAN: dict[str, str] = {
    **DECODER_TP2D_PLAN,
    "model.layers.*.self_attn.o_proj": "linear-back",
    "model.layers.*.mlp.down_proj": "linear-back",
}


# GPT-2 on the grid: its Conv1D weights ([in, out]) blocked as nn.Linear's are (c_attn's fused [q|k|v] as 3 segments, so
# column j holds whole heads of each; `adapt_attention_width` sets split_size to h/q), LayerNorms with biases, the learned
# position table looked up by every row, and the head tied to wte (twod.py's TiedHead2D, on the table's layout).
GPT2_TP2D_PLAN: dict[str, str] = {
    "transformer.wte": "embedding",
    "transformer.wpe": "embedding:positions",
    "transformer.h.*.ln_1": "norm",
    "transformer.h.*.attn.c_attn": "linear:3",
    "transformer.h.*.attn.c_proj": "linear",
    "transformer.h.*.ln_2": "norm",
    "transformer.h.*.mlp.c_fc": "linear",
    "transformer.h.*.mlp.c_proj": "linear",
    "transformer.ln_f": "norm",
    "lm_head": "linear",
}


def tp2d_plan(name: str) -> dict[str, str] | None:
    """The family's 2-D tensor-parallel plan (None: it has none); Gemma's norms scale by 1 + w (`norm:offset`) and its
    embedding's sqrt(hidden_size) comes back through `keep_embed_scale`, as under 1-D; Qwen3's per-head norms are
    `replicated`; GPT-2's is its own (above)."""
    if name == "gpt2":
        return dict(GPT2_TP2D_PLAN)
    if name not in FAMILIES or not FAMILIES[name].tp2d:
        return None
    fam = FAMILIES[name]
    plan = {k: "norm:offset" if fam.zero_norms and v == "norm" else v for k, v in DECODER_TP2D_PLAN.items()}
    if fam.head_norms:  # on column j's whole heads, so local; their one head_dim weight whole on every rank
        plan.update({"model.layers.*.self_attn.q_norm": "replicated", "model.layers.*.self_attn.k_norm": "replicated"})
    return plan


def tp3d_plan(name: str) -> dict[str, str] | None:
    """The family's 3-D tensor-parallel plan (None: it has none): its 2-D plan with o_proj and down_proj back from B to A
    (Gemma's `norm:offset` norms and Qwen3's `replicated` per-head norms as under 2-D). GPT-2 has none: its tied head
    has no cube layout yet."""
    plan = tp2d_plan(name) if name != "gpt2" else None
    return None if plan is None else {**plan, **{k: v for k, v in DECODER_TP3D_PLAN.items() if v == "linear-back"}}


def family_problems(config: Any, name: str, tp: int = 1, tp_mode: str = "1d") -> list[str]:
    """Why this family's config cannot be trained as transformers defines it (under tensor parallelism of degree tp
    and style tp_mode)."""
    fam = FAMILIES[name]
    out = []
    if tp > 1 and tp_mode != "1d" and (tp3d_plan if tp_mode == "3d" else tp2d_plan)(name) is None:
        plans = tp3d_plan if tp_mode == "3d" else tp2d_plan
        families, kind = ", ".join(k for k in FAMILIES if plans(k) is not None), "3-D" if tp_mode == "3d" else "2-D"
        out.append(f"parallel.tp_mode={tp_mode}: hf {name} has no {kind} plan ({kind} splits {families} and behemoth's GPT); use parallel.tp_mode=1d")
    try:
        attention_window(config)
    except ValueError as err:
        out.append(f"hf {name}: {err}; behemoth builds one attention mask for every layer, so set one attention kind for all")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            out.append(f"hf {name}: {key}={getattr(config, key)} is not supported; behemoth's attention does not soft-cap")
    if tp > 1 and fam.no_tp:
        out.append(f"parallel.tp={tp}: hf {name} cannot be split by tensor parallelism: {fam.no_tp}")
    return out


def _mask(model: nn.Module, h: torch.Tensor, positions: torch.Tensor, cache: KVCacheStep | None) -> Any:
    """The family's attention mask: causal, or sliding-window where every layer uses a window; the cache's when decoding."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    window = attention_window(model.config)
    if cache is not None:
        if window is None:
            return cache.attention_mask
        keys = cache.key_positions.to(positions.device).unsqueeze(1)  # [B, 1, L]: positions, also of packed rows
        return cache.attention_mask & (keys > positions.unsqueeze(-1) - window).unsqueeze(1)
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    return make(config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions)


def decoder_context(model: Any, h: torch.Tensor, positions: Positions = None, cache: KVCacheStep | None = None) -> dict[str, Any]:
    """What every decoder layer of the standard layout is called with: mask, positions, the rotary embedding's cos/sin."""
    positions = _positions(h, positions)
    ctx = {
        "attention_mask": _mask(model, h, positions, cache),
        "position_ids": positions,
        "position_embeddings": model.model.rotary_emb(h, position_ids=positions),
        "use_cache": False,
    }
    return _with_cache(ctx, cache)


def _embed(m: Any, idx: torch.Tensor, positions: Positions = None) -> torch.Tensor:
    return m.model.embed_tokens(idx)


def _head(m: Any, h: torch.Tensor) -> torch.Tensor:
    return m.lm_head(m.model.norm(h))


DECODER_VIEW = LayeredView("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), "model.embed_tokens", _embed, decoder_context, _head)


def keep_embed_scale(model: nn.Module, tp: int) -> None:
    """Gemma scales its embeddings inside the embedding module; the vocabulary-parallel one that replaces it under tp
    gets the same scale back (sqrt(hidden_size), in the weight's dtype, as transformers computes it)."""
    embed = model.get_submodule("model.embed_tokens") if hasattr(model, "model") else None
    if embed is None or hasattr(embed, "embed_scale"):
        return
    config: Any = model.config
    scale = float(config.hidden_size) ** 0.5
    embed.register_forward_hook(lambda m, _args, out: out * torch.tensor(scale, dtype=out.dtype))


def zero_norm_names(model: nn.Module) -> frozenset[str]:
    """Parameters of norms whose weights start at 0 (x * (1 + w)): what a family's own constructor gives them."""
    if not FAMILIES.get(getattr(model.config, "model_type", ""), Family("", "")).zero_norms:
        return frozenset()
    return frozenset(f"{n}.weight" for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm"))
