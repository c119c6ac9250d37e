"""A KV-cache allocator written from docs/plugins.md alone: "simple", with prefix caching.

Deliberately plain: a full block is keyed by the exact tuple of every token from the start of the
sequence through the block's end (and the request's cache salt), so a hit can never be a hash
coincidence and no chain of parent hashes is needed. The price is memory proportional to the
square of a prompt's length in keys, fine for a worked example. Blocks no sequence holds keep
their contents until a fresh block is needed, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict

from llmserve.interfaces import CacheAllocator
from llmserve.stats import CacheStats


class SimplePrefixCache(CacheAllocator):
    """Block tables, reference counts, and exact-prefix keys; reports its hits through CacheStats."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free_list = list(range(num_blocks))
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.by_prefix: dict[tuple, int] = {}  # (salt, tokens[:end]) → block
        self.prefix_of: dict[int, tuple] = {}  # block → its key
        self.tables: dict[str, list[int]] = {}
        self.reserved: dict[str, int] = {}
        self.salts: dict[str, str | None] = {}
        self.queries = self.hits = self.evictions = 0

    def _hits(self, token_ids, salt) -> list[int]:
        bs, out = self.block_size, []
        for end in range(bs, len(token_ids), bs):  # never the last token: it must be computed
            b = self.by_prefix.get((salt, tuple(token_ids[:end])))
            if b is None:
                break
            out.append(b)
        return out

    def lookup_prefix(self, token_ids, salt=None) -> int:
        return len(self._hits(token_ids, salt)) * self.block_size

    def _fresh(self) -> int:
        if self.free_list:
            b = self.free_list.pop()
        else:
            b, _ = self.idle.popitem(last=False)
            del self.by_prefix[self.prefix_of.pop(b)]
            self.evictions += 1
        self.refs[b] = 1
        return b

    def allocate(self, seq_id, token_ids, num_tokens, use_prefix_cache=True, salt=None):
        bs = self.block_size
        first = seq_id not in self.tables
        hits = self._hits(token_ids, salt) if first and use_prefix_cache else []
        table = self.tables.get(seq_id, [])
        num_tokens = max(num_tokens, len(hits) * bs, self.reserved.get(seq_id, 0))
        needed = -(-num_tokens // bs) - len(table) - len(hits)
        if needed > len(self.free_list) + len(self.idle) - sum(1 for b in hits if self.refs[b] == 0):
            return None
        for b in hits:
            self.idle.pop(b, None)
            self.refs[b] += 1
        self.tables[seq_id] = table + hits + [self._fresh() for _ in range(needed)]
        self.reserved[seq_id] = num_tokens
        if not first:
            return 0
        self.salts[seq_id] = salt
        if use_prefix_cache:
            self.queries += len(token_ids)
            self.hits += len(hits) * bs
        return len(hits) * bs

    def cache_full_blocks(self, seq_id, token_ids, num_computed_tokens) -> None:
        bs, salt = self.block_size, self.salts[seq_id]
        for i, b in enumerate(self.tables[seq_id][: num_computed_tokens // bs]):
            key = (salt, tuple(token_ids[: (i + 1) * bs]))
            if b not in self.prefix_of and key not in self.by_prefix:
                self.by_prefix[key], self.prefix_of[b] = b, key

    def free(self, seq_id) -> None:
        for b in reversed(self.tables.pop(seq_id, [])):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.prefix_of:
                    self.idle[b] = None
                else:
                    self.free_list.append(b)
        self.reserved.pop(seq_id, None)
        self.salts.pop(seq_id, None)

    def block_table(self, seq_id) -> list[int]:
        return self.tables[seq_id]

    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.idle)

    def stats(self) -> CacheStats:
        used = sum(1 for r in self.refs if r > 0)
        waste = sum(len(t) * self.block_size - self.reserved[s] for s, t in self.tables.items())
        return CacheStats(num_blocks=self.num_blocks, block_size=self.block_size, used_blocks=used,
                          free_blocks=len(self.free_list), cached_free_blocks=len(self.idle),
                          num_sequences=len(self.tables),
                          internal_fragmentation=waste / (used * self.block_size) if used else 0.0,
                          prefix_caching=True, prefix_queries=self.queries, prefix_hits=self.hits,
                          evictions=self.evictions)
