"""Conformance kit for plugin authors: the property tests our own allocator and scheduler pass.

A third-party KV-cache allocator or scheduler runs them against itself in its own test suite:

    from llmserve.testing import check_allocator, check_scheduler

    def test_my_allocator_conforms():
        check_allocator(lambda num_blocks, block_size: MyAllocator(num_blocks, block_size))

    def test_my_scheduler_conforms():
        check_scheduler({"scheduler": {"name": "mine"}}, plugins=[my_plugin])

Both drive hypothesis and fail with the falsifying example and a message naming the broken
rule. They use only the public interfaces (llmserve/interfaces.py) and the declared stats.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.errors import InvalidRequestError
from llmserve.interfaces import CacheAllocator
from llmserve.plugins import load_plugins
from llmserve.request import FinishReason, SamplingParams

# --- the allocator ---------------------------------------------------------------------------

BS = 4
NUM_BLOCKS = 24
# a few shared stems so that prefix hits are common; two salts so that tenants can collide
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
SALTS = [None, None, "tenant-b"]


def allocator_machine(make: Callable[[int, int], CacheAllocator]) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine over make(num_blocks, block_size), with prefix caching on."""

    class AllocatorMachine(RuleBasedStateMachine):
        seqs = Bundle("seqs")

        def __init__(self):
            super().__init__()
            self.a = make(NUM_BLOCKS, BS)
            self.tokens: dict[str, list[int]] = {}  # each live sequence's tokens
            self.salt: dict[str, str | None] = {}
            self.reserved: dict[str, int] = {}  # slots reserved
            self.computed: dict[str, int] = {}  # tokens written to the shadow memory
            # a shadow "KV memory" standing in for the backend: block → (salt, token) per slot
            self.memory: dict[int, list[tuple | None]] = {}
            self.queries = self.hits = 0
            self.ids = (f"s{i}" for i in itertools.count())

        # --- helpers --------------------------------------------------------------------------

        def observable(self):
            # external fragmentation records a refusal by design: everything else must stay put
            st = dataclasses.replace(self.a.stats(), external_fragmentation=0.0)
            return st, {s: list(self.a.block_table(s)) for s in self.tokens}

        def write(self, sid: str) -> None:
            """The backend computes the reserved tokens: write them into their slots."""
            table = self.a.block_table(sid)
            toks = self.tokens[sid]
            for pos in range(self.computed[sid], self.reserved[sid]):
                b = table[pos // BS]
                for other, t in self.tokens.items():
                    if other != sid and b in self.a.block_table(other):
                        raise AssertionError(f"{sid} writes slot {pos % BS} of block {b}, which {other} holds too")
                self.memory.setdefault(b, [None] * BS)[pos % BS] = (self.salt[sid], toks[pos])
            self.computed[sid] = self.reserved[sid]
            self.a.cache_full_blocks(sid, toks, self.computed[sid])

        def admit(self, sid: str, toks: list[int], salt: str | None, num: int) -> bool:
            before = self.observable()
            expect_hit = self.a.lookup_prefix(toks, salt)
            assert self.observable() == before, "lookup_prefix changed state"
            assert expect_hit % BS == 0 and expect_hit < len(toks), f"a prefix hit of {expect_hit} tokens"
            got = self.a.allocate(sid, toks, max(num, expect_hit), salt=salt)
            if got is None:
                assert self.observable() == before, "a refused allocation changed state"
                return False
            assert got == expect_hit, f"allocate reused {got} cached tokens, lookup_prefix promised {expect_hit}"
            table = self.a.block_table(sid)
            for i in range(got // BS):  # reused blocks hold exactly this prefix, written under this salt
                held = self.memory.get(table[i])
                want = [(salt, t) for t in toks[i * BS : (i + 1) * BS]]
                assert held == want, f"prefix hit on block {table[i]} holds {held}, the request needs {want}"
            self.tokens[sid], self.salt[sid] = toks, salt
            self.reserved[sid], self.computed[sid] = max(num, got), got
            self.queries += len(toks)
            self.hits += got
            self.write(sid)
            return True

        def drop(self, sid: str) -> None:
            self.a.free(sid)
            for d in (self.tokens, self.salt, self.reserved, self.computed):
                del d[sid]

        # --- rules ----------------------------------------------------------------------------

        @rule(target=seqs, stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 9), max_size=9),
              chunk=st.integers(1, 24), salt=st.sampled_from(SALTS))
        def new_sequence(self, stem, tail, chunk, salt):
            """Admit a sequence: prefix hit first, then a chunk of its prompt."""
            sid, toks = next(self.ids), stem + tail
            return sid if self.admit(sid, toks, salt, min(len(toks), chunk)) else None

        @rule(sid=seqs, k=st.integers(1, 6))
        def append(self, sid, k):
            """Grow a live sequence by k tokens (the rest of a prompt, or decodes)."""
            if sid not in self.tokens:
                return
            toks = self.tokens[sid]
            new = self.reserved[sid] + k
            while len(toks) < new:
                toks.append(len(toks) % 7)
            before = self.observable()
            got = self.a.allocate(sid, toks, new, salt=self.salt[sid])
            if got is None:
                assert self.observable() == before, "a refused allocation changed state"
                return
            assert got == 0, f"a later allocation reported {got} cached tokens"
            self.reserved[sid] = new
            self.write(sid)

        @rule(sid=consumes(seqs))
        def free(self, sid):
            """Finish, abort or preempt: the sequence gives back everything."""
            if sid in self.tokens:
                self.drop(sid)

        @precondition(lambda self: self.tokens)
        @rule(data=st.data())
        def preempt_and_readmit(self, data):
            """Free a sequence and admit it again under a new id: its own cached blocks come back."""
            sid = data.draw(st.sampled_from(sorted(self.tokens)))
            toks, salt = self.tokens[sid], self.salt[sid]
            self.drop(sid)
            self.admit(next(self.ids), toks, salt, len(toks))

        # --- invariants -----------------------------------------------------------------------

        @invariant()
        def blocks_are_conserved(self):
            s = self.a.stats()
            assert s.free_blocks + s.used_blocks + s.cached_free_blocks == NUM_BLOCKS, (
                f"free {s.free_blocks} + used {s.used_blocks} + cached {s.cached_free_blocks} != {NUM_BLOCKS}")
            assert 0 <= s.used_blocks <= NUM_BLOCKS

        @invariant()
        def used_blocks_are_the_held_ones(self):
            held = {b for sid in self.tokens for b in self.a.block_table(sid)}
            s = self.a.stats()
            assert all(0 <= b < NUM_BLOCKS for b in held), f"a block id outside [0, {NUM_BLOCKS})"
            assert s.used_blocks == len(held), f"stats say {s.used_blocks} used blocks, sequences hold {len(held)}"
            assert s.num_sequences == len(self.tokens)

        @invariant()
        def tables_fit_the_reservations(self):
            for sid, n in self.reserved.items():
                table = self.a.block_table(sid)
                assert len(table) == -(-n // BS), f"{sid}: {len(table)} blocks for {n} slots"
                assert len(set(table)) == len(table), f"{sid} holds a block twice"

        @invariant()
        def only_computed_full_blocks_are_shared(self):
            where: dict[int, list[tuple[str, int]]] = {}
            for sid in self.tokens:
                for i, b in enumerate(self.a.block_table(sid)):
                    where.setdefault(b, []).append((sid, i))
            for b, holders in where.items():
                if len(holders) < 2:
                    continue
                for sid, i in holders:
                    assert (i + 1) * BS <= self.computed[sid], f"block {b} is shared but not full in {sid}"
                    assert self.memory[b] == [(self.salt[sid], t) for t in self.tokens[sid][i * BS : (i + 1) * BS]]

        @invariant()
        def stats_count_what_happened(self):
            s = self.a.stats()
            assert s.prefix_caching
            assert (s.prefix_queries, s.prefix_hits) == (self.queries, self.hits), (
                f"stats report {s.prefix_queries} queried / {s.prefix_hits} hit tokens, "
                f"the allocator was asked {self.queries} and served {self.hits}")
            waste = sum(len(self.a.block_table(sid)) * BS - n for sid, n in self.reserved.items())
            reserved = s.used_blocks * BS
            want = waste / reserved if reserved else 0.0
            assert abs(s.internal_fragmentation - want) < 1e-9, (
                f"internal_fragmentation {s.internal_fragmentation}, the tables waste {want}")

    return AllocatorMachine


def check_allocator(make: Callable[[int, int], CacheAllocator], max_examples: int = 250,
                    steps: int = 40) -> None:
    """Fail with a readable message unless make(num_blocks, block_size) behaves as a CacheAllocator must."""
    run_state_machine_as_test(allocator_machine(make),
                              settings=settings(max_examples=max_examples, stateful_step_count=steps,
                                                deadline=None))


# --- the scheduler ---------------------------------------------------------------------------

request_st = st.tuples(
    st.integers(1, 60),  # prompt length
    st.integers(1, 40),  # max_tokens
    st.integers(0, 2),  # priority (0 unless the scheduler uses priorities)
    st.integers(0, 3),  # which prompt family (shared prefixes)
    st.sampled_from([1, 1, 1, 2, 3]),  # n
)


def prompt_of(length: int, family: int, i: int) -> list[int]:
    """A prompt whose first half is shared by its family (prefix hits) and second half its own."""
    half = length // 2
    return [(family * 31 + k) % 200 for k in range(half)] + [(i * 7 + k) % 200 for k in range(length - half)]


def make_engine(config: dict[str, Any], plugins: Sequence[Any], num_blocks: int, budget: int, max_seqs: int,
                chunked: bool = True, block_size: int = 4, forwards: int = 1) -> tuple[Any, list[str]]:
    """An engine on the fake backend whose schedule() is checked against the budget; also the admission order.
    forwards: the most the fake backend runs a step (its Forwards.most)."""
    sched = {**config.get("scheduler", {}), "max_num_batched_tokens": budget, "max_num_seqs": max_seqs,
             "enable_chunked_prefill": chunked}
    fake = {"max_model_len": 256, "max_decode_forwards": forwards}
    cfg = {**config, "backend": {"name": "fake", "options": fake}, "tokenizer": {"name": "none"},
           "cache": {**config.get("cache", {}), "num_blocks": num_blocks, "block_size": block_size},
           "scheduler": sched}
    eng = Engine(config_from_dict(cfg, "<conformance>"), load_plugins(extra_plugins=list(plugins)))
    order: list[str] = []  # first admission of each sequence, in order
    inner = eng.scheduler.schedule

    def schedule():
        out = inner()
        assert out.num_tokens <= budget, f"scheduled {out.num_tokens} tokens, the budget is {budget}"
        assert sum(r.num_new_tokens for r in out.requests) == out.num_tokens, "token counts do not add up"
        assert len(out.requests) <= max_seqs, f"scheduled {len(out.requests)} sequences, max_num_seqs {max_seqs}"
        for r in out.requests:
            assert r.num_new_tokens >= 1 and r.num_computed_tokens + r.num_new_tokens <= len(r.token_ids)
            if r.request_id not in order:  # a few dozen sequences at most
                order.append(r.request_id)
        return out

    eng.scheduler.schedule = schedule
    return eng, order


def run_requests(eng, reqs, priorities: bool, abort_every: int = 0):
    """Add every request, step to the end (aborting some), and return each sequence's tokens and last output."""
    ids = []
    for i, (plen, mt, prio, fam, n) in enumerate(reqs):
        sp = SamplingParams(max_tokens=mt, ignore_eos=(i % 2 == 0), n=n, temperature=0.0)
        try:
            ids.append(eng.add_request(prompt_of(plen, fam, i), sp, request_id=f"r{i}",
                                       priority=prio if priorities else 0))
        except InvalidRequestError as e:  # a prompt the context cannot hold is refused, queueing nothing
            assert e.code == "context_length_exceeded" and plen >= eng.max_model_len, str(e)
    results: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], Any] = {}
    steps = 0
    while eng.has_unfinished:
        out = eng.step()
        steps += 1
        assert steps < 20000, "the engine makes no progress under this scheduler"
        for o in out.outputs:
            key = (o.request_id, o.index)
            assert key not in finished, f"output after the end for {key}"
            results.setdefault(key, []).extend(o.new_token_ids)
            if o.finished:
                finished[key] = o
        if abort_every and ids and steps % abort_every == 0:
            eng.abort(ids[steps // abort_every % len(ids)])
    return results, finished


def check_scheduler(config: dict[str, Any], plugins: Sequence[Any] = (), max_examples: int = 200,
                    priorities: bool = False, forwards: int = 1) -> None:
    """Fail with a readable message unless the configured scheduler finishes everything, leaks nothing,
    keeps the budget, and gives the same tokens whatever the batching and preemption (and, with `forwards` > 1,
    however many forwards the backend runs a step where the scheduler offers them)."""

    @settings(max_examples=max_examples, deadline=None)
    @given(reqs=st.lists(request_st, min_size=1, max_size=12), num_blocks=st.integers(12, 60),
           budget=st.integers(8, 96), max_seqs=st.integers(1, 8), chunked=st.booleans(),
           abort_every=st.sampled_from([0, 0, 0, 3, 7]))
    def conforms(reqs, num_blocks, budget, max_seqs, chunked, abort_every):
        budget = max(budget, max_seqs)
        # reference: one sequence at a time, a cache that never preempts
        ref, _ = run_requests(make_engine(config, plugins, 4096, 512, 1)[0], reqs, priorities)
        eng, _ = make_engine(config, plugins, num_blocks, budget, max_seqs, chunked, forwards=forwards)
        got, fin = run_requests(eng, reqs, priorities, abort_every)
        for i, r in enumerate(reqs):
            if r[0] >= eng.max_model_len:
                continue  # refused at add_request
            for k in range(r[4]):
                o = fin.get((f"r{i}", k))
                assert o is not None, f"sequence {k} of request r{i} never ended"
                assert o.finish_reason is not FinishReason.ERROR, f"r{i} failed: {o.error}"
        s = eng.scheduler_stats()
        c = s.cache
        assert (s.num_running, s.num_waiting) == (0, 0), f"left running {s.num_running}, waiting {s.num_waiting}"
        assert c.used_blocks == 0 and c.num_sequences == 0, (
            f"leaked {c.used_blocks} blocks of {c.num_sequences} sequences")
        assert c.free_blocks + c.cached_free_blocks == num_blocks
        for key, toks in got.items():
            o = fin[key]
            if o.finish_reason is FinishReason.ABORT:
                continue
            if len(toks) < len(ref[key]):  # the small cache caps the context: cut at exactly that length
                assert o.finish_reason is FinishReason.LENGTH
                assert o.num_prompt_tokens + len(toks) == eng.max_model_len
            assert toks == ref[key][: len(toks)], f"{key} differs under batching/preemption"

    conforms()
