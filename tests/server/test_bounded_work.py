"""Bounded work per request: integer fields have upper bounds, fan-out is capped, admission counts a request's sequences."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from tests.server.conftest import FAKE, start_server


@pytest.fixture(scope="module")
def srv():
    s = start_server(FAKE | {"server": {"max_prompts_per_request": 16, "max_sequences_per_request": 32}})
    yield s
    s.stop()


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "top_k": 9223372036854775808, "temperature": 1}, "top_k"),
    ({"prompt": "hi", "top_k": 2**31}, "top_k"),
    ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "stop_token_ids": [2**33]}, "stop_token_ids"),
    ({"prompt": ["ab"] * 5000, "n": 128, "max_tokens": 1}, "prompt"),
    ({"prompt": ["ab"] * 17, "max_tokens": 1}, "prompt"),
    ({"prompt": ["ab"] * 8, "n": 5, "max_tokens": 1}, "n"),
    # lists every token of the request is checked against
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(257)]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"prompt": "hi", "bad_words": [f"w{i}" for i in range(1025)]}, "bad_words"),
    # a whole answer of 32 × 4000 tokens × 21 logprobs: hundreds of MB (streamed, nothing piles up)
    ({"prompt": "hi", "n": 32, "logprobs": 20, "max_tokens": 4000}, "logprobs"),
])
def test_unbounded_work_is_a_400_naming_the_field(srv, body, param):
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert srv.wait_idle()["cache"]["used_blocks"] == 0


def test_a_huge_top_k_on_the_torch_sampler_fails_no_other_request():
    s = start_server({"backend": {"kv_cache_memory": "16MiB"}, "model": {"model": "embedded", "max_model_len": 256}})
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            other = pool.submit(httpx.post, s.url + "/v1/completions",
                                json={"prompt": "Once", "max_tokens": 30, "temperature": 1}, timeout=60)
            bad = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "top_k": 2**63, "temperature": 1})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
            assert other.result().status_code == 200 and other.result().json()["choices"][0]["finish_reason"]
    finally:
        s.stop()


def test_admission_counts_the_request_own_sequences():
    cfg = FAKE | {"backend": {"name": "fake", "options": {"step_cost_s": 0.05}},
                  "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 64},
                  "server": {"max_waiting_requests": 4}}
    s = start_server(cfg)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, s.url + "/v1/completions",
                                  json={"prompt": "x", "max_tokens": 40, "n": 3, "ignore_eos": True}, timeout=60)
            deadline = time.monotonic() + 5
            while s.stats()["waiting"] < 2 and time.monotonic() < deadline:  # one runs, two wait
                time.sleep(0.02)
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3}, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            r = httpx.post(s.url + "/v1/completions", json={"prompt": ["x"] * 5, "max_tokens": 1}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 5 sequences can never be admitted
            assert running.result().status_code == 200
    finally:
        s.stop()


def test_concurrent_requests_of_many_sequences_stay_within_the_queue():
    # each request is 4 prompts × n = 16 = 64 sequences; the queue holds 128, and one sequence runs at a time: two
    # are admitted. Queued requests used to count one sequence each (and held n > 1 groups none), so most got in
    # A request takes ≥ 64 × 3 steps × 20 ms ≈ 4 s, and all eight are sent at once (clients made before the barrier,
    # since making one can take a second on a loaded CI machine): none can arrive after the first has finished
    cfg = FAKE | {"backend": {"name": "fake", "options": {"step_cost_s": 0.02}},
                  "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 64},
                  "server": {"max_waiting_requests": 128, "max_sequences_per_request": 64}}
    s = start_server(cfg)
    body = {"prompt": ["a longer prompt of more than one block"] * 4, "n": 16, "max_tokens": 2, "ignore_eos": True}
    ready = threading.Barrier(8)

    def post(_):
        with httpx.Client(timeout=120) as client:
            ready.wait()
            return client.post(s.url + "/v1/completions", json=body).status_code

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(post, range(8)))
        assert sorted(codes) == [200] * 2 + [429] * 6, codes
    finally:
        s.stop()


def test_a_big_body_is_parsed_off_the_event_loop_and_rejected_by_length_first(srv, monkeypatch):
    from llmserve.server import routes

    threads, checked = [], []
    parse = routes.parse
    monkeypatch.setattr(routes, "parse", lambda *a: threads.append(threading.current_thread().name) or parse(*a))
    monkeypatch.setattr("llmserve.limits.min", lambda ids: checked.append(len(ids)) or min(ids), raising=False)
    huge = {"prompt": list(range(1, 400_001)), "max_tokens": 1}  # ~3 MB of ids, far past the context
    r = httpx.post(srv.url + "/v1/completions", json=huge, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    small = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
    assert small.status_code == 200
    loop_thread = threads[1]  # the small body is parsed on the event loop's thread
    assert threads[0] != loop_thread
    assert checked and set(checked) == {3}  # the huge prompt's ids were never scanned: its length rejected it


def test_a_big_whole_answer_is_built_off_the_event_loop(srv, monkeypatch):
    from llmserve.server import answer

    threads = []
    dumps = answer.dumps
    monkeypatch.setattr(answer, "dumps", lambda d: threads.append(threading.current_thread().name) or dumps(d))
    body = {"prompt": "hi", "n": 16, "logprobs": 5, "max_tokens": 300, "ignore_eos": True}  # 16 × 300 × 6 entries
    for b in (body, {"prompt": "hi", "max_tokens": 3}):
        assert httpx.post(srv.url + "/v1/completions", json=b, timeout=60).status_code == 200
    big, small = threads
    assert big != small  # the small one on the event loop's thread


def test_stats_and_metrics_pollers_share_a_snapshot(srv, monkeypatch):
    calls = []
    stats = srv.engine.stats
    monkeypatch.setattr(srv.engine, "stats", lambda: calls.append(1) or stats())
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: httpx.get(srv.url + "/stats", timeout=10).status_code, range(80)))
    elapsed = time.monotonic() - t0
    assert codes == [200] * 80
    assert len(calls) <= elapsed / 0.1 + 2  # at most one engine call per 100 ms, however many poll
    body = httpx.get(srv.url + "/metrics", timeout=10).text
    assert body == httpx.get(srv.url + "/metrics", timeout=10).text  # within 100 ms: the same rendering
