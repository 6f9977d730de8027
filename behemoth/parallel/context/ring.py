"""Ring attention over load-balanced causal chunks (rank i holds chunks i and 2C-1-i of 2C).

Forward: C steps; at step s this rank holds the keys and values of rank j = i - s (mod C) and, while it attends
to them, already sends them on to rank i+1 and receives rank j-1's from rank i-1. Which query chunks see which key
chunks follows from the chunk indices alone: step 0 is the local causal attention (both diagonals, and the late
chunk over the early one); for j < i every local query sees j's early chunk and nothing of its late one; for j > i
only the local late chunk sees anything, and it sees both of j's chunks. So every step after the first is half a
local block of work, on every rank. Partial results merge by their log-sum-exp (kernels.merge).

Backward runs the same ring with the merged output and log-sum-exp: the query gradient stays here, and each K/V
block's gradient travels with it around the ring, accumulated by every rank that attended to it, and arrives back at
its owner one hop after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from behemoth.comm import P2P, CommMeter, Pending, batch_p2p
from behemoth.parallel.context.kernels import block_backward, block_forward, expand_heads, fold_heads, merge

KV_TAG, GRAD_TAG = 71, 72


@dataclass
class RingComm:
    """The cp group as a ring: this rank sends to rank+1 and receives from rank-1 (ranks of the group)."""

    group: dist.ProcessGroup
    meter: CommMeter = field(default_factory=CommMeter)
    timeout_s: float | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def start(self, tensor: torch.Tensor, tag: int) -> InFlight:
        """Send `tensor` to the next rank and receive the previous rank's into a new buffer, asynchronously."""
        got = torch.empty_like(tensor)
        ops = [P2P(True, tensor, (self.rank + 1) % self.size, tag), P2P(False, got, (self.rank - 1) % self.size, tag)]
        return InFlight(got, batch_p2p(ops, self.group, self.meter), self.timeout_s)


@dataclass
class InFlight:
    """A ring exchange under way: `finish` waits for it and returns what arrived."""

    got: torch.Tensor
    pending: list[Pending]
    timeout_s: float | None

    def finish(self) -> torch.Tensor:
        for p in self.pending:
            p.wait(self.timeout_s)
        return self.got


def _step_kind(i: int, j: int) -> str:
    """Which block a step computes: `diag` (own chunks, causal), `early` (all queries x j's early chunk), `late`
    (the late query chunk x both of j's chunks)."""
    return "diag" if i == j else ("early" if j < i else "late")


STEP_BLOCKS = {"diag": (2, 2, True), "early": (2, 1, False), "late": (1, 2, False)}  # (query chunks, key chunks, causal)


def ring_steps(size: int, rank: int) -> list[tuple[int, int, bool]]:
    """(query chunks, key chunks, causal mask) of the block each of the `size` ring steps of `rank` attends (the
    forward's and the backward's, a chunk being seq_len / 2C tokens): what the planner prices the ring by."""
    return [STEP_BLOCKS[_step_kind(rank, (rank - s) % size)] for s in range(size)]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's two chunks against the whole sequence's keys and values, by the ring."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingComm, scale: float | None) -> torch.Tensor:  # noqa: ANN001
        size, i, c, groups = ring.size, ring.rank, q.shape[2] // 2, q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for s in range(size):
            nxt = ring.start(kv, KV_TAG) if s < size - 1 else None
            kk, vv, kind = expand_heads(kv[0], groups), expand_heads(kv[1], groups), _step_kind(i, (i - s) % size)
            if kind == "diag":
                merge(out, lse, *block_forward(q, kk, vv, True, scale))
            elif kind == "early":
                merge(out, lse, *block_forward(q, kk[:, :, :c], vv[:, :, :c], False, scale))
            else:
                late_out, late_lse = block_forward(q[:, :, c:].contiguous(), kk, vv, False, scale)
                merge(out[:, :, c:], lse[:, :, c:], late_out, late_lse)
            kv = nxt.finish() if nxt is not None else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        size, i, c, groups = ring.size, ring.rank, q.shape[2] // 2, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the held K/V block's gradient so far
        grads_in: InFlight | None = None  # the previous rank's accumulator for the block that arrives next
        for s in range(size):
            nxt = ring.start(kv, KV_TAG) if s < size - 1 else None
            kind = _step_kind(i, (i - s) % size)
            dq_part, dk, dv = _block_grads(kind, dout, q, kv, out, lse, c, groups, scale)
            dkv = grads_in.finish() if grads_in is not None else dkv
            if kind == "late":
                dq[:, :, c:] += dq_part
                dkv[0] += dk
                dkv[1] += dv
            else:
                dq += dq_part
                dkv[0, :, :, : dk.shape[2]] += dk
                dkv[1, :, :, : dv.shape[2]] += dv
            grads_in = ring.start(dkv, GRAD_TAG)
            kv = nxt.finish() if nxt is not None else kv
        assert grads_in is not None  # the ring has at least one step
        dkv = grads_in.finish()  # this rank's own block, every rank's contribution added
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _block_grads(
    kind: str, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, c: int, groups: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's gradients: of the queries it used, and of the K/V rows it attended to (folded to the K/V heads)."""
    kk, vv = expand_heads(kv[0], groups), expand_heads(kv[1], groups)
    if kind == "diag":
        dq, dk, dv = block_backward(dout, q, kk, vv, out, lse, True, scale)
    elif kind == "early":
        dq, dk, dv = block_backward(dout, q, kk[:, :, :c].contiguous(), vv[:, :, :c].contiguous(), out, lse, False, scale)
    else:
        late = (dout[:, :, c:].contiguous(), q[:, :, c:].contiguous(), kk, vv, out[:, :, c:].contiguous(), lse[:, :, c:].contiguous())
        dq, dk, dv = block_backward(*late[:4], late[4], late[5], False, scale)
    return dq, fold_heads(dk.float(), groups), fold_heads(dv.float(), groups)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingComm, scale: float | None = None) -> torch.Tensor:
    """Causal attention [B, H, 2c, d] of this rank's chunks i and 2C-1-i, K/V [B, Hkv, 2c, d] (Hkv divides H)."""
    return RingAttention.apply(q, k, v, ring, scale)
