"""A paged KV-cache block allocator with automatic prefix caching.

Block ids only: the backend owns the tensors. Each full block of computed tokens is named by a
chained key over (the parent block's key, its token ids, and for the first block the request's
cache salt), so equal prefixes of the same salt map to equal blocks. The default key is a
sha256 digest: a Python hash of an int tuple is unsalted and cheap to collide, and a forged
collision would serve one user's KV to another (vLLM's GHSA-rm76-4mrf-v9r8). The "builtin"
option keys the cache by the exact (parent, tokens, salt) tuple instead, so a hit is a token
comparison and never a hash coincidence. Blocks no sequence holds keep their contents and are
evicted only when a fresh block is needed: the least recently used first ("lru"), or the first
cached first whatever its hits since ("fifo").
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from llmserve.interfaces import CacheAllocator
from llmserve.stats import CacheStats

BLOCK_KEYS = ("sha256", "builtin")
EVICTIONS = ("lru", "fifo")


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """sha256 identity of a full block: its tokens, its parent's identity, and (first block) the cache salt."""
    h = hashlib.sha256()
    if parent is None:
        s = (salt or "").encode("utf-8", "surrogatepass")
        h.update(b"\x01" + len(s).to_bytes(4, "little") + s)  # length-prefixed: no salt/token ambiguity
    else:
        h.update(b"\x02" + parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PagedAllocator(CacheAllocator):
    """Fixed-size blocks, per-sequence block tables, ref counts, prefix sharing of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_key: str = "sha256", eviction: str = "lru"):
        assert num_blocks >= 1 and block_size >= 1
        if block_key not in BLOCK_KEYS:
            raise ValueError(f"block_key must be one of {', '.join(BLOCK_KEYS)}, got {block_key!r}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
        self.eviction = eviction
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._sha = block_key == "sha256"
        self._serials = itertools.count()  # builtin keys chain through these, not through nested tuples
        self.ref_count = [0] * num_blocks
        # free blocks holding nothing worth keeping; popped from the end (LIFO keeps caches warm)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # ref-0 blocks that still hold a cached prefix, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # fifo: when each block's contents were cached, and the evictable ones by that (entries of blocks since
        # retained or re-cached are skipped when popped)
        self._cached_at = [0] * num_blocks
        self._fifo: list[tuple[int, int]] = []
        self._cache_serials = itertools.count()
        self._cached: dict[Hashable, int] = {}  # block key → block
        self._block_key: list[Hashable | None] = [None] * num_blocks
        self._ident: list[Hashable | None] = [None] * num_blocks  # what a child block's key chains on
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # slots reserved per sequence
        self._chain: dict[str, list[Hashable]] = {}  # identities of the sequence's full blocks
        self._salt: dict[str, str | None] = {}
        self._used = 0  # blocks with ref count > 0
        self._waste = 0  # reserved-but-unfilled slots at sequences' tails (internal fragmentation)
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._evictions = 0
        self._refused_free: int | None = None  # free blocks when an allocation was last refused

    # --- keys ---------------------------------------------------------------------------------

    def _key(self, parent: Hashable | None, tokens: Sequence[int], salt: str | None) -> Hashable:
        if self._sha:
            return block_hash(parent, tokens, salt)
        return (parent, tuple(tokens), salt if parent is None else None)

    def _prefix(self, token_ids: Sequence[int], salt: str | None) -> tuple[list[int], list[Hashable]]:
        """The cached full blocks that prefix token_ids (never its last token) and their identities."""
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs  # leave >= 1 token to compute: it yields the logits
        blocks: list[int] = []
        idents: list[Hashable] = []
        parent = None
        for i in range(max_blocks):
            b = self._cached.get(self._key(parent, token_ids[i * bs : (i + 1) * bs], salt))
            if b is None:
                break
            blocks.append(b)
            parent = self._ident[b]
            idents.append(parent)
        return blocks, idents

    def lookup_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Tokens at the start of token_ids already in cached blocks of this salt (whole blocks only)."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._prefix(token_ids, salt)[0]) * self.block_size

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def held_block_keys(self) -> list[bytes]:
        # builtin keys are tuples, not block_hash digests a router could recompute
        return list(self._cached) if self._sha else []

    # --- allocation ---------------------------------------------------------------------------

    def _forget(self, b: int) -> None:
        key = self._block_key[b]
        if key is not None and self._cached.get(key) == b:
            del self._cached[key]
        self._block_key[b] = self._ident[b] = None

    def _take_fresh(self) -> int:
        """A block with no contents worth keeping: a free one, else evict the LRU cached one."""
        if self._free:
            b = self._free.pop()
        else:
            b = self._pop_evictable()
            self._forget(b)
            self._evictions += 1
        self.ref_count[b] = 1
        self._used += 1
        return b

    def _pop_evictable(self) -> int:
        """The cached block to evict: the least recently released (lru), or the first cached (fifo)."""
        if self.eviction == "lru":
            return self._evictable.popitem(last=False)[0]
        while True:
            at, b = heapq.heappop(self._fifo)
            if b in self._evictable and self._cached_at[b] == at:
                del self._evictable[b]
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
            if self._block_key[b] is not None:
                self._evictable[b] = None  # most recently used at the end
                if self.eviction == "fifo":
                    if len(self._fifo) > 4 * self.num_blocks:  # mostly entries of blocks retained since
                        self._fifo = [(self._cached_at[e], e) for e in self._evictable]
                        heapq.heapify(self._fifo)
                    else:
                        heapq.heappush(self._fifo, (self._cached_at[b], b))
            else:
                self._free.append(b)

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 use_prefix_cache: bool = True, salt: str | None = None) -> int | None:
        bs = self.block_size
        table = self._tables.get(seq_id)
        if table is None:
            # first allocation: reuse the cached prefix, then fresh blocks for the rest
            use = self.enable_prefix_caching and use_prefix_cache
            hit_blocks, idents = self._prefix(token_ids, salt) if use else ([], [])
            num_cached = len(hit_blocks) * bs
            num_tokens = max(num_tokens, num_cached)
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
            self._chain[seq_id] = idents
            self._salt[seq_id] = salt
            self._waste += len(table) * bs - num_tokens
            if use:
                self._prefix_queries += len(token_ids)
                self._prefix_hits += num_cached
            return num_cached

        have = self._num_tokens[seq_id]
        if num_tokens <= have:
            return 0
        needed = -(-num_tokens // bs) - len(table)
        if needed > self.num_free_blocks():
            self._refused_free = self.num_free_blocks()
            return None
        for _ in range(needed):
            table.append(self._take_fresh())
        self._waste += (len(table) * bs - num_tokens) - (len(table) * bs - needed * bs - have)
        self._num_tokens[seq_id] = num_tokens
        return 0

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        chain = self._chain[seq_id]
        table = self._tables[seq_id]
        salt = self._salt[seq_id]
        full = min(num_computed_tokens // bs, len(table))
        parent = chain[-1] if chain else None
        for i in range(len(chain), full):
            key = self._key(parent, token_ids[i * bs : (i + 1) * bs], salt)
            b = self._cached.get(key)
            if b is None:  # first of its content: findable from now on
                b = table[i]
                self._cached[key] = b
                self._block_key[b] = key
                self._cached_at[b] = next(self._cache_serials)
                self._ident[b] = key if self._sha else next(self._serials)
            # chain on the registered block's identity, so later look-ups walk the same path
            parent = self._ident[b]
            chain.append(parent)

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        self._refused_free = None
        n = self._num_tokens.pop(seq_id)
        self._chain.pop(seq_id)
        self._salt.pop(seq_id)
        self._waste -= len(table) * self.block_size - n
        # release the tail first so that, when evicting, a prefix's deepest blocks go before its root
        for b in reversed(table):
            self._release(b)

    def reset_prefix_cache(self) -> None:
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._forget(b)
            self._free.append(b)
        self._fifo.clear()

    # --- reporting ----------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        reserved = self._used * self.block_size
        return CacheStats(
            num_blocks=self.num_blocks, block_size=self.block_size, used_blocks=self._used,
            free_blocks=len(self._free), cached_free_blocks=len(self._evictable),
            num_sequences=len(self._tables),
            internal_fragmentation=self._waste / reserved if reserved else 0.0,
            # with paging any free block serves any sequence: the only capacity that sits free
            # while work waits is what the last refused allocation could not use
            external_fragmentation=(self._refused_free or 0) / self.num_blocks,
            prefix_caching=self.enable_prefix_caching, prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits, evictions=self._evictions,
        )
