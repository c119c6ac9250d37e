"""The paged allocator passes the conformance kit; a broken allocator does not; keys cannot be forged."""

from __future__ import annotations

import pytest

from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from llmserve.stats import CacheStats
from llmserve.testing import NUM_BLOCKS, allocator_machine, check_allocator
from llmserve_paged_cache import PagedAllocator


@pytest.mark.parametrize("block_key", ["sha256", "builtin"])
def test_the_paged_allocator_conforms(block_key):
    check_allocator(lambda n, bs: PagedAllocator(n, bs, enable_prefix_caching=True, block_key=block_key))


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
