"""Engine lifecycle through the fake backend: stops, limits, n>1, aborts, failures, detokenization."""

from __future__ import annotations

import pytest

from llmserve.engine import Engine
from llmserve.errors import InvalidRequestError
from llmserve.hookspecs import hookimpl
from llmserve.interfaces import Tokenizer
from llmserve.request import FinishReason, SamplingParams
from llmserve_fake import next_token


class BytesTokenizer(Tokenizer):
    """ids 0..255 are bytes, 256 is EOS: multi-byte characters span several tokens."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class TokPlugin:
    __name__ = "test-tokenizer"

    @hookimpl
    def register_tokenizers(self, register):
        register("test-bytes", lambda config: BytesTokenizer())


def engine(num_blocks=256, budget=64, max_seqs=8, tokenizer="none", max_model_len=None, **backend_opts):
    cfg = {
        "backend": {"name": "fake", "options": backend_opts},
        "tokenizer": {"name": tokenizer},
        "cache": {"num_blocks": num_blocks, "block_size": 4},
        "scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs},
    }
    if max_model_len:
        cfg["model"] = {"max_model_len": max_model_len}
    return Engine.from_config(cfg, extra_plugins=[TokPlugin()])


def drain(eng):
    got: dict[tuple[str, int], list] = {}
    final = {}
    while eng.has_unfinished:
        for o in eng.step().outputs:
            got.setdefault((o.request_id, o.index), []).append(o)
            if o.finished:
                final[(o.request_id, o.index)] = o
    return got, final


def expected_tokens(prompt, n, vocab=257):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks, len(toks), vocab, 256))
    return toks[len(prompt):]


def test_max_tokens_gives_length_and_exact_tokens():
    eng = engine()
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True))
    got, final = drain(eng)
    toks = [t for o in got[(rid, 0)] for t in o.new_token_ids]
    assert toks == expected_tokens([5, 6, 7], 9)
    assert final[(rid, 0)].finish_reason is FinishReason.LENGTH
    assert final[(rid, 0)].num_output_tokens == 9


def test_stop_token_id_stops_and_is_reported():
    prompt = [1, 2, 3]
    stream = expected_tokens(prompt, 6)
    eng = engine()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=50, stop_token_ids=[stream[3]], ignore_eos=True))
    _, final = drain(eng)
    o = final[(rid, 0)]
    assert o.finish_reason is FinishReason.STOP and o.stop_reason == stream[3]
    assert o.num_output_tokens == 4


def test_min_tokens_defers_a_stop_token():
    prompt = [1, 2, 3]
    stream = expected_tokens(prompt, 6)
    eng = engine()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=6, stop_token_ids=[stream[0]], min_tokens=3,
                                                 ignore_eos=True))
    _, final = drain(eng)
    assert final[(rid, 0)].num_output_tokens >= 3


def test_max_model_len_caps_generation():
    eng = engine(max_model_len=12)
    rid = eng.add_request(list(range(10)), SamplingParams(max_tokens=100, ignore_eos=True))
    _, final = drain(eng)
    assert final[(rid, 0)].finish_reason is FinishReason.LENGTH
    assert final[(rid, 0)].num_output_tokens == 2


def test_prompt_that_can_never_fit_is_refused_with_a_message():
    eng = engine(num_blocks=4)  # 16 slots
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(list(range(20)), SamplingParams(max_tokens=4))
    assert e.value.code == "context_length_exceeded" and "16 tokens" in str(e.value) and "20 tokens" in str(e.value)
    assert not eng.has_unfinished
    assert eng.scheduler_stats().cache.used_blocks == 0


def test_bad_input_raises_and_queues_nothing():
    eng = engine()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1, 999], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        eng.generate([[1]], SamplingParams(temperature=-1))  # the offline convenience validates; add_request trusts
    assert e.value.param == "temperature"
    eng.add_request([1], SamplingParams(), request_id="dup")
    with pytest.raises(InvalidRequestError):
        eng.add_request([1], SamplingParams(), request_id="dup")
    assert eng.num_waiting == 1


def test_abort_frees_blocks_within_the_step():
    eng = engine()
    a = eng.add_request(list(range(30)), SamplingParams(max_tokens=100, ignore_eos=True))
    b = eng.add_request(list(range(10)), SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    used_before = eng.scheduler_stats().cache.used_blocks
    assert eng.abort(a)
    assert eng.scheduler_stats().cache.used_blocks < used_before
    got, final = drain(eng)
    assert final[(a, 0)].finish_reason is FinishReason.ABORT
    assert final[(b, 0)].finish_reason is FinishReason.LENGTH
    assert eng.scheduler_stats().cache.used_blocks == 0
    assert not eng.abort(a)  # gone


def test_n_completions_fan_out_and_share_the_prompt_through_the_prefix_cache():
    eng = engine()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4, then 2 more
    rid = eng.add_request(prompt, SamplingParams(max_tokens=5, n=3, ignore_eos=True))
    prefill = []
    got, final = {}, {}
    while eng.has_unfinished:
        so = eng.step()
        prefill.append(so.metrics.num_prefill_tokens)
        for o in so.outputs:
            got.setdefault((o.request_id, o.index), []).append(o)
            if o.finished:
                final[(o.request_id, o.index)] = o
    assert sorted(k[1] for k in final) == [0, 1, 2]
    exp = expected_tokens(prompt, 5)
    for i in range(3):
        assert [t for o in got[(rid, i)] for t in o.new_token_ids] == exp
    # the first computes the whole prompt; the others, admitted after it, reuse its 2 full blocks
    assert prefill[:2] == [10, 2 + 2]
    assert [final[(rid, i)].num_cached_tokens for i in range(3)] == [0, 8, 8]
    assert eng.scheduler_stats().cache.used_blocks == 0


def test_n_completions_without_prefix_caching_compute_the_prompt_n_times():
    cfg = {"backend": {"name": "fake"}, "tokenizer": {"name": "none"},
           "cache": {"num_blocks": 64, "block_size": 4, "enable_prefix_caching": False}}
    eng = Engine.from_config(cfg)
    eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=2, n=3, ignore_eos=True))
    assert eng.step().metrics.num_prefill_tokens == 30  # all three at once, each its own prompt
    drain(eng)


def test_n_completions_end_together_when_the_first_fails_before_the_others_start():
    eng = engine()
    rid = eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=3, n=3, ignore_eos=True))
    eng.backend.fail_next = RuntimeError("boom")
    out = eng.step().outputs
    assert sorted(o.index for o in out) == [0, 1, 2]
    assert all(o.finish_reason is FinishReason.ERROR and "boom" in o.error for o in out)
    assert not eng.has_unfinished and eng.scheduler_stats().cache.used_blocks == 0
    assert not eng.abort(rid)


def test_a_priority_under_a_policy_that_ignores_it_is_refused_naming_priority():
    eng = engine()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1, 2, 3], SamplingParams(), priority=2)
    assert e.value.param == "priority" and "fcfs" in str(e.value)
    assert not eng.has_unfinished


def test_backend_failure_fails_that_batch_only_and_engine_continues():
    eng = engine()
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.backend.fail_next = RuntimeError("boom")
    out = eng.step().outputs
    assert out and out[0].finish_reason is FinishReason.ERROR and "boom" in out[0].error
    assert eng.scheduler_stats().cache.used_blocks == 0
    b = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    _, final = drain(eng)
    assert final[(b, 0)].finish_reason is FinishReason.LENGTH
    assert a != b


def fail_on_seed(eng, seed):
    """Make the backend fail every batch holding a sequence with this seed (a fault only its parameters trigger)."""
    execute = eng.backend.execute

    def faulty(batch):
        if any(sr.sampling.seed == seed for sr in batch.requests):
            raise ValueError("Overflow when unpacking long long")
        return execute(batch)

    eng.backend.execute = faulty


def test_a_backend_fault_one_request_triggers_fails_that_request_alone():
    eng = engine()
    fail_on_seed(eng, 666)
    sp = dict(max_tokens=6, ignore_eos=True)
    good = [eng.add_request([i, i + 1, i + 2], SamplingParams(**sp)) for i in range(1, 6)]
    bad = eng.add_request([9, 9, 9], SamplingParams(seed=666, **sp))
    got, final = drain(eng)
    assert final[(bad, 0)].finish_reason is FinishReason.ERROR
    assert "Overflow" in final[(bad, 0)].error
    for i, rid in enumerate(good, start=1):  # the others ran to the end, with the tokens they get alone
        assert final[(rid, 0)].finish_reason is FinishReason.LENGTH and final[(rid, 0)].error is None
        assert [t for o in got[(rid, 0)] for t in o.new_token_ids] == expected_tokens([i, i + 1, i + 2], 6)
    assert eng.scheduler_stats().cache.used_blocks == 0


def test_priority_policy_runs_urgent_requests_first():
    cfg = {"backend": {"name": "fake"}, "tokenizer": {"name": "none"}, "cache": {"num_blocks": 64},
           "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 64, "policy": "priority"}}
    eng = Engine.from_config(cfg)
    order = []
    for i, prio in enumerate([5, 1, 3]):
        eng.add_request([i + 1] * 4, SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"p{prio}", priority=prio)
    while eng.has_unfinished:
        for o in eng.step().outputs:
            if o.finished:
                order.append(o.request_id)
    assert order == ["p1", "p3", "p5"]


def test_prefix_cache_hits_skip_prefill_work():
    eng = engine(budget=512)
    system = list(range(40))
    eng.add_request(system + [100], SamplingParams(max_tokens=2, ignore_eos=True))
    drain(eng)
    eng.add_request(system + [101, 102], SamplingParams(max_tokens=2, ignore_eos=True))
    m = eng.step().metrics
    assert m.prefix_cache_hits == 40 and m.num_prefill_tokens == 2
    _, final = drain(eng)
    assert [o.num_cached_tokens for o in final.values()] == [40]


def test_detokenized_text_streams_and_never_splits_a_character():
    eng = engine(tokenizer="test-bytes")
    text = "héllo wörld ✓"
    # a fake stream: the "model" repeats what we feed through stop_token_ids-free decoding
    from llmserve.detokenize import IncrementalDetokenizer

    d = IncrementalDetokenizer(BytesTokenizer(), [], stop=[])
    pieces = [d.add(t)[0] for t in text.encode()] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # through the engine: the concatenated deltas equal decoding all tokens at once
    rid = eng.add_request(list("abc".encode()), SamplingParams(max_tokens=40, ignore_eos=True))
    got, _ = drain(eng)
    toks = [t for o in got[(rid, 0)] for t in o.new_token_ids]
    assert "".join(o.new_text for o in got[(rid, 0)]) == BytesTokenizer().decode(toks)


def test_stop_strings_spanning_tokens_are_never_emitted():
    from llmserve.detokenize import IncrementalDetokenizer

    tok = BytesTokenizer()
    d = IncrementalDetokenizer(tok, [], stop=["STOP", "xyz"])
    out, hit = [], None
    for t in "hello wSTOPorld".encode():
        piece, hit = d.add(t)
        out.append(piece)
        if hit:
            break
    assert "".join(out) == "hello w" and hit == "STOP"
    d = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    pieces = []
    for t in "ab STOP cd".encode():
        p, hit = d.add(t)
        pieces.append(p)
        if hit:
            break
    assert "".join(pieces) == "ab STOP"


def test_stop_string_through_the_engine():
    eng = engine(tokenizer="test-bytes")
    prompt = list("abc".encode())
    full = BytesTokenizer().decode(expected_tokens(prompt, 40))
    # the fake "model" writes random bytes: stop on the first plain two-letter run past the start
    at = next(i for i in range(4, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[at:at + 2]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    got, final = drain(eng)
    text = "".join(o.new_text for o in got[(rid, 0)])
    assert final[(rid, 0)].stop_reason == stop
    assert stop not in text and full.startswith(text)


def test_metrics_snapshot_and_sinks_report_latencies():
    eng = engine(step_cost_s=0.001)
    for i in range(5):
        eng.add_request([i + 1] * 6, SamplingParams(max_tokens=4, ignore_eos=True))
    drain(eng)
    snap = eng.metrics_snapshot()
    assert snap["requests_finished"] == {"length": 5}
    assert snap["generation_tokens"] == 20 and snap["prompt_tokens"] == 30
    # the per-step totals (what live rates are made of): each prefill samples a token, each decode one more
    assert snap["step_tokens"] == {"prefill": 30, "decode": 15, "output": 20}
    lat = snap["latency_seconds"]
    assert lat["ttft"]["count"] == 5 and lat["ttft"]["p50"] >= 0.001
    assert lat["itl"]["count"] == 15 and lat["itl"]["p99"] >= lat["itl"]["p50"] > 0
    assert snap["step_seconds"]["backend"]["p50"] >= 0.001
    st = eng.stats()
    assert st["cache"]["used_blocks"] == 0 and st["waiting"] == 0


def test_jsonl_sink_writes_steps_and_requests(tmp_path):
    import json

    path = tmp_path / "m.jsonl"
    cfg = {"backend": {"name": "fake"}, "tokenizer": {"name": "none"},
           "metrics": {"sinks": [{"name": "jsonl", "options": {"path": str(path), "flush_every": 1}}]}}
    eng = Engine.from_config(cfg)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["event"] for r in rows} == {"step", "request"}
    req = [r for r in rows if r["event"] == "request"][0]
    assert req["num_output_tokens"] == 3 and req["finish_reason"] == "length"


class MetaspaceLikeTokenizer(Tokenizer):
    """Decodes like SentencePiece: '▁' is a space, and a decode drops its own leading space."""

    eos_token_id = 0
    vocab_size = 4
    pieces = {0: "</s>", 1: "▁world", 2: "<sep>", 3: "▁user"}

    @property
    def all_special_ids(self):
        return {0, 2}

    def encode(self, text, add_special_tokens=True):
        raise NotImplementedError

    def decode(self, token_ids, skip_special_tokens=True):
        text = "".join(self.pieces[t] for t in token_ids if not (skip_special_tokens and t in self.all_special_ids))
        return text.replace("▁", " ").removeprefix(" ")


def test_streaming_keeps_the_space_after_a_skipped_special_token():
    from llmserve.detokenize import IncrementalDetokenizer

    tok = MetaspaceLikeTokenizer()
    ids = [1, 2, 3, 1]
    d = IncrementalDetokenizer(tok, [3], stop=[])
    streamed = "".join(d.add(t)[0] for t in ids) + d.flush()
    assert streamed == tok.decode([3] + ids)[len(tok.decode([3])):]
    assert streamed == " world user world"


class TokenizerFilesPlugin:
    """A fake backend whose model source produced tokenizer files, and a tokenizer that records its config."""

    __name__ = "test-tokenizer-path"

    def __init__(self):
        self.seen: list[str | None] = []

    @hookimpl
    def register_backends(self, register):
        from llmserve_fake.backend import FakeBackend

        def build(config):
            b = FakeBackend()
            b.default_tokenizer = "test-record"
            b.tokenizer_path = "/cache/converted"
            return b

        register("fake-with-tokenizer-files", build)

    @hookimpl
    def register_tokenizers(self, register):
        def build(config):
            self.seen.append(config.model.tokenizer)
            return BytesTokenizer()

        register("test-record", build)


@pytest.mark.parametrize("configured, expected", [(None, "/cache/converted"), ("./mine", "./mine")])
def test_backend_tokenizer_path_is_the_default_tokenizer_location(configured, expected):
    plugin = TokenizerFilesPlugin()
    cfg = {"backend": {"name": "fake-with-tokenizer-files"}, "cache": {"num_blocks": 16},
           "model": {"tokenizer": configured}}
    eng = Engine.from_config(cfg, extra_plugins=[plugin])
    assert plugin.seen == [expected]
    assert eng.config.model.tokenizer == configured  # the shared config is not rewritten


def test_only_the_scheduler_moves_a_sequence_and_the_engine_ends_it_through_end():
    """Every status change happens inside a scheduler call (add, schedule, update_from_output, end): none between
    them, through preemption, a finish, an abort and a failure; the verdicts come through Scheduler.end."""
    eng = engine(num_blocks=12, max_seqs=4)  # 48 slots for four sequences of 28 tokens: they preempt each other
    sched = eng.scheduler
    held: dict[str, object] = {}  # request id → Request, from add
    left: dict[str, object] = {}  # request id → the status the last scheduler call left it in
    moves: dict[str, list] = {}

    def watch(name):
        method = getattr(sched, name)

        def call(*args):
            for rid, req in held.items():
                assert req.status is left[rid], f"{rid} became {req.status} outside the scheduler"
            if name == "add":
                held[args[0].request_id] = args[0]
            result = method(*args)
            for rid, req in held.items():
                if left.get(rid) is not req.status:
                    moves.setdefault(rid, []).append(req.status.value)
                left[rid] = req.status
            return result
        setattr(sched, name, call)

    for name in ("add", "schedule", "update_from_output", "end"):
        watch(name)
    fail_on_seed(eng, 7)
    ids = [eng.add_request(list(range(8)), SamplingParams(max_tokens=20, ignore_eos=True, seed=s)) for s in range(4)]
    bad = eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True, seed=7))
    for _ in range(8):
        eng.step()
    assert eng.abort(ids[3])
    _, final = drain(eng)
    assert [final[(i, 0)].finish_reason for i in ids[:3]] == [FinishReason.LENGTH] * 3
    assert final[(ids[3], 0)].finish_reason is FinishReason.ABORT and moves[ids[3]][-1] == "finished"
    assert final[(bad, 0)].finish_reason is FinishReason.ERROR and moves[bad] == ["waiting", "prefill", "failed"]
    assert moves[ids[0]] == ["waiting", "prefill", "decode", "finished"]
    assert eng.scheduler_stats().num_preemptions > 0
    assert any("decode" in m[m.index("waiting", 1):] for m in moves.values() if "waiting" in m[1:])  # back and on
