"""Which tokens of a sequence each context-parallel rank holds, and at which global positions.

Ring attention under a causal mask does unequal work on contiguous shards (the last rank's queries see every key,
the first rank's only its own), so the ring layout cuts the sequence into 2C chunks and gives rank i chunks i and
2C-1-i: every rank then holds one early and one late chunk and computes the same number of query-key blocks.
Ulysses gathers the whole sequence for its heads before attending, so it keeps contiguous shards (rank i: chunk i of C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from behemoth.errors import BehemothError


@dataclass(frozen=True)
class ContextLayout:
    """The token layout of one sequence over `cp` ranks: `balanced` (ring: chunks i and 2C-1-i) or contiguous."""

    cp: int
    rank: int
    balanced: bool

    @property
    def pieces(self) -> int:
        """Chunks the sequence is cut into: 2C (balanced) or C."""
        return 2 * self.cp if self.balanced else self.cp

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunk indices a rank holds, in the order its local tokens keep them."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.cp - 1 - r) if self.balanced else (r,)

    def check(self, seq_len: int) -> int:
        """The chunk length; a sequence that does not cut into `pieces` equal chunks is refused."""
        if seq_len % self.pieces:
            mode = "ring attention's 2 x cp" if self.balanced else "cp"
            raise BehemothError(
                f"train.seq_len={seq_len} does not split into {mode} = {self.pieces} equal chunks",
                f"use a seq_len that is a multiple of {self.pieces}",
            )
        return seq_len // self.pieces

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """The global positions (0 .. seq_len-1) of this rank's tokens, in local order: [seq_len / cp]."""
        c = self.check(seq_len)
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks()])

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of `x` [batch, seq_len, ...] (dimension 1 is the sequence)."""
        c = self.check(x.shape[1])
        return torch.cat([x[:, k * c : (k + 1) * c] for k in self.chunks()], dim=1)

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole sequence from every rank's shard (`parts[r]`: rank r's tokens, [batch, seq_len / cp, ...])."""
        pieces: list[torch.Tensor | None] = [None] * self.pieces
        for r, part in enumerate(parts):
            for j, k in enumerate(self.chunks(r)):
                c = part.shape[1] // len(self.chunks(r))
                pieces[k] = part[:, j * c : (j + 1) * c]
        return torch.cat([p for p in pieces if p is not None], dim=1)
