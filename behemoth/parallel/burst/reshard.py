"""Re-sharding a batch between two layer widths: rank r of a `source`-wide split sends each row to the rank of the
`target`-wide split that holds it (point to point over the job's group; rows a rank holds in both stay put)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from behemoth.comm import P2P, batch_p2p
from behemoth.parallel.burst.groups import BurstGroups, batch_rows

TIMEOUT_S = 120.0


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (max(a[0], b[0]), min(a[1], b[1]))


@dataclass(frozen=True)
class Rows:
    """What is re-sharded: a batch of `batch` rows, each of shape `tail` and `dtype`, on `device`."""

    batch: int
    tail: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def reshard(local: torch.Tensor | None, rows: Rows, source: int, target: int, groups: BurstGroups, *, tag: int = 0) -> torch.Tensor | None:
    """This rank's rows of the `target`-wide split, from `local`, its rows of the `source`-wide split (None outside
    it). Every rank of the job calls it; ranks in neither split return None at once."""
    rank, batch = groups.rank, rows.batch
    mine, wanted = batch_rows(batch, source, rank), batch_rows(batch, target, rank)
    if source == target:
        return local
    if mine == (0, 0) and wanted == (0, 0):
        return None
    out = torch.empty((wanted[1] - wanted[0], *rows.tail), dtype=rows.dtype, device=rows.device) if rank < target else None
    ops: list[P2P] = []
    for peer in range(groups.world):
        if peer == rank:
            continue
        give = _overlap(mine, batch_rows(batch, target, peer))
        if give[1] > give[0] and local is not None:
            ops.append(P2P(True, local[give[0] - mine[0] : give[1] - mine[0]].contiguous(), peer, tag))
        take = _overlap(batch_rows(batch, source, peer), wanted)
        if take[1] > take[0] and out is not None:
            ops.append(P2P(False, out[take[0] - wanted[0] : take[1] - wanted[0]], peer, tag))
    keep = _overlap(mine, wanted)
    if keep[1] > keep[0] and out is not None and local is not None:
        out[keep[0] - wanted[0] : keep[1] - wanted[0]] = local[keep[0] - mine[0] : keep[1] - mine[0]]
    for pending in batch_p2p(ops, groups.job):
        pending.wait(TIMEOUT_S)
    return out
