"""Flat layouts: a group of parameters laid end to end in one buffer, cut into equal rank shards.

A group (a gradient bucket at stages 1-2, a transformer block or the model's root at stage 3) is
flattened in a fixed order and padded with at most `world - 1` zero elements so that it splits into
`world` equal contiguous shards: rank r owns elements [r * S, (r + 1) * S). Equal shards are what
reduce-scatter and all-gather need, and contiguous ones let a gathered buffer hold every parameter
as a plain view. A rank's *pieces* are the parts of individual parameters that fall into its shard;
the optimizer steps them and checkpoints name them by parameter. Everything here is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into one rank's shard."""

    index: int  # the parameter's position in the group
    start: int  # first element held, in the parameter's flattened order
    stop: int  # one past the last element held
    shard_offset: int  # where `start` sits in the rank's shard

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Offsets of a group's parameters in one flat buffer padded to a multiple of `world`."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], world: int) -> None:
        if world < 1:
            raise ValueError(f"world size {world} must be >= 1")
        self.names, self.shapes, self.world = list(names), [tuple(s) for s in shapes], world
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.shard_size = -(-self.numel // world)
        self.padded = self.shard_size * world

    @property
    def padding(self) -> int:
        """Zero elements appended so that the buffer splits evenly (at most world - 1)."""
        return self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[Piece]:
        """This rank's non-empty parts of each parameter, in buffer order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                out.append(Piece(i, start - offset, stop - offset, start - lo))
        return out

    def split_sizes(self) -> list[int]:
        """Sizes that cut the padded buffer into each parameter and the trailing padding."""
        return self.numels + [self.padding]
