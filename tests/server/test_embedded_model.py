"""The server on the embedded torch model (the `make serve` default): seeds, greedy equivalence, lazy start."""

from __future__ import annotations

import time

import httpx
import pytest

from llmserve.engine import Engine
from llmserve.request import SamplingParams
from tests.server.conftest import start_server

EMBEDDED = {"backend": {"kv_cache_memory": "16MiB"}, "model": {"model": "embedded", "max_model_len": 256}}


@pytest.fixture(scope="module")
def srv():
    # built by the app in the background, as `create_app(config)` does without an engine
    s = start_server(EMBEDDED, build_engine=False)
    deadline = time.monotonic() + 60
    while httpx.get(s.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(s.url + "/health").text
        time.sleep(0.1)
    yield s
    s.stop()


def test_seed_makes_sampling_reproducible(srv):
    client = srv.client()
    kw = dict(model="embedded", prompt="Once upon a time", max_tokens=24, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=42, **kw).choices[0].text
    b = client.completions.create(seed=42, **kw).choices[0].text
    c = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    assert a != c
    # n > 1 with a seed: the choices differ from each other, and repeat as a set
    r1 = client.completions.create(seed=3, n=3, **kw)
    r2 = client.completions.create(seed=3, n=3, **kw)
    assert [x.text for x in r1.choices] == [x.text for x in r2.choices]
    assert len({x.text for x in r1.choices}) > 1


def test_the_random_model_writes_printable_text(srv):
    """Its noise is printable characters (tokenizer "printable"), so a demo sends no control bytes to a terminal."""
    client = srv.client()
    texts = [c.text for seed in range(4) for c in client.completions.create(
        model="embedded", prompt="Once upon a time", max_tokens=64, temperature=1.0, seed=seed, n=2,
        extra_body={"ignore_eos": True}).choices]
    chat = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=64, temperature=1.0, seed=1).choices[0].message.content
    text = "".join(texts) + chat
    assert len(text) >= 8 * 64
    assert all(c.isprintable() or c in "\t\n" for c in text), [c for c in text if not c.isprintable()][:5]


def test_greedy_answer_equals_the_offline_engine(srv):
    prompt = "The quick brown fox"
    r = srv.client().completions.create(model="embedded", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
    eng = Engine.from_config(EMBEDDED)
    try:
        (ids,) = eng.generate([eng.tokenizer.encode(prompt)], SamplingParams(max_tokens=16, temperature=0,
                                                                             ignore_eos=True))
        assert r.choices[0].text == eng.tokenizer.decode(ids)
    finally:
        eng.shutdown()


def test_chat_stream_on_the_embedded_model(srv):
    client = srv.client()
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="embedded", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="embedded", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_failed_engine_build_is_503_with_the_reason():
    s = start_server({"model": {"model": "/nonexistent/checkpoint"}, "tokenizer": {"name": "byte"}},
                     build_engine=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            h = httpx.get(s.url + "/health")
            if h.json()["status"] != "loading":
                break
            assert h.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.05)
        assert h.status_code == 503 and h.json()["status"] == "error"
        assert "/nonexistent/checkpoint" in h.json()["error"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "/nonexistent/checkpoint" in r.json()["error"]["message"]
    finally:
        s.stop()
