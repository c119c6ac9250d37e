"""Hypothesis state machine over the paged allocator: every invariant after every rule.

A shadow "KV memory" (block → token per slot) stands in for the backend, so the test can check
that prefix hits return blocks that really hold the request's prefix, and that copy-on-write
keeps forked sequences from writing into each other's slots.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from llmserve_paged_cache import PagedAllocator

BS = 4
NUM_BLOCKS = 24
# a few shared stems so that prefix hits are common
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


class AllocatorMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.a = PagedAllocator(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.tokens: dict[str, list[int]] = {}  # each live sequence's tokens
        self.reserved: dict[str, int] = {}  # slots reserved
        self.computed: dict[str, int] = {}  # tokens written to the shadow memory
        self.memory: dict[int, list[int | None]] = {}  # block → token in each slot
        self.n = 0

    # --- helpers ------------------------------------------------------------------------------

    def snapshot(self):
        a = self.a
        return (list(a.ref_count), sorted(a._free), list(a._evictable), dict(a._hash_to_block),
                {k: list(v) for k, v in a._tables.items()}, dict(a._num_tokens), a._waste)

    def apply_copies(self):
        for src, dst in self.a.take_block_copies():
            self.memory[dst] = list(self.memory.get(src, [None] * BS))

    def write(self, sid: str):
        """The backend computes the reserved tokens: write them into their slots."""
        table = self.a.block_table(sid)
        toks = self.tokens[sid]
        for pos in range(self.computed[sid], self.reserved[sid]):
            b = table[pos // BS]
            assert self.a.ref_count[b] == 1 or self.memory.get(b, [None] * BS)[pos % BS] == toks[pos], (
                f"{sid} would overwrite slot {pos} of shared block {b}")
            self.memory.setdefault(b, [None] * BS)[pos % BS] = toks[pos]
        self.computed[sid] = self.reserved[sid]
        self.a.cache_full_blocks(sid, toks, self.computed[sid])

    # --- rules --------------------------------------------------------------------------------

    @rule(target=seqs, stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 9), max_size=9),
          chunk=st.integers(1, 24))
    def new_sequence(self, stem, tail, chunk):
        """Admit a sequence: prefix hit first, then a chunk of its prompt."""
        sid = f"s{self.n}"
        self.n += 1
        toks = stem + tail
        before = self.snapshot()
        expect_hit = self.a.lookup_prefix(toks)
        num = min(len(toks), expect_hit + chunk)
        got = self.a.allocate(sid, toks, num)
        if got is None:
            assert self.snapshot() == before, "a refused allocation changed state"
            return None
        assert got == expect_hit
        self.apply_copies()
        table = self.a.block_table(sid)
        for i in range(got // BS):  # reused blocks hold exactly this prefix
            assert self.memory[table[i]] == toks[i * BS : (i + 1) * BS]
        self.tokens[sid] = toks
        self.reserved[sid] = num
        self.computed[sid] = got
        self.write(sid)
        return sid

    @rule(sid=seqs, k=st.integers(1, 6))
    def append(self, sid, k):
        """Grow a live sequence by k tokens (the rest of a prompt, or decodes)."""
        if sid not in self.tokens:
            return
        toks = self.tokens[sid]
        new = self.reserved[sid] + k
        while len(toks) < new:
            toks.append(len(toks) % 7)
        before = self.snapshot()
        got = self.a.allocate(sid, toks, new)
        if got is None:
            assert self.snapshot() == before, "a refused allocation changed state"
            return
        assert got == 0
        self.apply_copies()
        self.reserved[sid] = new
        self.write(sid)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        """A child shares all of the parent's blocks."""
        if parent not in self.tokens:
            return None
        cid = f"s{self.n}"
        self.n += 1
        self.a.fork(parent, cid)
        self.tokens[cid] = list(self.tokens[parent])
        self.reserved[cid] = self.reserved[parent]
        self.computed[cid] = self.computed[parent]
        return cid

    @rule(sid=consumes(seqs))
    def free(self, sid):
        """Finish, abort or preempt: the sequence gives back everything."""
        if sid not in self.tokens:
            return
        self.a.free(sid)
        assert not self.a.holds(sid)
        for d in (self.tokens, self.reserved, self.computed):
            del d[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_and_readmit(self, data):
        """Free a sequence and admit it again under a new id: its own cached blocks come back."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid]
        self.a.free(sid)
        for d in (self.tokens, self.reserved, self.computed):
            del d[sid]
        nid = f"s{self.n}"
        self.n += 1
        hit = self.a.lookup_prefix(toks)
        got = self.a.allocate(nid, toks, len(toks))
        if got is not None:
            assert got == hit
            table = self.a.block_table(nid)
            for i in range(got // BS):
                assert self.memory[table[i]] == toks[i * BS : (i + 1) * BS]
            self.tokens[nid], self.reserved[nid], self.computed[nid] = toks, len(toks), got
            self.write(nid)

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self):
        s = self.a.stats()
        assert s["free_blocks"] + s["used_blocks"] + s["cached_free_blocks"] == NUM_BLOCKS
        assert 0 <= s["used_blocks"] <= NUM_BLOCKS

    @invariant()
    def ref_counts_match_holders(self):
        holders = [0] * NUM_BLOCKS
        for sid in self.tokens:
            for b in self.a.block_table(sid):
                holders[b] += 1
        assert holders == self.a.ref_count
        assert min(self.a.ref_count) >= 0
        assert sum(1 for r in self.a.ref_count if r > 0) == self.a.num_used_blocks

    @invariant()
    def positions_map_to_one_slot(self):
        writable: dict[tuple[int, int], str] = {}
        for sid, n in self.reserved.items():
            table = self.a.block_table(sid)
            assert len(table) == -(-n // BS), f"{sid}: {len(table)} blocks for {n} slots"
            slots = {(table[p // BS], p % BS) for p in range(n)}
            assert len(slots) == n
            # the slot a sequence writes next is its own
            if n % BS:
                last = table[-1]
                key = (last, n % BS)
                assert key not in writable or self.a.ref_count[last] > 1, "two sequences write one slot"
                writable[key] = sid

    @invariant()
    def internal_fragmentation_is_tail_waste(self):
        waste = sum(len(self.a.block_table(s)) * BS - n for s, n in self.reserved.items())
        assert self.a._waste == waste


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
