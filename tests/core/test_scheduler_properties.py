"""Scheduler properties over random workloads, run through the real engine and fake backend."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.engine import Engine
from llmserve.hookspecs import hookimpl
from llmserve.interfaces import MetricSink
from llmserve.request import FinishReason, SamplingParams


class _Recorder(MetricSink):
    def __init__(self):
        self.steps = []
        self.requests = []

    def on_step(self, m):
        self.steps.append(m)

    def on_request_finished(self, m):
        self.requests.append(m)


class RecorderPlugin:
    """A test plugin registering a metric sink through the real hook."""

    __name__ = "recorder"

    def __init__(self):
        self.sink = _Recorder()

    @hookimpl
    def register_metric_sinks(self, register):
        register("recorder", lambda config, options: self.sink)


def make_engine(num_blocks, budget, max_seqs, policy="fcfs", chunked=True, block_size=4):
    rec = RecorderPlugin()
    cfg = {
        "backend": {"name": "fake", "options": {"max_model_len": 256}},
        "tokenizer": {"name": "none"},
        "cache": {"num_blocks": num_blocks, "block_size": block_size},
        "scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs, "policy": policy,
                      "enable_chunked_prefill": chunked},
        "metrics": {"sinks": ["recorder"]},
    }
    eng = Engine.from_config(cfg, extra_plugins=[rec])
    order: list[str] = []  # first admission of each sequence, in order
    seen: set[str] = set()
    inner = eng.scheduler.schedule

    def schedule():
        batch = inner()
        assert batch.num_tokens <= budget
        assert sum(r.num_new_tokens for r in batch.requests) == batch.num_tokens
        assert len(batch.requests) <= max_seqs
        for r in batch.requests:
            if r.request_id not in seen:
                seen.add(r.request_id)
                order.append(r.request_id)
        return batch

    eng.scheduler.schedule = schedule
    return eng, rec, order


request_st = st.tuples(
    st.integers(1, 60),  # prompt length
    st.integers(1, 40),  # max_tokens
    st.integers(0, 2),  # priority
    st.integers(0, 3),  # which prompt family (shared prefixes)
    st.sampled_from([1, 1, 1, 2, 3]),  # n
)


def prompt_of(length: int, family: int, i: int) -> list[int]:
    return [(family * 31 + k) % 200 for k in range(length // 2)] + [(i * 7 + k) % 200 for k in range(length - length // 2)]


def run_all(eng, reqs, abort_every=0):
    ids = []
    for i, (plen, mt, prio, fam, n) in enumerate(reqs):
        sp = SamplingParams(max_tokens=mt, ignore_eos=(i % 2 == 0), n=n, temperature=0.0)
        ids.append(eng.add_request(prompt_of(plen, fam, i), sp, request_id=f"r{i}", priority=prio))
    results: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], object] = {}
    steps = 0
    while eng.has_unfinished:
        out = eng.step()
        steps += 1
        assert steps < 20000, "the engine does not make progress"
        for o in out.outputs:
            key = (o.request_id, o.index)
            assert key not in finished, f"output after the end for {key}"
            results.setdefault(key, []).extend(o.new_token_ids)
            if o.finished:
                finished[key] = o
        if abort_every and steps % abort_every == 0 and ids:
            eng.abort(ids[steps // abort_every % len(ids)])
    return results, finished


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(request_st, min_size=1, max_size=14),
    num_blocks=st.integers(4, 80),
    budget=st.integers(8, 96),
    max_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    abort_every=st.sampled_from([0, 0, 0, 3, 7]),
)
def test_every_request_ends_and_nothing_leaks(reqs, num_blocks, budget, max_seqs, policy, chunked, abort_every):
    budget = max(budget, max_seqs)
    eng, rec, order = make_engine(num_blocks, budget, max_seqs, policy, chunked)
    results, finished = run_all(eng, reqs, abort_every)
    # every sequence ended, once, with a reason; failures say why
    for i, (_, _, _, _, n) in enumerate(reqs):
        for k in range(n):
            o = finished[(f"r{i}", k)]
            assert o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR)
            if o.finish_reason is FinishReason.ERROR:
                assert o.error and "maximum context" in o.error
    # no block leaks, nothing left queued
    s = eng.allocator.stats()
    assert s["used_blocks"] == 0 and s["num_sequences"] == 0
    assert s["free_blocks"] + s["cached_free_blocks"] == num_blocks
    assert eng.num_running == 0 and eng.num_waiting == 0 and not eng._seqs and not eng._groups
    for m in rec.sink.steps:
        assert m.num_scheduled_tokens <= budget and m.batch_size <= max_seqs


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(request_st, min_size=2, max_size=12), num_blocks=st.integers(16, 60),
       max_seqs=st.integers(1, 6), policy=st.sampled_from(["fcfs", "priority"]))
def test_admission_follows_the_policy(reqs, num_blocks, max_seqs, policy):
    reqs = [(p, m, pr, f, 1) for p, m, pr, f, _ in reqs]  # forks join running directly: n=1 here
    eng, _, order = make_engine(num_blocks, 64, max_seqs, policy)
    run_all(eng, reqs)
    first = [int(rid[1:]) for rid in order]
    if policy == "fcfs":
        key = lambda i: i  # noqa: E731
    else:
        key = lambda i: (reqs[i][2], i)  # noqa: E731
    admitted_failures = {i for i, (p, *_rest) in enumerate(reqs) if p >= eng.max_model_len}
    first = [i for i in first if i not in admitted_failures]
    assert first == sorted(first, key=key), f"admission order {first} breaks {policy}"


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(request_st, min_size=1, max_size=10), num_blocks=st.integers(12, 40),
       budget=st.integers(4, 40), max_seqs=st.integers(1, 6), chunked=st.booleans())
def test_outputs_do_not_depend_on_batching_or_preemption(reqs, num_blocks, budget, max_seqs, chunked):
    budget = max(budget, max_seqs)
    # reference: one sequence at a time, a cache that never preempts
    ref_eng, _, _ = make_engine(4096, 512, 1)
    ref, _ = run_all(ref_eng, reqs)
    eng, rec, _ = make_engine(num_blocks, budget, max_seqs, chunked=chunked)
    got, fin = run_all(eng, reqs)
    for key, toks in got.items():
        o = fin[key]
        if o.finish_reason is FinishReason.ERROR:
            continue  # too long for the small cache: fails either way, and says so
        if len(toks) < len(ref[key]):
            # the small cache caps the context: cut at exactly that length, else the same tokens
            assert o.finish_reason is FinishReason.LENGTH
            assert o.num_prompt_tokens + len(toks) == eng.max_model_len
        assert toks == ref[key][: len(toks)], f"{key} differs under batching/preemption"
