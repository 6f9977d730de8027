"""Which part of a stacked expert weight a rank holds, and how that part is checkpointed under single-process names.

A stacked weight ([E, F, d] or [E, d, F], models/moe.py) is split over the `ep` ranks along the experts
(rank j keeps experts [j E/ep, (j + 1) E/ep)) and, under tensor parallelism, along the expert's MLP width
over the `tp` ranks (Megatron's column split of `w_in`, each of [gate | up] separately when gated; the row
split of `w_out`). The part is a few boxes of the full tensor (one, or one per packed segment);
`materialize` draws the full tensor from (seed, name) and keeps them (`take_local`), and `boxes` describes them
to DCP at their full-tensor offsets (`behemoth.parallel.chunked.checkpoint_views`), whole or as ZeRO's chunks of
them, so a checkpoint written at ep = 4 loads at ep = 2 or 1 and `behemoth export` consolidates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from behemoth.parallel.chunked import Box, narrow_box

EXPERT_LAYOUT = "_behemoth_expert_layout"  # on a parameter holding part of a stacked expert weight


@dataclass(frozen=True)
class ExpertShard:
    """A rank's part of one stacked expert weight: experts [first, first + count), and pieces of the width dimension."""

    full_shape: tuple[int, ...]
    first: int
    count: int
    width_dim: int | None = None  # the dimension split over tp (None: whole)
    width_pieces: tuple[tuple[int, int, int], ...] = ()  # (full start, local start, length) along it

    @classmethod
    def of(
        cls, full_shape: tuple[int, ...], *, ep: int, ep_rank: int, tp: int = 1, tp_rank: int = 0, width_dim: int | None = None, parts: int = 1
    ) -> ExpertShard:
        """Experts split evenly over ep; with tp > 1 dimension `width_dim` split over tp, each of `parts` segments apart."""
        count = full_shape[0] // ep
        if tp == 1 or width_dim is None:
            return cls(tuple(full_shape), ep_rank * count, count)
        segment = full_shape[width_dim] // parts
        chunk = segment // tp
        pieces = tuple((p * segment + tp_rank * chunk, p * chunk, chunk) for p in range(parts))
        return cls(tuple(full_shape), ep_rank * count, count, width_dim, pieces)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = [self.count, *self.full_shape[1:]]
        if self.width_dim is not None:
            shape[self.width_dim] = sum(length for _, _, length in self.width_pieces)
        return tuple(shape)

    def boxes(self) -> list[Box]:
        """The part as boxes of the full tensor and of the local one."""
        rank = len(self.full_shape)
        base_full, base_local = [self.first] + [0] * (rank - 1), [0] * rank
        sizes = list(self.local_shape)
        if self.width_dim is None:
            return [(tuple(base_full), tuple(base_local), tuple(sizes))]
        out = []
        for start, local, length in self.width_pieces:
            full, loc, size = list(base_full), list(base_local), list(sizes)
            full[self.width_dim], loc[self.width_dim], size[self.width_dim] = start, local, length
            out.append((tuple(full), tuple(loc), tuple(size)))
        return out

    def take_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor."""
        out = full.new_empty(self.local_shape)
        for f, l, size in self.boxes():
            narrow_box(out, l, size).copy_(narrow_box(full, f, size))
        return out
