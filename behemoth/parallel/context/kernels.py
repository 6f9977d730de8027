"""Attention of one query block against one key/value block, returning the log-sum-exp that merges blocks.

Ring attention computes a rank's attention one K/V block at a time and merges the partial results by their
log-sum-exp (the online softmax); its backward replays the blocks with the merged output and log-sum-exp, which is
what a flash-attention backward takes. On the CPU these are ATen's fused flash-attention kernels (memory linear in the
block length); elsewhere the same arithmetic written out (scores materialized per block).
"""

from __future__ import annotations

import math

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v over one block (causal: the block's own diagonal mask) and the rows' log-sum-exp [B, H, Tq]."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=_scale(q, scale))
        return out, lse.float()
    s = _scores(q, k, causal, _scale(q, scale))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None
) -> Grads:
    """Gradients of q, k, v through one block, given the merged output `out` and log-sum-exp `lse` of these queries."""
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(torch.float32), 0.0, causal, scale=_scale(q, scale)
        )
        return dq, dk, dv
    sc = _scale(q, scale)
    p = torch.exp(_scores(q, k, causal, sc) - lse.unsqueeze(-1))
    dout_f = dout.float()
    dv = p.transpose(-2, -1) @ dout_f
    dp = dout_f @ v.float().transpose(-2, -1)
    ds = p * (dp - (dout_f * out.float()).sum(-1, keepdim=True))
    dq, dk = (ds @ k.float()) * sc, (ds.transpose(-2, -1) @ q.float()) * sc
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, log-sum-exp) into the running float32 ones, in place: the online softmax."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query K/V heads repeated for the query heads they serve ([B, Hkv, T, d] -> [B, Hkv x groups, T, d])."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fold_heads(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_heads`: each K/V head's copies summed."""
    if groups == 1:
        return dx
    b, h, t, d = dx.shape
    return dx.view(b, h // groups, groups, t, d).sum(2)
