"""Decode lanes: each decoding request's keys and values also kept dense, so a decode step attends without a gather.

A decode step of B requests attends, at every layer, to each request's cached keys and values. The paged cache holds
them in blocks scattered over its slots, so the step first copies them into a dense [B, L] tensor (`index_select`)
and attention then reads that copy: at 32 requests of about 200 positions the 25M Llama's step spent 5 of its 23 ms
in that copy, every step, for keys and values that changed by one token since the last one. A lane is a dense row
[positions, kv_heads, head_dim] per layer holding one request's keys and values in order: filled once from the cache
when the request starts decoding, then extended by the step itself (the new token's key and value go to the cache and
to its lane), so later steps attend to the lanes in place. Lanes are owned by (request id, epoch): a preempted
request comes back with a new epoch (its keys and values recomputed or restored), so its old lane is never read. A
lane whose request is not in a decode step is given back (it would be one token behind); so is every lane when the
cache's bytes could not hold the lanes of a step (`limit_bytes`): the step then gathers as before.

The tokens are those of the gather path exactly: the lanes hold the same values (copied, not recomputed), and
attention runs over them under the same positions; lanes of other requests in the step's range are masked to their
first position (an SDPA row with nothing to attend to would be undefined) and their outputs dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

GROW = 64  # a lane's positions grow in steps of this many


@dataclass(frozen=True)
class LaneStep:
    """What one decode step reads from and writes to the lanes: each row's lane and position (its new token's), the
    lanes the step's attention covers (0..lanes-1), their positions attended (0..positions-1) and the mask over them;
    `in_order`: row b is lane b for every row and no other lane is covered (no scatter, no mask for other lanes)."""

    lane: torch.Tensor  # [B]
    position: torch.Tensor  # [B]
    lanes: int
    positions: int
    mask: torch.Tensor  # [lanes, 1, 1, positions] bool
    in_order: bool


class DecodeLanes:
    """Dense per-request keys and values of `layers`, as many lanes of as many positions as decode steps need (grown in
    steps of 8 lanes; positions to the next multiple of `GROW`, at least doubled while that fits), within `limit_bytes`."""

    def __init__(self, layers: Sequence[int], kv_heads: int, head_dim: int, limit_bytes: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim, self.count = list(layers), kv_heads, head_dim, 0
        self.limit_bytes, self.dtype, self.device = limit_bytes, dtype, device
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.owner: list[Hashable | None] = []
        self.length: list[int] = []  # positions each lane holds
        self.fills = 0  # lanes filled from the cache (a request starting to decode, or back after a gap)

    def bytes_for(self, count: int, capacity: int) -> int:
        return 2 * len(self.layers) * count * capacity * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def release_all(self) -> None:
        self.owner = [None] * self.count
        self.length = [0] * self.count

    def _grow(self, rows: int, positions: int) -> bool:
        """Room for `rows` lanes of `positions` each (content kept); False where that would pass the byte limit."""
        if rows <= self.count and positions <= self.capacity:
            return True
        count, capacity = max(self.count, -(-rows // 8) * 8), max(self.capacity, -(-positions // GROW) * GROW)
        if self.bytes_for(count, capacity) > self.limit_bytes:
            return False
        if capacity > self.capacity and self.bytes_for(count, 2 * self.capacity) <= self.limit_bytes:
            capacity = max(capacity, 2 * self.capacity)  # positions double: a growth copies every lane, so grow rarely
        shape = (count, capacity, self.kv_heads, self.head_dim)
        for store in (self.keys, self.values):
            for layer in self.layers:
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer in store:
                    new[: self.count, : self.capacity] = store[layer]
                store[layer] = new
        self.owner += [None] * (count - self.count)
        self.length += [0] * (count - self.count)
        self.count, self.capacity = count, capacity
        return True

    def plan(self, owners: Sequence[Hashable], gather: torch.Tensor, positions: torch.Tensor, storage: object) -> LaneStep | None:
        """The lanes of a decode step whose row b is request `owners[b]` adding its token at `positions[b]` and attending
        to the slots `gather[b, :positions[b] + 1]`: lanes kept from the last step where they hold every earlier
        position, others filled from `storage` (the paged cache). None (and every lane given back) where the step's
        rows or positions do not fit the lanes."""
        pos = [int(p) for p in positions.tolist()]
        B = len(owners)
        if len(set(owners)) < B or not self._grow(B, max(pos) + 1):
            self.release_all()
            return None
        held = {owner: lane for lane, owner in enumerate(self.owner) if owner is not None}
        lane_of: list[int | None] = []
        for owner, p in zip(owners, pos):
            lane = held.get(owner)
            lane_of.append(lane if lane is not None and self.length[lane] == p else None)
        kept = {lane for lane in lane_of if lane is not None}
        for lane in range(self.count):  # a lane whose request is not in this step, or fell behind, is given back
            if lane not in kept:
                self.owner[lane], self.length[lane] = None, 0
        free = iter(lane for lane in range(self.count) if lane not in kept)
        fill_rows = [b for b in range(B) if lane_of[b] is None]
        for b in fill_rows:
            lane_of[b] = next(free)
        if fill_rows:
            self._fill([(lane_of[b], gather[b, : pos[b]]) for b in fill_rows], storage)  # type: ignore[misc]
        lanes = [int(lane) for lane in lane_of]  # type: ignore[arg-type]
        for b, lane in enumerate(lanes):
            self.owner[lane], self.length[lane] = owners[b], pos[b] + 1
        covered, width = max(lanes) + 1, max(pos) + 1
        attended = torch.zeros(covered, dtype=torch.long)
        attended[torch.tensor(lanes)] = torch.tensor(pos) + 1
        mask = torch.arange(width).unsqueeze(0) < attended.clamp(min=1).unsqueeze(1)  # others: position 0 only
        device = self.device
        return LaneStep(
            torch.tensor(lanes, device=device),
            torch.tensor(pos, device=device),
            covered,
            width,
            mask.view(covered, 1, 1, width).to(device),
            lanes == list(range(B)),
        )

    def _fill(self, rows: list[tuple[int, torch.Tensor]], storage: object) -> None:
        """Copy each (lane, slots) row's cached keys and values into positions 0.. of its lane, every layer at once."""
        rows = [(lane, slots) for lane, slots in rows if slots.numel()]
        if not rows:
            return
        slots = torch.cat([s for _, s in rows]).to(self.device)
        lane = torch.cat([torch.full((s.numel(),), lane, dtype=torch.long) for lane, s in rows]).to(self.device)
        position = torch.cat([torch.arange(s.numel()) for _, s in rows]).to(self.device)
        for layer in self.layers:
            for store, lanes in ((storage.keys[layer], self.keys[layer]), (storage.values[layer], self.values[layer])):  # type: ignore[attr-defined]
                lanes.index_put_((lane, position), store.index_select(0, slots).to(self.dtype))
        self.fills += len(rows)
