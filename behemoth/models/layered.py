"""Layered views: where a model family keeps its embedding, blocks and head, and how to run them part by part.

One view serves every way behemoth runs a model: a pipeline stage (the embedding on the first stage,
a run of blocks, the head on the last), the offload streamer (one block at a time), and cached
decoding (new tokens at explicit positions against a KV cache). Every block runs through the
model's own block forward: behemoth's GPT blocks and the unmodified transformers decoder layers of
`models/hf.py` take the cache as an argument (`cache`, transformers' `update(key, value, layer_idx)`
protocol). The view does only what the model's own forward does between those parts: positions,
the attention mask (causal, sliding-window, or the cache's) and Llama's rotary embedding, computed
from the hidden states, so a stage calls the blocks exactly as the whole model would. Module names
are single-process names (`model.layers.3`, `transformer.h.3`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from behemoth.errors import BehemothError


class KVCacheStep(Protocol):
    """One forward's view of a KV cache (what stores it lives in `behemoth.inference`). Keys and values are
    [batch, kv_heads, tokens, head_dim] (this rank's heads); the mask's columns are the attended slots, `key_positions` their positions."""

    attention_mask: torch.Tensor  # [batch, 1, new tokens, attended positions], True where a query may attend
    key_positions: torch.Tensor  # [batch or 1, attended positions]: each attended slot's position in its sequence

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values of layer `layer_idx`; every attended position's keys and values."""
        ...


Positions = torch.Tensor | None  # [batch, tokens] positions of the tokens; None: 0 .. tokens-1 (a whole sequence)


def run_block(block: nn.Module, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """A block's own forward; its hidden states, whether it returns them or a tuple that starts with them."""
    out = block(h, **ctx)
    return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class LayeredView:
    """How one model family is cut into parts and run one part at a time, with or without a KV cache."""

    blocks: str  # the ModuleList of blocks
    first: tuple[str, ...]  # modules only the first stage holds
    last: tuple[str, ...]  # modules only the last stage holds
    embedding: str  # the first-stage module whose weight a tied head reads
    embed: Callable[..., torch.Tensor]  # (model, token ids, positions=None) -> hidden states
    context: Callable[..., dict[str, Any]]  # (model, hidden states, positions=None, cache=None) -> what every block call needs
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # hidden states -> logits
    block: Callable[[nn.Module, torch.Tensor, dict[str, Any]], torch.Tensor] = run_block


def _positions(h: torch.Tensor, positions: Positions) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0) if positions is None else positions


def _causal_mask(model: nn.Module, h: torch.Tensor, positions: torch.Tensor) -> Any:
    """transformers' own causal mask (sliding-window where the config sets a window; None where SDPA's is_causal does it)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_causal_mask if getattr(model.config, "sliding_window", None) is None else create_sliding_window_causal_mask
    return make(config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions)


def _mask(model: nn.Module, h: torch.Tensor, positions: torch.Tensor, cache: KVCacheStep | None) -> Any:
    """The attention mask of these tokens: the causal one of a whole sequence, or the cache's (windowed where the config
    sets a sliding window: a query at position p sees p - window < j <= p, as transformers' mask)."""
    if cache is None:
        return _causal_mask(model, h, positions)
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if window is None:
        return cache.attention_mask
    keys = cache.key_positions.to(positions.device).unsqueeze(1)  # [B, 1, L]: positions, also of packed rows
    return cache.attention_mask & (keys > positions.unsqueeze(-1) - window).unsqueeze(1)


def _with_cache(ctx: dict[str, Any], cache: KVCacheStep | None) -> dict[str, Any]:
    return ctx if cache is None else {**ctx, "cache": cache, "use_cache": True}


def _gpt_context(model: nn.Module, h: torch.Tensor, positions: Positions = None, cache: KVCacheStep | None = None) -> dict[str, Any]:
    return {} if cache is None else {"cache": cache}


def _llama_context(model: nn.Module, h: torch.Tensor, positions: Positions = None, cache: KVCacheStep | None = None) -> dict[str, Any]:
    """Llama's (and Mixtral's) positions, mask and rotary embedding."""
    positions = _positions(h, positions)
    return _with_cache(
        {
            "attention_mask": _mask(model, h, positions, cache),
            "position_ids": positions,
            "position_embeddings": model.model.rotary_emb(h, position_ids=positions),
            "use_cache": False,
        },
        cache,
    )


def _gpt2_embed(model: nn.Module, idx: torch.Tensor, positions: Positions = None) -> torch.Tensor:
    t = model.transformer
    return t.drop(t.wte(idx) + t.wpe(_positions(idx, positions)))


def _gpt2_context(model: nn.Module, h: torch.Tensor, positions: Positions = None, cache: KVCacheStep | None = None) -> dict[str, Any]:
    positions = _positions(h, positions)
    return _with_cache({"attention_mask": _mask(model, h, positions, cache), "position_ids": positions, "use_cache": False}, cache)


def _llama_like(context: Callable[..., dict[str, Any]]) -> LayeredView:
    return LayeredView(
        "model.layers",
        ("model.embed_tokens",),
        ("model.norm", "lm_head"),
        "model.embed_tokens",
        embed=lambda m, idx, positions=None: m.model.embed_tokens(idx),
        context=context,
        head=lambda m, h: m.lm_head(m.model.norm(h)),
    )


VIEWS: dict[str, LayeredView] = {
    "gpt": LayeredView(
        "blocks",
        ("wte", "wpe"),
        ("ln_f", "lm_head"),
        "wte",
        embed=lambda m, idx, positions=None: m.embed(idx, positions),
        context=_gpt_context,
        head=lambda m, h: m.head(h),
    ),
    "llama": _llama_like(_llama_context),
    "mixtral": _llama_like(_llama_context),
    "gpt2": LayeredView(
        "transformer.h",
        ("transformer.wte", "transformer.wpe"),
        ("transformer.ln_f", "lm_head"),
        "transformer.wte",
        embed=_gpt2_embed,
        context=_gpt2_context,
        head=lambda m, h: m.lm_head(m.transformer.ln_f(h)),
    ),
}


def view_of(arch: str | None) -> LayeredView:
    """The layered view of behemoth's GPT (arch None or 'gpt') or of a transformers architecture."""
    name = arch or "gpt"
    if name not in VIEWS:
        raise BehemothError(f"hf.arch={name} has no layered view", f"use one of {', '.join(VIEWS)}")
    return VIEWS[name]
