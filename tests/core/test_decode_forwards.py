"""Several forwards a step (scheduler.num_scheduler_steps): the same tokens, stops, text and blocks as one a step."""

from __future__ import annotations

import pytest

from llmserve.batch import ScheduledRequest
from llmserve.engine import Engine
from llmserve.request import FinishReason, Request, SamplingParams
from llmserve.testing import check_scheduler
from llmserve_fake import next_token
from llmserve_paged_cache.allocator import PagedAllocator
from llmserve_scheduler import ContinuousScheduler


def engine(steps: int, forwards: int = 8, max_seqs: int = 4, num_blocks: int = 256, tokenizer: str = "none",
           rows: int | None = None):
    return Engine.from_config({
        "backend": {"name": "fake", "options": {"max_decode_forwards": forwards, "max_decode_forward_rows": rows}},
        "tokenizer": {"name": tokenizer}, "cache": {"num_blocks": num_blocks, "block_size": 4},
        "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 64, "num_scheduler_steps": steps}})


def run(eng, requests):
    """Add (prompt, params) pairs, step to the end: each sequence's outputs and every step's metrics."""
    ids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(requests)]
    outs: dict[tuple[str, int], list] = {}
    steps = []
    while eng.has_unfinished:
        so = eng.step()
        if so.metrics is not None:
            steps.append(so.metrics)
        keys = [(o.request_id, o.index) for o in so.outputs]
        assert len(keys) == len(set(keys)), "a sequence got two deltas in one step"
        for o in so.outputs:
            outs.setdefault((o.request_id, o.index), []).append(o)
    return ids, outs, steps


def summary(outs):
    """Each sequence's tokens, text, finish and stop reasons and output count."""
    return {k: ([t for o in v for t in o.new_token_ids], "".join(o.new_text for o in v), v[-1].finish_reason,
                v[-1].stop_reason, v[-1].num_output_tokens, v[-1].finished) for k, v in outs.items()}


def stream(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks, len(toks), 257, 256))
    return toks[len(prompt):]


def requests():
    p = [[1, 2, 3], [9, 8, 7, 6, 5], [4] * 11, [200, 100]]
    s3 = stream(p[3], 40)
    return [
        (p[0], SamplingParams(max_tokens=29, ignore_eos=True)),  # not a multiple of 8: the last step clamps
        (p[1], SamplingParams(max_tokens=50)),  # ends at the fake model's EOS or at 50
        (p[2], SamplingParams(max_tokens=40, ignore_eos=True, n=3)),  # fan-out
        (p[3], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[s3[10]])),  # stops inside a run
        (p[3], SamplingParams(max_tokens=3, ignore_eos=True)),  # fewer tokens than one run
    ]


def test_several_forwards_a_step_give_what_one_a_step_gives():
    one = engine(1)
    _, ref, ref_steps = run(one, requests())
    many = engine(8)
    _, got, steps = run(many, requests())
    assert summary(got) == summary(ref)
    assert summary(got)[("r3", 0)][2:4] == (FinishReason.STOP, stream([200, 100], 40)[10])
    assert summary(got)[("r0", 0)][4] == 29
    assert max(m.num_forwards for m in steps) == 8 and all(m.num_forwards == 1 for m in ref_steps)
    assert len(steps) < len(ref_steps) / 2
    # the tokens a step's forwards made are counted, and the blocks come back
    assert sum(m.num_output_tokens for m in steps) == sum(m.num_output_tokens for m in ref_steps)
    for eng in (one, many):
        c = eng.scheduler_stats().cache
        assert c.used_blocks == 0 and c.num_sequences == 0


def test_each_forward_reaches_the_streams_as_it_ends():
    """With somewhere for outputs to go mid-step (Engine.early: the async engine's delivery), each forward the backend
    hands on (ModelBackend.on_forward) is replayed then and its outputs go there at once, one delta a sequence; the
    rest with the step's. The same tokens, text, stops and blocks as one forward a step."""
    _, ref, ref_steps = run(engine(1), requests())
    eng = engine(8)
    eng.config.scheduler.stream_interval = 1
    early: list[list] = []
    eng.early = early.append
    ids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(requests())]
    outs: dict[tuple[str, int], list] = {}
    steps = []
    while eng.has_unfinished:
        so = eng.step()
        steps.append(so.metrics)
        for batch in [*early, so.outputs]:
            keys = [(o.request_id, o.index) for o in batch]
            assert len(keys) == len(set(keys)), "a sequence got two deltas in one delivery"
            for o in batch:
                outs.setdefault((o.request_id, o.index), []).append(o)
        early.clear()
    assert len(ids) == 5 and summary(outs) == summary(ref)
    assert max(m.num_forwards for m in steps) == 8
    assert sum(m.num_output_tokens for m in steps) == sum(m.num_output_tokens for m in ref_steps)
    c = eng.scheduler_stats().cache
    assert c.used_blocks == 0 and c.num_sequences == 0


