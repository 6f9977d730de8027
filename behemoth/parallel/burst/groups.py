"""The sub-meshes of a burst plan: one process group per distinct layer width, the first `width` ranks of the job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from behemoth.comm import all_reduce


def batch_rows(batch: int, width: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of a `batch` that rank `rank` of a `width`-wide group holds (empty outside the group)."""
    if rank >= width:
        return (0, 0)
    return (rank * batch // width, (rank + 1) * batch // width)


@dataclass
class BurstGroups:
    """This rank, the job's group, and a group for each width (ranks 0 .. width-1), created in the same order on every
    rank (c10d's rule for new_group) and warmed up with one tiny all-reduce so the first real one fails fast if broken.

    A width strictly between 1 and the world also gets the group of the other ranks (width .. world-1), so that every
    rank is a member of as many process groups as every other: c10d names a group made later with
    `use_local_synchronization=True` (the checkpoint saver's) by its ranks and the number of groups *this* rank belongs
    to, and with uneven memberships the ranks derive different names, so their rendezvous never meets (4 gloo ranks,
    widths 2 and 3: ranks 0, 1, 2, 3 in 3, 3, 2, 1 groups, each waiting under its own prefix)."""

    rank: int
    world: int
    job: dist.ProcessGroup = field(repr=False)
    by_width: dict[int, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)
    others: dict[int, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)  # width -> ranks width .. world-1

    @classmethod
    def of(cls, widths: Sequence[int], job: dist.ProcessGroup, device: torch.device) -> BurstGroups:
        rank, world = dist.get_rank(job), dist.get_world_size(job)
        members = dist.get_process_group_ranks(job)
        out = cls(rank, world, job)
        for width in sorted(set(widths)):
            if width == world:
                out.by_width[width] = job
                continue
            group = dist.new_group(members[:width]) if width > 1 else None
            out.by_width[width] = group if rank < width else None
            if width > 1:  # the rest of the job: an equal count of memberships on every rank (see the class)
                rest = dist.new_group(members[width:])
                out.others[width] = rest if rank >= width else None
        for width, group in sorted(out.by_width.items()):
            if group is not None and width > 1:
                all_reduce(torch.zeros(1, device=device), group)
        return out

    def group(self, width: int) -> dist.ProcessGroup | None:
        """The group of `width` ranks this rank belongs to, or None (not a member, or a group of one)."""
        return self.by_width.get(width) if self.rank < width else None
