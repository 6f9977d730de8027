"""A paged key/value cache (vLLM's PagedAttention layout): fixed-size blocks, a block table per sequence.

The cache is split in two, so that several ranks can share one scheduler:

- `BlockAllocator` (on the rank that schedules) owns the bookkeeping: a free list of block ids, each
  sequence's block table and length. A sequence takes blocks as it grows and gives them all back
  when it ends, is preempted or its client disconnects.
- `KVStorage` (on every rank) holds the tensors: per layer this rank runs, `num_blocks x block_size`
  slots of [kv_heads, head_dim] (its own heads under tensor parallelism, its own layers under a pipeline).

`plan_step` turns "these sequences, these new tokens" into a `StepBatch`: plain tensors (token ids,
positions, the slot of each new token, the slots every row attends to) that any rank can run against
its storage without knowing the block tables. `plan_packed_step` puts every sequence's new tokens in one row
(`PackedRows`: a mask keeps each sequence to its own keys), so a chunk of a long prompt and many one-token
decodes share one forward without padding (chunked prefill's mixed steps: the weights are read once).
`CacheStep` is that batch bound to a rank's storage; it
is the `KVCacheStep` the models' cached forward hands its keys and values to (models/layered.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from behemoth.errors import BehemothError


@dataclass(frozen=True)
class CacheLayout:
    """The shape of one rank's paged cache."""

    layers: tuple[int, ...]  # the layer indices this rank runs
    kv_heads: int  # key/value heads this rank holds
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise BehemothError(
                f"a paged KV cache of {self.num_blocks} blocks of {self.block_size} tokens", "use a block size and a block count of at least 1"
            )

    @property
    def bytes_per_block(self) -> int:
        """Keys and values of one block over every layer this rank holds."""
        return 2 * len(self.layers) * self.block_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    """How many blocks fit in `memory_bytes` (at least one)."""
    return max(1, memory_bytes // max(1, bytes_per_block))


class BlockAllocator:
    """The free list, a block table and a length per sequence: which slots each sequence's tokens occupy."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[Any, list[int]] = {}
        self.lengths: dict[Any, int] = {}

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_to_grow(self, seq: Any, new_length: int) -> int:
        """Blocks `seq` must take to hold `new_length` tokens."""
        return max(0, math.ceil(new_length / self.block_size) - len(self.tables.get(seq, ())))

    def can_grow(self, seq: Any, new_length: int) -> bool:
        return self.blocks_to_grow(seq, new_length) <= len(self.free)

    def grow(self, seq: Any, new_length: int) -> None:
        """Give `seq` the blocks it needs for `new_length` tokens (a new sequence starts with an empty table)."""
        need = self.blocks_to_grow(seq, new_length)
        if need > len(self.free):
            raise BehemothError(f"the KV cache has {len(self.free)} free blocks, a sequence needs {need}", "free sequences first")
        table = self.tables.setdefault(seq, [])
        table.extend(self.free.pop() for _ in range(need))
        self.lengths[seq] = new_length

    def release(self, seq: Any) -> int:
        """Return every block of `seq` to the free list; how many."""
        table = self.tables.pop(seq, [])
        self.lengths.pop(seq, None)
        self.free.extend(reversed(table))
        return len(table)

    def slots(self, seq: Any, start: int, stop: int) -> torch.Tensor:
        """Flat slot indices of positions [start, stop) of `seq`."""
        return self.slot_table([seq], stop)[0, start:]

    def slot_table(self, seqs: list[Any], length: int) -> torch.Tensor:
        """[len(seqs), length]: the flat slot of positions 0..length - 1 of each sequence, in one indexing (positions past a
        sequence's blocks read block 0's slots: the caller masks them)."""
        blocks = -(-length // self.block_size)
        tables = [self.tables[s][:blocks] for s in seqs]
        table = torch.tensor([t + [0] * (blocks - len(t)) for t in tables], dtype=torch.long)
        pos = torch.arange(length)
        return table[:, pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass(frozen=True)
class PackedRows:
    """Several sequences' new tokens packed into row 0 of a StepBatch: which sequence each new token (query) and each
    attended slot (key) belongs to, each key's position, and where each sequence's last new token sits in the row."""

    query_rows: torch.Tensor  # [T] the sequence of each new token
    key_rows: torch.Tensor  # [L] the sequence of each attended slot
    key_positions: torch.Tensor  # [L] the position of each attended slot in its sequence
    ends: torch.Tensor  # [R] the column of each sequence's last new token

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(*(t.to(device) for t in (self.query_rows, self.key_rows, self.key_positions, self.ends)))


@dataclass
class StepBatch:
    """One forward of new tokens for B sequences, as plain tensors (picklable; sent as is to other ranks).

    Rows are right-padded to T new tokens; `lengths` says how many are real. Padding tokens sit at
    position 0, write nothing and attend to position 0 only; their outputs are never read.
    """

    ids: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B] new tokens per row
    slots: torch.Tensor  # [N] the slot of every real new token, row by row
    gather: torch.Tensor  # [B, L] the slot of every position a row attends to (0 past its end)
    adapters: torch.Tensor | None = None  # [B] each row's LoRA adapter slot (lora_bank.py; 0: the base), None: all base
    packed: PackedRows | None = None  # several sequences in row 0 (plan_packed_step), None: a sequence per row
    owners: tuple[Any, ...] | None = None  # each row's request and its epoch, for decode lanes (decode_lanes.py); None: unknown

    @property
    def valid(self) -> torch.Tensor:
        return torch.arange(self.ids.shape[1]) < self.lengths.unsqueeze(1)

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """[B, 1, T, L]: a new token at position p attends to positions 0..p of its own sequence."""
        queries = self.positions.to(device).unsqueeze(-1)
        if self.packed is None:
            return (torch.arange(self.gather.shape[1], device=device) <= queries).unsqueeze(1)
        p = self.packed.to(device)
        return ((p.key_positions <= queries) & (p.key_rows == p.query_rows.unsqueeze(-1))).unsqueeze(1)

    def key_positions(self, device: torch.device) -> torch.Tensor:
        """[B or 1, L]: the position in its sequence of every attended slot (a sliding window's mask needs it)."""
        if self.packed is None:
            return torch.arange(self.gather.shape[1], device=device).unsqueeze(0)
        return self.packed.key_positions.to(device).unsqueeze(0)

    def last_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) of each sequence's last new token: where its next token's logits come from."""
        if self.packed is None:
            return torch.arange(self.ids.shape[0]), self.lengths - 1
        return torch.zeros_like(self.packed.ends), self.packed.ends

    def to(self, device: torch.device) -> StepBatch:
        adapters = None if self.adapters is None else self.adapters.to(device)
        packed = None if self.packed is None else self.packed.to(device)
        ids, positions, lengths, slots, gather = (t.to(device) for t in (self.ids, self.positions, self.lengths, self.slots, self.gather))
        return StepBatch(ids, positions, lengths, slots, gather, adapters=adapters, packed=packed, owners=self.owners)


def plan_step(
    alloc: BlockAllocator, rows: list[tuple[Any, list[int], int]], adapters: list[int] | None = None, owners: list[Any] | None = None
) -> StepBatch:
    """The batch that runs `rows` = (sequence, new token ids, position of the first) with their slots (and each row's
    adapter slot, when any is not the base; each row's owner for decode lanes, when given); every sequence must
    already hold blocks for its new length (`BlockAllocator.grow`)."""
    if not rows:
        raise ValueError("a step needs at least one sequence")
    T = max(len(tokens) for _, tokens, _ in rows)
    L = max(start + len(tokens) for _, tokens, start in rows)
    for seq, tokens, start in rows:
        if alloc.lengths.get(seq, -1) < start + len(tokens):
            raise ValueError(f"sequence {seq!r} holds {alloc.lengths.get(seq, 0)} positions, the step writes up to {start + len(tokens)}")
    counts = torch.tensor([len(tokens) for _, tokens, _ in rows], dtype=torch.long)
    starts = torch.tensor([start for _, _, start in rows], dtype=torch.long)
    ids = torch.tensor([tokens + [0] * (T - len(tokens)) for _, tokens, _ in rows], dtype=torch.long)
    new = torch.arange(T).unsqueeze(0) < counts.unsqueeze(1)  # [B, T]: real new tokens
    positions = (starts.unsqueeze(1) + torch.arange(T)) * new
    gather = alloc.slot_table([seq for seq, _, _ in rows], L)  # [B, L]: every row's slots, position by position
    held = torch.arange(L).unsqueeze(0) < (starts + counts).unsqueeze(1)
    gather *= held  # positions past a row's end read slot 0 (masked)
    written = held & (torch.arange(L).unsqueeze(0) >= starts.unsqueeze(1))  # each row's new positions, row after row
    rows_adapters = torch.tensor(adapters, dtype=torch.long) if adapters is not None and any(adapters) else None
    return StepBatch(ids, positions, counts, gather[written], gather, rows_adapters, owners=None if owners is None else tuple(owners))


def plan_packed_step(alloc: BlockAllocator, rows: list[tuple[Any, list[int], int]]) -> StepBatch:
    """`plan_step`'s rows packed into one row of their new tokens, attending to the concatenation of their slots
    (`PackedRows`); the model's logits come back for each sequence's last new token, as with `plan_step`."""
    single = [plan_step(alloc, [row]) for row in rows]
    ends = torch.tensor([len(tokens) for _, tokens, _ in rows]).cumsum(0) - 1
    packed = PackedRows(
        torch.cat([torch.full((len(tokens),), i, dtype=torch.long) for i, (_, tokens, _) in enumerate(rows)]),
        torch.cat([torch.full((b.gather.shape[1],), i, dtype=torch.long) for i, b in enumerate(single)]),
        torch.cat([torch.arange(b.gather.shape[1]) for b in single]),
        ends,
    )
    ids, positions = torch.cat([b.ids[0] for b in single]), torch.cat([b.positions[0] for b in single])
    T = ids.shape[0]
    gather = torch.cat([b.gather[0] for b in single]).unsqueeze(0)
    return StepBatch(ids.unsqueeze(0), positions.unsqueeze(0), torch.tensor([T]), torch.cat([b.slots for b in single]), gather, packed=packed)


class KVStorage:
    """This rank's keys and values: per layer it runs, `num_blocks x block_size` slots of [kv_heads, head_dim]."""

    def __init__(self, layout: CacheLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        slots = layout.num_blocks * layout.block_size
        shape = (slots, layout.kv_heads, layout.head_dim)
        self.keys = {layer: torch.zeros(shape, dtype=layout.dtype, device=device) for layer in layout.layers}
        self.values = {layer: torch.zeros(shape, dtype=layout.dtype, device=device) for layer in layout.layers}

    def step(self, batch: StepBatch) -> CacheStep:
        return CacheStep(batch.to(self.device), self)

    def offload(self, slots: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Copies in host memory of the keys and values at `slots`, per layer (a preempted sequence's cache)."""
        index = slots.to(self.device)
        return {layer: (self.keys[layer][index].cpu(), self.values[layer][index].cpu()) for layer in self.layout.layers}

    def restore(self, slots: torch.Tensor, saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write keys and values `offload` saved back into (new) `slots`."""
        index = slots.to(self.device)
        for layer, (keys, values) in saved.items():
            self.keys[layer].index_copy_(0, index, keys.to(self.device))
            self.values[layer].index_copy_(0, index, values.to(self.device))


class CacheStep:
    """A `StepBatch` bound to this rank's storage: what the model's attention layers write to and read from."""

    def __init__(self, batch: StepBatch, storage: KVStorage) -> None:
        self.batch, self.storage = batch, storage
        self.valid = batch.valid.to(storage.device)
        self.attention_mask = batch.attention_mask(storage.device)
        self.key_positions = batch.key_positions(storage.device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the real new tokens' keys and values ([B, kv_heads, T, head_dim]) into their slots; return those of every
        position each row attends to, [B, kv_heads, L, head_dim]."""
        out = []
        for new, store in ((key, self.storage.keys[layer_idx]), (value, self.storage.values[layer_idx])):
            store.index_copy_(0, self.batch.slots, new.transpose(1, 2)[self.valid].to(store.dtype))
            out.append(store[self.batch.gather].transpose(1, 2).to(new.dtype))
        return out[0], out[1]
