"""Layered views: where a model family keeps its embedding, blocks and head, and how to run them stage by stage.

A pipeline stage runs the embedding (first stage), a run of blocks, and the head (last stage). For
behemoth's GPT those are its own `embed`, `blocks` and `head`; for the Hugging Face models of
`models/hf.py` (unmodified transformers classes) the view does what the model's own forward does
between those parts: positions, the causal mask and Llama's rotary embedding, computed per stage
from the hidden states, so every stage calls the transformers blocks exactly as the whole model would.
Module names are single-process names (`model.layers.3`, `transformer.h.3`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from behemoth.errors import BehemothError


@dataclass(frozen=True)
class LayeredView:
    """How one model family is cut into stages and run one stage at a time."""

    blocks: str  # the ModuleList of blocks
    first: tuple[str, ...]  # modules only the first stage holds
    last: tuple[str, ...]  # modules only the last stage holds
    embedding: str  # the first-stage module whose weight a tied head reads
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # token ids -> hidden states
    context: Callable[[nn.Module, torch.Tensor], dict[str, Any]]  # hidden states -> what every block call needs
    block: Callable[[nn.Module, torch.Tensor, dict[str, Any]], torch.Tensor]
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # hidden states -> logits


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _causal_mask(model: nn.Module, h: torch.Tensor, positions: torch.Tensor) -> Any:
    """transformers' own causal mask for these hidden states (None where SDPA's is_causal does it)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions)


def _hidden(out: Any) -> torch.Tensor:
    """A block's hidden states, whether it returns them or a tuple that starts with them."""
    return out[0] if isinstance(out, tuple) else out


def _llama_context(model: nn.Module, h: torch.Tensor) -> dict[str, Any]:
    positions = _positions(h)
    return {"attention_mask": _causal_mask(model, h, positions), "position_ids": positions,
            "position_embeddings": model.model.rotary_emb(h, position_ids=positions), "use_cache": False}


def _mixtral_context(model: nn.Module, h: torch.Tensor) -> dict[str, Any]:
    """Llama's context, with transformers' sliding-window mask when the config sets a window."""
    if getattr(model.config, "sliding_window", None) is None:
        return _llama_context(model, h)
    from transformers.masking_utils import create_sliding_window_causal_mask

    positions = _positions(h)
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions)
    return {"attention_mask": mask, "position_ids": positions, "position_embeddings": model.model.rotary_emb(h, position_ids=positions),
            "use_cache": False}


def _gpt2_embed(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    t = model.transformer
    return t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)))


def _gpt2_context(model: nn.Module, h: torch.Tensor) -> dict[str, Any]:
    positions = _positions(h)
    return {"attention_mask": _causal_mask(model, h, positions), "position_ids": positions, "use_cache": False}


VIEWS: dict[str, LayeredView] = {
    "gpt": LayeredView("blocks", ("wte", "wpe"), ("ln_f", "lm_head"), "wte",
                       embed=lambda m, idx: m.embed(idx), context=lambda m, h: {},
                       block=lambda b, h, ctx: b(h), head=lambda m, h: m.head(h)),
    "llama": LayeredView("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), "model.embed_tokens",
                         embed=lambda m, idx: m.model.embed_tokens(idx), context=_llama_context,
                         block=lambda b, h, ctx: _hidden(b(h, **ctx)), head=lambda m, h: m.lm_head(m.model.norm(h))),
    "mixtral": LayeredView("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), "model.embed_tokens",
                           embed=lambda m, idx: m.model.embed_tokens(idx), context=_mixtral_context,
                           block=lambda b, h, ctx: _hidden(b(h, **ctx)), head=lambda m, h: m.lm_head(m.model.norm(h))),
    "gpt2": LayeredView("transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head"), "transformer.wte",
                        embed=_gpt2_embed, context=_gpt2_context,
                        block=lambda b, h, ctx: _hidden(b(h, **ctx)), head=lambda m, h: m.lm_head(m.transformer.ln_f(h))),
}


def view_of(arch: str | None) -> LayeredView:
    """The layered view of behemoth's GPT (arch None or 'gpt') or of a transformers architecture."""
    name = arch or "gpt"
    if name not in VIEWS:
        raise BehemothError(f"hf.arch={name} has no layered view for pipeline parallelism", f"use one of {', '.join(VIEWS)} with parallel.pp > 1")
    return VIEWS[name]