def test_a_stream_gets_a_runs_tokens_stream_interval_at_a_time():
    eng = engine(8)
    assert eng.config.scheduler.stream_interval == 2  # the default
    early: list[list] = []
    eng.early = early.append
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=17, ignore_eos=True), request_id="r")
    eng.step()  # the prompt, and its first token
    so = eng.step()  # a run of 8: the fake backend hands on the first 7 before execute returns
    assert [len(batch[0].new_token_ids) for batch in early] == [2, 2, 2]
    assert len(so.outputs) == 1 and len(so.outputs[0].new_token_ids) == 2  # the 7th held, the 8th replayed after
    assert [t for b in early for t in b[0].new_token_ids] + so.outputs[0].new_token_ids == \
        stream([1, 2, 3], 9)[1:]


def test_a_forward_as_long_as_stream_hold_ms_sends_its_tokens_at_once():
    """stream_interval 8 holds a run's tokens for one delivery, unless a forward took stream_hold_ms or longer: then
    what it made goes out at once (here every forward: a hold of 0)."""
    got = {}
    for hold in (60_000.0, 0.0):
        eng = engine(8)
        eng.config.scheduler.stream_interval, eng.config.scheduler.stream_hold_ms = 8, hold
        early: list[list] = []
        eng.early = early.append
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=17, ignore_eos=True), request_id="r")
        eng.step()  # the prompt, and its first token
        so = eng.step()  # a run of 8: the fake backend hands on the first 7 before execute returns
        got[hold] = [len(b[0].new_token_ids) for b in early], [len(o.new_token_ids) for o in so.outputs]
    assert got[60_000.0] == ([], [8])  # all eight with the step
    assert got[0.0] == ([1] * 7, [1])  # one a forward, the eighth replayed with the step


def test_a_step_run_by_a_relay_that_fails_fails_like_any_step():
    eng = engine(8)
    eng.early = lambda outputs: None
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()  # the prompt: one forward
    boom = RuntimeError("replay failed")

    def fail(*a, **k):
        raise boom

    eng._postprocess = fail
    relayed, inner = [], eng.backend.execute
    eng.backend.execute = lambda batch: (relayed.append(eng.backend.on_forward is not None), inner(batch))[1]
    with pytest.raises(RuntimeError, match="replay failed"):
        eng.step()
    assert relayed == [True] and eng.backend.on_forward is None  # raised from the relay's replay; listener gone


def test_stop_strings_and_text_match_across_a_run():
    # byte tokenizer: the stop string is found in text detokenized a forward at a time
    prompt = [104, 105]
    text = bytes(t for t in stream(prompt, 60) if t < 256).decode("utf-8", errors="replace")
    stop = text[17:19]
    reqs = [(prompt, SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop]))]
    _, ref, _ = run(engine(1, tokenizer="byte"), reqs)
    _, got, steps = run(engine(8, tokenizer="byte"), reqs)
    assert summary(got) == summary(ref)
    assert summary(got)[("r0", 0)][2:4] == (FinishReason.STOP, stop)
    assert any(m.num_forwards > 1 for m in steps)


def test_tokens_of_a_run_are_stamped_apart():
    eng = engine(8, forwards=8)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=17, ignore_eos=True))
    while eng.has_unfinished:
        eng.step()
    itl = eng.collector.itl
    assert len(itl) == 16 and min(itl) > 0  # each forward's share of the step, not 0 for all but one


def test_no_run_where_the_backend_runs_one_forward():
    eng = engine(8, forwards=1)
    assert eng.scheduler_stats().num_scheduler_steps == 1  # limit_forwards: no blocks reserved ahead for nothing
    assert engine(8, forwards=64).stats()["scheduler"]["num_scheduler_steps"] == 8  # what /stats shows
    _, _, steps = run(eng, requests())
    assert all(m.num_forwards == 1 for m in steps)


