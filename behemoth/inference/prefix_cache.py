"""Prefix caching: full KV-cache blocks shared between sequences by the content of the tokens before and in them.

A block is named by a hash chain (SHA-256 of its parent block's name and its own tokens), so two sequences
whose first k blocks hold the same tokens at the same positions share those k blocks: a shared system
prompt is prefilled once. Only full blocks are shared, and a sequence writes only past its shared
prefix, so a shared block is never written again (divergence inside a block gives each sequence its
own copy of that block: copy-on-write at block granularity). A block's reference count is the
sequences using it; at zero it stays cached (evictable) until a new block is needed, then the least
recently released goes first (LRU). The bookkeeping is the scheduling rank's alone: other ranks only
see slots (`StepBatch`), so it works unchanged under tensor or pipeline parallelism.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its parent's name and its tokens (int64 little-endian), hashed."""
    digest = hashlib.sha256(parent)
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


class PrefixCachingAllocator(BlockAllocator):
    """A block allocator whose full blocks are named by content, reference-counted and evicted least recently used."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.refs: dict[int, int] = {}
        self.key_of: dict[int, bytes] = {}  # block -> its content name (full blocks only)
        self.by_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence uses, oldest first
        self.named: dict[Any, tuple[int, bytes]] = {}  # seq -> (its blocks named so far, the last one's name)
        self.evictions = 0

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free) - len(self.evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self.evictable)

    def can_grow(self, seq: Any, new_length: int) -> bool:
        return self.blocks_to_grow(seq, new_length) <= len(self.free) + len(self.evictable)

    def grow(self, seq: Any, new_length: int) -> None:
        need, available = self.blocks_to_grow(seq, new_length), len(self.free) + len(self.evictable)
        if need > available:
            raise BehemothError(f"the KV cache has {available} free blocks, a sequence needs {need}", "free sequences first")
        table = self.tables.setdefault(seq, [])
        for _ in range(need):
            block = self.free.pop() if self.free else self._evict()
            self.refs[block] = 1
            table.append(block)
        self.lengths[seq] = new_length

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        del self.by_key[self.key_of.pop(block)]
        self.evictions += 1
        return block

    def chain(self, tokens: list[int]) -> list[bytes]:
        """The names of the full blocks of `tokens` a sequence could share: all but a last block holding its final token."""
        keys, parent, bs = [], b"", self.block_size
        for i in range((len(tokens) - 1) // bs):
            parent = block_key(parent, tokens[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks holding a prefix of `tokens`, leaving at least one token to compute (its logits are needed)."""
        blocks = []
        for key in self.chain(tokens):
            block = self.by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def adopt(self, seq: Any, tokens: list[int]) -> int:
        """Start `seq` on the cached blocks of its longest cached prefix; how many tokens they hold."""
        blocks = self.match(tokens)
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
            self.evictable.pop(block, None)
        self.tables[seq] = list(blocks)
        self.lengths[seq] = len(blocks) * self.block_size
        self.named[seq] = (len(blocks), self.key_of[blocks[-1]] if blocks else b"")
        return len(blocks) * self.block_size

    def register(self, seq: Any, computed: list[int]) -> None:
        """Name the blocks of `seq` that `computed` (its tokens whose keys and values are in the cache) fills."""
        done, parent = self.named.get(seq, (0, b""))
        table, bs = self.tables[seq], self.block_size
        for i in range(done, len(computed) // bs):
            parent = block_key(parent, computed[i * bs : (i + 1) * bs])
            if parent not in self.by_key and table[i] not in self.key_of:
                self.by_key[parent], self.key_of[table[i]] = table[i], parent
            done = i + 1
        self.named[seq] = (done, parent)

    def release(self, seq: Any) -> int:
        """Drop `seq`'s references: a named block nobody uses stays cached (newest last), any other goes back free."""
        table = self.tables.pop(seq, [])
        self.lengths.pop(seq, None)
        self.named.pop(seq, None)
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        return len(table)
