"""Ulysses (DeepSpeed) attention: an all-to-all turns sequence shards into head shards, every rank attends over the
whole sequence for H / C of the heads, and the reverse all-to-all turns the output back into sequence shards.

Grouped-query K/V heads travel as they are when C divides their number (rank r's query heads then use exactly rank
r's K/V heads); otherwise they are first repeated to one per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from behemoth.comm import CommMeter, all_to_all
from behemoth.parallel.context.kernels import expand_heads


@dataclass
class UlyssesComm:
    """The cp group for the all-to-alls."""

    group: dist.ProcessGroup
    meter: CommMeter = field(default_factory=CommMeter)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


def seq_to_heads(x: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:
    """[B, H, T/C, d] (this rank's tokens, every head) -> [B, H/C, T, d] (every token, this rank's heads)."""
    b, h, t, d = x.shape
    n = comm.size
    send = x.reshape(b, n, h // n, t, d).transpose(0, 1).contiguous()  # [dest rank, B, its heads, my tokens, d]
    got = torch.empty_like(send)
    all_to_all(got, send, comm.group, comm.meter)  # [source rank = its tokens, B, my heads, T/C, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def heads_to_seq(y: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:
    """The inverse: [B, H/C, T, d] -> [B, H, T/C, d]."""
    b, hl, t, d = y.shape
    n = comm.size
    send = y.reshape(b, hl, n, t // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [dest rank = its tokens, B, my heads, T/C, d]
    got = torch.empty_like(send)
    all_to_all(got, send, comm.group, comm.meter)  # [source rank = its heads, B, H/C, my tokens, d]
    return got.transpose(0, 1).reshape(b, hl * n, t // n, d)


class SeqToHeads(torch.autograd.Function):
    """seq_to_heads with heads_to_seq as its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return heads_to_seq(g.contiguous(), ctx.comm), None


class HeadsToSeq(torch.autograd.Function):
    """heads_to_seq with seq_to_heads as its backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, comm: UlyssesComm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return heads_to_seq(y, comm)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return seq_to_heads(g.contiguous(), ctx.comm), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: UlyssesComm, scale: float | None = None) -> torch.Tensor:
    """Causal attention of contiguous sequence shards [B, H, T/C, d], K/V [B, Hkv, T/C, d]; C divides H."""
    heads, kv_heads, n = q.shape[1], k.shape[1], comm.size
    if kv_heads % n:  # too few K/V heads to split: one per query head
        k, v = expand_heads(k, heads // kv_heads), expand_heads(v, heads // kv_heads)
    q2, k2, v2 = (SeqToHeads.apply(t, comm) for t in (q, k, v))
    groups = q2.shape[1] // k2.shape[1]
    y = F.scaled_dot_product_attention(q2, expand_heads(k2, groups), expand_heads(v2, groups), is_causal=True, scale=scale)
    return HeadsToSeq.apply(y, comm)