def test_no_run_for_more_sequences_than_the_backend_runs_ahead():
    """A backend that runs several forwards for at most two sequences (max_decode_forward_rows): with three
    decoding, one forward a step and no blocks reserved ahead; once two are left, runs of eight. The tokens are
    one forward a step's."""
    eng = engine(8, forwards=8, rows=2)
    grown = []  # blocks each step's sequences hold past what their tokens need
    inner = eng.scheduler.schedule

    def schedule():
        out = inner()
        alloc = eng.scheduler.allocator
        grown.append((len(out.requests), out.num_steps, max(
            (len(alloc.block_table(r.request_id)) * 4 - len(r.token_ids) for r in out.requests), default=0)))
        return out

    eng.scheduler.schedule = schedule
    reqs = [([1, 2, 3], SamplingParams(max_tokens=m, ignore_eos=True)) for m in (12, 30, 45)]
    _, got, steps = run(eng, reqs)
    assert summary(got) == summary(run(engine(1), reqs)[1])
    assert all(k == 1 and spare < 4 for n, k, spare in grown if n == 3)  # (a block's slack at most)
    assert any(k == 8 for n, k, _ in grown if n <= 2)
    assert max(m.num_forwards for m in steps) == 8


def _decoding(sched, alloc, rid, prompt, max_tokens=100):
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), 0.0, max_total_tokens=len(prompt) + max_tokens)
    sched.add(r)
    out = sched.schedule()
    assert [s.request_id for s in out.requests] == [rid]
    r.num_computed_tokens = len(prompt)
    r.token_ids.append(7)  # its first token: it decodes from now on
    return r


def test_a_run_only_where_no_waiting_sequence_could_join():
    alloc = PagedAllocator(num_blocks=8, block_size=4)
    sched = ContinuousScheduler(alloc, max_num_seqs=2, max_num_batched_tokens=64, num_scheduler_steps=4)
    a = _decoding(sched, alloc, "a", [1, 2, 3, 4, 5])
    out = sched.schedule()
    assert out.num_steps == 4 and out.num_decode_tokens == 1
    # blocks reserved for all four forwards: positions 5..8
    assert len(alloc.block_table("a")) * 4 >= a.num_computed_tokens + 4
    a.num_computed_tokens += 4
    a.token_ids.extend([7, 7, 7, 7])
    # a waiting sequence with a free seat but no blocks: one forward, so it joins as soon as blocks free
    sched.add(Request("b", list(range(24)), SamplingParams(max_tokens=5), 0.0, max_total_tokens=29))
    out = sched.schedule()
    assert [s.request_id for s in out.requests] == ["a"] and sched.num_waiting == 1 and out.num_steps == 1


def test_a_run_stops_at_the_token_limit_and_where_blocks_run_out():
    alloc = PagedAllocator(num_blocks=3, block_size=4)
    sched = ContinuousScheduler(alloc, max_num_seqs=1, max_num_batched_tokens=64, num_scheduler_steps=8)
    _decoding(sched, alloc, "a", [1, 2, 3], max_tokens=3)
    assert sched.schedule().num_steps == 2  # 4 of 6 tokens there: two more forwards, not eight
    sched.finish(["a"])
    sched.schedule()
    _decoding(sched, alloc, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=50)
    assert sched.schedule().num_steps == 1  # 8 forwards need 5 blocks of 3: none reserved, nobody preempted
    assert len(alloc.block_table("b")) == 3 and sched.num_running == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_scheduler_conforms_with_several_forwards_a_step(policy):
    check_scheduler({"scheduler": {"name": "continuous", "policy": policy, "num_scheduler_steps": 8}},
                    priorities=policy == "priority", forwards=8, max_examples=120)


def test_scheduled_request_is_unchanged_by_a_run():
    # the batch the backend reads: a decode's one new token; the forwards after it are the backend's
    alloc = PagedAllocator(num_blocks=8, block_size=4)
    sched = ContinuousScheduler(alloc, max_num_seqs=1, max_num_batched_tokens=64, num_scheduler_steps=4)
    _decoding(sched, alloc, "a", [1, 2, 3, 4, 5])
    (sr,) = sched.schedule().requests
    assert isinstance(sr, ScheduledRequest) and sr.num_new_tokens == 1 and sr.num_computed_tokens == 5
