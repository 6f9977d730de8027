"""Cached decoding: how each model family runs new tokens against the keys and values of the tokens before them.

Generation feeds a model a few new tokens per sequence (a whole prompt, then one token per step) at
explicit positions, and every attention layer hands its new keys and values to a `KVCacheStep`,
which stores them and returns the keys and values of every position the batch attends to, with the
mask saying which. What stores them (a paged cache, an offloaded one) lives in `behemoth.inference`;
what a family must do to use one lives here, so nothing outside `models/` names a model class.

behemoth's GPT runs its own blocks' parts; the Hugging Face models run their unmodified decoder
layers, given the step as transformers' `cache` (its `update(key, value, layer_idx)` protocol) and
the step's boolean mask as their attention mask, with rotary embeddings (Llama) or learned positions
(GPT-2) at the explicit positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.layered import VIEWS


class KVCacheStep(Protocol):
    """One forward's view of a KV cache. Keys and values are [batch, kv_heads, tokens, head_dim] (this rank's heads)."""

    attention_mask: torch.Tensor  # [batch, 1, new tokens, attended positions], True where a query may attend

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values of layer `layer_idx`; every attended position's keys and values."""
        ...


@dataclass(frozen=True)
class DecodeView:
    """How one model family runs new tokens at given positions against a KV cache, part by part (so a pipeline
    stage can run its own blocks only)."""

    blocks: str  # the ModuleList (or a pipeline stage's StageBlocks) of blocks, by single-process name
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, ids [B, T], positions [B, T]) -> h
    context: Callable[[nn.Module, torch.Tensor, torch.Tensor, KVCacheStep], dict[str, Any]]  # what every block call needs
    block: Callable[[nn.Module, int, torch.Tensor, dict[str, Any]], torch.Tensor]  # (block, layer index, h, context) -> h
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # hidden states -> logits (this rank's vocabulary part)


def _gpt_embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model.drop(model.wte(ids) + model.wpe(positions))


def _gpt_block(block: nn.Module, layer: int, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """behemoth's GPT block (models/gpt.py `Block`) with its attention over the cached keys and values."""
    cache: KVCacheStep = ctx["cache"]
    attn = block.attn
    x = block.ln_1(h)
    B, T, _ = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, -1, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    k, v = cache.update(k, v, layer)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attention_mask)
    h = h + block.drop(attn.proj(y.transpose(1, 2).reshape(B, T, -1)))
    return h + block.drop(block.mlp(block.ln_2(h)))


def _hf_block(block: nn.Module, layer: int, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    out = block(h, **ctx)
    return out[0] if isinstance(out, tuple) else out


def _llama_context(model: nn.Module, h: torch.Tensor, positions: torch.Tensor, cache: KVCacheStep) -> dict[str, Any]:
    return {"attention_mask": cache.attention_mask, "position_ids": positions, "cache": cache, "use_cache": True,
            "position_embeddings": model.model.rotary_emb(h, position_ids=positions)}


def _gpt2_embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    t = model.transformer
    return t.drop(t.wte(ids) + t.wpe(positions))


def _gpt2_context(model: nn.Module, h: torch.Tensor, positions: torch.Tensor, cache: KVCacheStep) -> dict[str, Any]:
    return {"attention_mask": cache.attention_mask, "cache": cache, "use_cache": True}


DECODE_VIEWS: dict[str, DecodeView] = {
    "gpt": DecodeView(VIEWS["gpt"].blocks, _gpt_embed, lambda m, h, pos, cache: {"cache": cache}, _gpt_block, VIEWS["gpt"].head),
    "llama": DecodeView(VIEWS["llama"].blocks, lambda m, ids, pos: m.model.embed_tokens(ids), _llama_context, _hf_block,
                        VIEWS["llama"].head),
    "gpt2": DecodeView(VIEWS["gpt2"].blocks, _gpt2_embed, _gpt2_context, _hf_block, VIEWS["gpt2"].head),
}


def decode_view_of(arch: str | None) -> DecodeView:
    """The cached-decoding view of behemoth's GPT (arch None or 'gpt') or of a transformers architecture."""
    name = arch or "gpt"
    if name not in DECODE_VIEWS:
        raise BehemothError(f"{name} models have no cached decoding", f"generate with one of {', '.join(DECODE_VIEWS)}")
    return DECODE_VIEWS[name]
