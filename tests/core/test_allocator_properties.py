"""The paged allocator passes the conformance kit; a broken allocator does not; keys cannot be forged."""

from __future__ import annotations

import itertools

import pytest

from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from llmserve.stats import CacheStats
from llmserve.testing import NUM_BLOCKS, allocator_machine, check_allocator
from llmserve_paged_cache import PagedAllocator


@pytest.mark.parametrize(("block_key", "eviction"), [("sha256", "lru"), ("builtin", "lru"), ("sha256", "fifo")])
def test_the_paged_allocator_conforms(block_key, eviction):
    check_allocator(lambda n, bs: PagedAllocator(n, bs, enable_prefix_caching=True, block_key=block_key,
                                                 eviction=eviction))


class Watched(PagedAllocator):
    """Records when each block was cached and when it was last released, and checks every eviction against them:
    the least recently released cached block (lru), or the first cached (fifo)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ticks = itertools.count()
        self.cached_tick: dict[int, int] = {}
        self.released_tick: dict[int, int] = {}
        self.evicted: list[int] = []

    def cache_full_blocks(self, seq_id, token_ids, num_computed_tokens):
        before = list(self._block_key)
        super().cache_full_blocks(seq_id, token_ids, num_computed_tokens)
        for b in self.block_table(seq_id):  # in the table's order: a prefix's root first
            if before[b] is None and self._block_key[b] is not None:
                self.cached_tick[b] = next(self.ticks)

    def free(self, seq_id):
        table = list(self.block_table(seq_id)) if seq_id in self._tables else []
        super().free(seq_id)
        for b in reversed(table):  # the order free releases them in
            if self.ref_count[b] == 0:
                self.released_tick[b] = next(self.ticks)

    def _take_fresh(self):
        if self._free:
            return super()._take_fresh()
        order = self.cached_tick if self.eviction == "fifo" else self.released_tick
        want = min(self._evictable, key=lambda b: order[b])
        b = super()._take_fresh()
        assert b == want, f"{self.eviction} evicted block {b}, not {want}"
        self.evicted.append(b)
        return b


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_cached_blocks_are_evicted_in_the_policys_order(eviction):
    """Under the kit's random admissions, growths, writes and frees, each eviction takes the block its policy
    names; and both policies do evict (the machine fills the cache)."""
    made = []

    def make(n, bs):
        made.append(Watched(n, bs, eviction=eviction))
        return made[-1]

    run_state_machine_as_test(allocator_machine(make), settings=settings(max_examples=60, stateful_step_count=40,
                                                                           deadline=None))
    assert sum(len(a.evicted) for a in made) > 0


def test_fifo_and_lru_evict_different_blocks_after_a_hit():
    """Two prefixes cached, the first one hit again: lru keeps the first (used last), fifo evicts it (cached first)."""
    kept = {}
    for eviction in ("lru", "fifo"):
        a = PagedAllocator(4, 2, eviction=eviction)
        for sid, toks in (("a", [1, 2, 3]), ("b", [7, 8, 9])):
            a.allocate(sid, toks, 3)
            a.cache_full_blocks(sid, toks, 3)
            a.free(sid)
        a.allocate("a2", [1, 2, 5], 3)  # a hit on a's first block
        a.free("a2")
        a.allocate("big", [4] * 5, 5)  # 3 blocks: the 2 free ones and 1 of the 2 cached
        kept[eviction] = (a.lookup_prefix([1, 2, 0]), a.lookup_prefix([7, 8, 0]))
        assert a.stats().evictions == 1
    assert kept == {"lru": (2, 0), "fifo": (0, 2)}


def test_the_paged_allocators_ref_counts_match_the_holders():
    """Beyond the kit (which sees only the public interface): each block's ref count is its holders."""

    class WithRefCounts(allocator_machine(lambda n, bs: PagedAllocator(n, bs))):
        @invariant()
        def ref_counts_match_holders(self):
            holders = [0] * NUM_BLOCKS
            for sid in self.tokens:
                for b in self.a.block_table(sid):
                    holders[b] += 1
            assert holders == self.a.ref_count

    run_state_machine_as_test(WithRefCounts, settings=settings(max_examples=200, stateful_step_count=40,
                                                               deadline=None))


class SaltBlindAllocator(PagedAllocator):
    """Deliberately broken: ignores the cache salt, so one tenant's blocks serve another's."""

    def lookup_prefix(self, token_ids, salt=None):
        return super().lookup_prefix(token_ids, None)

    def allocate(self, seq_id, token_ids, num_tokens, use_prefix_cache=True, salt=None):
        return super().allocate(seq_id, token_ids, num_tokens, use_prefix_cache, None)


class MiscountingAllocator(PagedAllocator):
    """Deliberately broken: reports no prefix hits (what an allocator written without the stats did)."""

    def stats(self) -> CacheStats:
        s = super().stats()
        s.prefix_hits = 0
        return s


@pytest.mark.parametrize("broken, message", [
    (SaltBlindAllocator, "prefix hit on block"),
    (MiscountingAllocator, "stats report"),
])
def test_the_kit_catches_a_broken_allocator_with_a_readable_failure(broken, message):
    with pytest.raises(AssertionError, match=message):
        check_allocator(lambda n, bs: broken(n, bs), max_examples=200)


class Colliding:
    """Token ids whose hash is one constant: two different blocks land on one weak hash."""

    def __init__(self, tokens):
        self.tokens = tuple(tokens)

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return isinstance(other, Colliding) and self.tokens == other.tokens


def test_blocks_forced_onto_one_weak_hash_are_not_shared(monkeypatch):
    a = PagedAllocator(16, 4, block_key="builtin")
    monkeypatch.setattr(a, "_key", lambda parent, tokens, salt: (parent, Colliding(tokens), salt))
    victim = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a.allocate("victim", victim, 9)
    a.cache_full_blocks("victim", victim, 9)
    assert a.lookup_prefix(victim + [0]) == 8  # the same tokens do hit
    attacker = [9, 9, 9, 9, 8, 8, 8, 8, 1]  # other tokens, the same weak hash at every block
    assert a.lookup_prefix(attacker) == 0
    assert a.allocate("attacker", attacker, 9) == 0
    assert not set(a.block_table("attacker")) & set(a.block_table("victim"))


@pytest.mark.parametrize("block_key", ["sha256", "builtin"])
def test_a_cache_salt_keeps_a_tenants_prefix_to_itself(block_key):
    a = PagedAllocator(16, 4, block_key=block_key)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a.allocate("a", prompt, 9, salt="tenant-a")
    a.cache_full_blocks("a", prompt, 9)
    assert a.lookup_prefix(prompt, "tenant-a") == 8
    assert a.lookup_prefix(prompt, "tenant-b") == 0
    assert a.lookup_prefix(prompt) == 0  # no salt is a salt of its own


def test_cache_eviction_is_the_configs_and_checked():
    from llmserve.config import config_from_dict
    from llmserve.errors import ConfigError
    from llmserve_paged_cache import _build

    assert _build(config_from_dict({"cache": {"eviction": "fifo"}}), 8).eviction == "fifo"
    assert _build(config_from_dict({}), 8).eviction == "lru"
    with pytest.raises(ConfigError, match="cache.eviction: must be one of lru, fifo"):
        _build(config_from_dict({"cache": {"eviction": "random"}}), 8)
