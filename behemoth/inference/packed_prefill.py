"""A step of several new tokens per row (prefill, chunked prefill, speculative checks) packed: no padding computed.

A step's rows are right-padded to the longest row's new tokens (`StepBatch`); the model's own blocks then run every
product over B x T positions, of which a batch of 32 bench prompts (62 to 197 tokens) leaves about a third padding.
`prefill_layers` runs the same arithmetic as `LlamaDecoderLayer` (fast_decode.py's, with its fused [in, out] weights)
on the N real tokens alone, packed row after row into [N, d]: every product and elementwise op runs over N rows. Only
attention (a small part of a prefill's work at these lengths) runs over the rows padded back to T, in one SDPA call per
layer (one call per row served slower in one loaded run at two threads: many small ops, each a barrier of both
threads): rows that all start at position 0 attend causally to their own new keys (no gather, no mask); a step with
cached positions (a later prefill chunk, a prefix-cache hit, a speculative check) gathers every row's slots and
attends under the step's mask (a new token at position p sees positions 0..p of its row). The keys and values are
written to and read back in the cache's dtype, as the blocks' path does. Outside attention a step runs `TILE` tokens at
a time, so that a large prefill's intermediates (norms, products, SwiGLU) stay in the CPU's caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from behemoth.inference.fast_decode import FusedDecoder, _product, _rms, _rotate, scripted


def _padded(x: torch.Tensor, where: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, heads, T, D]: packed rows x [N, heads, D] put back at their positions `where` of B x T (zeros between)."""
    return x.new_zeros(B * T, x.shape[1], x.shape[2]).index_copy_(0, where, x).view(B, T, x.shape[1], x.shape[2]).transpose(1, 2)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    where: torch.Tensor,
    gather: torch.Tensor,
    mask: torch.Tensor | None,
    T: int,
) -> torch.Tensor:
    """[N, heads, D]: attention of the packed new queries q [N, heads, D] (their keys and values k, v [N, kv_heads, D]
    already in the cache) as one SDPA call over the rows padded to T. `mask` None: every row starts at position 0, so
    it attends causally to its own new keys (rounded through the cache's dtype, as read back); else [B, 1, T, L]: the
    rows attend to their cached slots `gather` [B, L] (earlier chunks, a cached prefix) under it."""
    B, L = gather.shape[0], gather.shape[1]
    qp = _padded(q, where, B, T)
    if mask is None:
        kp = _padded(k.to(keys.dtype).to(q.dtype), where, B, T)
        vp = _padded(v.to(values.dtype).to(q.dtype), where, B, T)
        a = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    else:
        flat = gather.reshape(-1)
        kp = keys.index_select(0, flat).view(B, L, keys.shape[1], keys.shape[2]).transpose(1, 2).to(q.dtype)
        vp = values.index_select(0, flat).view(B, L, values.shape[1], values.shape[2]).transpose(1, 2).to(q.dtype)
        a = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
    return a.transpose(1, 2).reshape(B * T, q.shape[1], q.shape[2]).index_select(0, where)


def prefill_layers(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[list[torch.Tensor]],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: torch.Tensor,
    where: torch.Tensor,
    gather: torch.Tensor,
    mask: torch.Tensor | None,
    T: int,
    heads: int,
    kv_heads: int,
    eps: float,
    onednn: bool,
    tile: int,
) -> torch.Tensor:
    """h [N, d]: the real new tokens of B rows, row after row (`where`: their flat positions in the step's B x T), through
    every layer of `weights` ([norm, qkv, o, norm, gate_up, down] each, fast_decode's layout); their keys and values
    written to `slots` of `keys`/`values` ([slots, kv_heads, head_dim] per layer); `gather` [B, L]: each row's slots,
    attended under `mask` (None: every row starts at position 0, `_attention`); cos/sin [N, 1, head_dim]. Everything
    but attention runs `tile` tokens at a time (`TILE`): each token's arithmetic is its own, and a tile's intermediates
    stay in the CPU's caches (the gate/up product of a 3,800-token prefill is 42 MB)."""
    N = h.shape[0]
    D = keys[0].shape[-1]
    for i in range(len(weights)):
        w = weights[i]
        q, k, v = h.new_empty(N, heads, D), h.new_empty(N, kv_heads, D), h.new_empty(N, kv_heads, D)
        for s in range(0, N, tile):
            e = min(N, s + tile)
            qkv = _product(_rms(h[s:e], w[0], eps), w[1], False, onednn).view(e - s, heads + 2 * kv_heads, D)
            qk = _rotate(qkv[:, : heads + kv_heads], cos[s:e], sin[s:e])
            q[s:e], k[s:e], v[s:e] = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        keys[i].index_copy_(0, slots, k.to(keys[i].dtype))
        values[i].index_copy_(0, slots, v.to(values[i].dtype))
        a = _attention(q, k, v, keys[i], values[i], where, gather, mask, T).reshape(N, heads * D)
        out = torch.empty_like(h)
        for s in range(0, N, tile):
            e = min(N, s + tile)
            x = h[s:e] + _product(a[s:e], w[2], False, onednn)
            gate, up = _product(_rms(x, w[3], eps), w[4], False, onednn).chunk(2, dim=-1)
            out[s:e] = x + _product(F.silu(gate) * up, w[5], False, onednn)
        h = out
    return h


TILE = 512  # tokens of a packed step computed at a time outside attention: measured on 32 prompts of 60-200 tokens
# (3,799 in all, 25M Llama, 2 threads), the prefill took 0.65-0.68 s in tiles of 256-1,024 tokens against 0.93-1.04 s
# whole (the same tokens)


def packed_step(decoder: FusedDecoder, h: torch.Tensor, ctx: dict, layers: Sequence[int], storage: Any) -> torch.Tensor:
    """h [B, T, d] of a step of several new tokens per row through `layers` with the fused decoder's weights, only its
    real tokens computed (`prefill_layers`); [B, T, d] back, the padding positions zero (nothing reads them). A step of
    `ONEDNN_PACKED_MIN` tokens or more runs its products by oneDNN on CPUs (about 2x MKL's rate on this project's AMD
    CPU); a smaller one keeps F.linear: oneDNN builds a kernel for every new number of rows (0.2-0.4 ms a product the
    first time), which a chunked-prefill step of 20-40 tokens, a new count at nearly every step, would pay each time."""
    step = ctx["cache"]
    valid = step.valid
    cos, sin = ctx["position_embeddings"]  # [B, T, head_dim] of the padded positions: the real ones are picked
    tokens = int(valid.sum())
    onednn = decoder.by_onednn(h, tokens, True)
    out = scripted(prefill_layers)(
        h[valid],
        cos[valid].unsqueeze(1),
        sin[valid].unsqueeze(1),
        [decoder.layer_weights(i, tokens, onednn) for i in layers],
        [storage.keys[i] for i in layers],
        [storage.values[i] for i in layers],
        step.batch.slots,
        valid.reshape(-1).nonzero()[:, 0],
        step.batch.gather,
        ctx["attention_mask"] if bool(step.batch.positions[:, 0].any()) else None,
        h.shape[1],
        decoder.heads,
        decoder.kv_heads,
        decoder.eps,
        onednn,
        TILE,
    )
    return h.new_zeros(h.shape).index_put_((valid,), out)
