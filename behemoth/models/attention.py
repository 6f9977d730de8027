"""The one hook a parallel layer has into a model's attention: replace the causal SDPA over the whole sequence by
another function of the same (already position-encoded) queries, keys and values.

`attend(q, k, v, *, scale, dropout) -> y`: q [B, H, T, d], k and v [B, Hkv, T, d] (grouped-query heads not yet
repeated), y [B, H, T, d]. Context parallelism uses it for ring and Ulysses attention over a sharded sequence; cached
decoding keeps the model's own attention. For a transformers model it is registered as an attention implementation
(`behemoth_context`), which transformers calls with each attention module; masks are not built for it (the function
knows its causal structure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Attend = Callable[..., torch.Tensor]
IMPLEMENTATION = "behemoth_context"


def use_attention(model: nn.Module, attend: Attend) -> None:
    """Route every causal self-attention of `model` (behemoth's GPT or a transformers model) through `attend`."""
    from behemoth.models.gpt import CausalSelfAttention

    gpt = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for m in gpt:
        m.attend = attend
    if gpt or not hasattr(model, "config"):
        return
    _register()
    for module in model.modules():
        if hasattr(module, "is_causal"):  # transformers' attention modules (they pass themselves to the implementation)
            setattr(module, "behemoth_attend", attend)  # noqa: B010 (an attribute nn.Module's typing does not know)
    setattr(model.config, "_attn_implementation", IMPLEMENTATION)  # noqa: B010


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _hf_attention)


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-implementation signature; its output is [B, T, H, d]."""
    attend: Attend = getattr(module, "behemoth_attend")  # noqa: B009
    return attend(query, key, value, scale=scaling, dropout=dropout).transpose(1, 2).contiguous(), None
