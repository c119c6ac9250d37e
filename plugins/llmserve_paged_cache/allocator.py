"""A paged KV-cache block allocator with automatic prefix caching.

Block ids only: the backend owns the tensors. Each full block of computed tokens is named by
a chained hash of (parent block's hash, its token ids), so equal prefixes map to equal blocks.
Blocks no sequence holds keep their contents and hash in an LRU pool, and are evicted only when
a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from llmserve.interfaces import CacheAllocator


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The identity of a full block: its tokens, and (through the parent) everything before them."""
    return hash((parent, tuple(tokens)))


class PagedAllocator(CacheAllocator):
    """Fixed-size blocks, per-sequence block tables, ref counts, fork with copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        # free blocks holding nothing worth keeping; popped from the end (LIFO keeps caches warm)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # ref-0 blocks that still hold a cached prefix, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: list[int | None] = [None] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # slots reserved per sequence
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the sequence's full blocks
        self._copies: list[tuple[int, int]] = []
        self._used = 0  # blocks with ref count > 0
        self._waste = 0  # reserved-but-unfilled slots at sequences' tails (internal fragmentation)
        self.prefix_queries = 0  # prompt tokens looked up on first allocation
        self.prefix_hits = 0  # of those, served from the cache
        self.evictions = 0
        self._refused_free: int | None = None  # free blocks when an allocation was last refused

    # --- look-ups -----------------------------------------------------------------------------

    def _prefix_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the cached full blocks that prefix token_ids (never its last token)."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs  # leave >= 1 token to compute: it yields the logits
        out: list[int] = []
        parent = None
        for i in range(max_blocks):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if h not in self._hash_to_block:
                break
            out.append(h)
            parent = h
        return out

    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens at the start of token_ids already in cached blocks (whole blocks only)."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._prefix_hashes(token_ids)) * self.block_size

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def holds(self, seq_id: str) -> bool:
        """Whether the sequence has any reservation."""
        return seq_id in self._tables

    # --- allocation ---------------------------------------------------------------------------

    def _take_fresh(self) -> int:
        """A block with no contents worth keeping: a free one, else evict the LRU cached one."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._block_hash[b]
            if h is not None and self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]
            self._block_hash[b] = None
            self.evictions += 1
        self.ref_count[b] = 1
        self._used += 1
        return b

    def _retain(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self._evictable.pop(b, None)
            self._used += 1
        self.ref_count[b] += 1

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        assert self.ref_count[b] >= 0, f"block {b} released more often than retained"
        if self.ref_count[b] == 0:
            self._used -= 1
            if self._block_hash[b] is not None:
                self._evictable[b] = None  # most recently used at the end
            else:
                self._free.append(b)

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 use_prefix_cache: bool = True) -> int | None:
        bs = self.block_size
        table = self._tables.get(seq_id)
        if table is None:
            # first allocation: reuse the cached prefix, then fresh blocks for the rest
            use = self.enable_prefix_caching and use_prefix_cache
            hashes = self._prefix_hashes(token_ids) if use else []
            hit_blocks = [self._hash_to_block[h] for h in hashes]
            num_cached = len(hit_blocks) * bs
            if num_tokens < num_cached:
                num_tokens = num_cached
            needed = -(-num_tokens // bs) - len(hit_blocks)
            # cached blocks we are about to retain are not available as fresh ones
            reusable_evictable = sum(1 for b in hit_blocks if self.ref_count[b] == 0)
            if needed > self.num_free_blocks() - reusable_evictable:
                self._refused_free = self.num_free_blocks()
                return None
            for b in hit_blocks:
                self._retain(b)
            table = hit_blocks + [self._take_fresh() for _ in range(needed)]
            self._tables[seq_id] = table
            self._num_tokens[seq_id] = num_tokens
            self._hashes[seq_id] = hashes
            self._waste += len(table) * bs - num_tokens
            if use:
                self.prefix_queries += len(token_ids)
                self.prefix_hits += num_cached
            return num_cached

        have = self._num_tokens[seq_id]
        if num_tokens <= have:
            return 0
        needed = -(-num_tokens // bs) - len(table)
        # writing into a shared partial last block needs a private copy first (copy-on-write)
        cow = have % bs != 0 and self.ref_count[table[-1]] > 1
        if needed + cow > self.num_free_blocks():
            self._refused_free = self.num_free_blocks()
            return None
        if cow:
            src = table[-1]
            dst = self._take_fresh()
            self._release(src)
            table[-1] = dst
            self._copies.append((src, dst))
        for _ in range(needed):
            table.append(self._take_fresh())
        self._waste += (len(table) * bs - num_tokens) - (len(table) * bs - needed * bs - have)
        self._num_tokens[seq_id] = num_tokens
        return 0

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes[seq_id]
        table = self._tables[seq_id]
        full = min(num_computed_tokens // bs, len(table))
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            b = table[i]
            if self._block_hash[b] is None and h not in self._hash_to_block:
                self._block_hash[b] = h
                self._hash_to_block[h] = b
            parent = h

    def fork(self, parent_id: str, child_id: str) -> None:
        assert child_id not in self._tables, f"{child_id} already holds blocks"
        table = self._tables[parent_id]
        for b in table:
            self._retain(b)
        self._tables[child_id] = list(table)
        n = self._num_tokens[parent_id]
        self._num_tokens[child_id] = n
        self._hashes[child_id] = list(self._hashes[parent_id])
        self._waste += len(table) * self.block_size - n

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        self._refused_free = None
        n = self._num_tokens.pop(seq_id)
        self._hashes.pop(seq_id)
        self._waste -= len(table) * self.block_size - n
        # release the tail first so that, when evicting, a prefix's deepest blocks go before its root
        for b in reversed(table):
            self._release(b)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._block_hash[b]
            if h is not None and self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]
            self._block_hash[b] = None
            self._free.append(b)

    # --- reporting ----------------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self._used

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return self._used / self.num_blocks

    @property
    def internal_fragmentation(self) -> float:
        """Reserved slots not filled, over all reserved slots of blocks in use."""
        reserved = self._used * self.block_size
        return self._waste / reserved if reserved else 0.0

    def external_fragmentation(self) -> float:
        """Free blocks stranded by the last refused allocation, over all blocks (0 once blocks are freed).

        A contiguous allocator's external fragmentation is free memory that cannot serve a
        request; with paging any free block serves any sequence, so the only capacity that sits
        free while work waits is the remainder too small for the refused request.
        """
        return (self._refused_free or 0) / self.num_blocks

    def stats(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "used_blocks": self._used,
            "free_blocks": len(self._free),
            "cached_free_blocks": len(self._evictable),
            "utilization": self.usage,
            "internal_fragmentation": self.internal_fragmentation,
            "external_fragmentation": self.external_fragmentation(),
            "num_sequences": len(self._tables),
            "prefix_caching": self.enable_prefix_caching,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "evictions": self.evictions,
        }
