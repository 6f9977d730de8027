"""A step of several new tokens per row (prefill, chunked prefill, speculative checks) packed: no padding computed.

A step's rows are right-padded to the longest row's new tokens (`StepBatch`); the model's own blocks then run every
product over B x T positions, of which a batch of 32 bench prompts (62 to 197 tokens) leaves about a third padding.
`prefill_layers` runs the same arithmetic as `LlamaDecoderLayer` (fast_decode.py's, with its fused [in, out] weights)
on the N real tokens alone, packed row after row into [N, d]: every product and elementwise op over N rows, and
attention row by row (one SDPA call per row and layer, from TorchScript's interpreter): a row that starts at position
0 attends causally to its own new keys (no gather, no mask), a row with cached positions (a later prefill chunk, a
prefix-cache hit, a speculative check) to its cached slots and new keys under a mask that lets a new token at position
p see positions 0..p. The keys and values are written to and read back in the cache's dtype, as the blocks' path does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from behemoth.inference.fast_decode import FusedDecoder, _product, _rms, _rotate, scripted


def _row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gather: torch.Tensor, start: int
) -> torch.Tensor:
    """[n, heads, D]: attention of one row's n new queries ([n, heads, D]; their keys and values k, v [n, kv_heads, D]
    already in the cache) to its positions 0..start + n - 1 (`gather`: the row's slots)."""
    n = q.shape[0]
    qb = q.transpose(0, 1).unsqueeze(0)
    if start == 0:  # only its new tokens: causal over them (keys rounded through the cache's dtype, as read back)
        kb = k.to(keys.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vb = v.to(values.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
        a = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    else:
        index = gather[: start + n]
        kb = keys.index_select(0, index).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vb = values.index_select(0, index).to(q.dtype).transpose(0, 1).unsqueeze(0)
        seen = torch.arange(start + n, device=q.device) <= (start + torch.arange(n, device=q.device)).unsqueeze(1)
        a = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=seen, enable_gqa=True)
    return a[0].transpose(0, 1)


def prefill_layers(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[list[torch.Tensor]],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: torch.Tensor,
    gather: torch.Tensor,
    lengths: list[int],
    starts: list[int],
    heads: int,
    kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """h [N, d]: the real new tokens of B rows, row after row (`lengths` each, the first at position `starts`), through
    every layer of `weights` ([norm, qkv, o, norm, gate_up, down] each, fast_decode's layout); their keys and values
    written to `slots` of `keys`/`values` ([slots, kv_heads, head_dim] per layer); `gather` [B, L]: each row's slots;
    cos/sin [N, 1, head_dim]."""
    N = h.shape[0]
    D = keys[0].shape[-1]
    for i in range(len(weights)):
        w = weights[i]
        qkv = _product(_rms(h, w[0], eps), w[1], False).view(N, heads + 2 * kv_heads, D)
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads :]
        keys[i].index_copy_(0, slots, k.to(keys[i].dtype))
        values[i].index_copy_(0, slots, v.to(values[i].dtype))
        rows: list[torch.Tensor] = []
        offset = 0
        for b in range(len(lengths)):
            n = lengths[b]
            end = offset + n
            rows.append(_row_attention(q[offset:end], k[offset:end], v[offset:end], keys[i], values[i], gather[b], starts[b]))
            offset = end
        a = torch.cat(rows, dim=0).reshape(N, heads * D)
        h = h + _product(a, w[2], False)
        gate, up = _product(_rms(h, w[3], eps), w[4], False).chunk(2, dim=-1)
        h = h + _product(F.silu(gate) * up, w[5], False)
    return h


def packed_step(decoder: FusedDecoder, h: torch.Tensor, ctx: dict, layers: Sequence[int], storage: Any) -> torch.Tensor:
    """h [B, T, d] of a step of several new tokens per row through `layers` with the fused decoder's weights, only its
    real tokens computed (`prefill_layers`); [B, T, d] back, the padding positions zero (nothing reads them)."""
    step = ctx["cache"]
    valid = step.valid
    cos, sin = ctx["position_embeddings"]  # [B, T, head_dim] of the padded positions: the real ones are picked
    out = scripted(prefill_layers)(
        h[valid],
        cos[valid].unsqueeze(1),
        sin[valid].unsqueeze(1),
        [decoder.weights[i] for i in layers],
        [storage.keys[i] for i in layers],
        [storage.values[i] for i in layers],
        step.batch.slots,
        step.batch.gather,
        step.batch.lengths.tolist(),
        step.batch.positions[:, 0].tolist(),
        decoder.heads,
        decoder.kv_heads,
        decoder.eps,
    )
    return h.new_zeros(h.shape).index_put_((valid,), out)
