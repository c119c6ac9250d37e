"""Auth, backpressure (429), request timeout (504) and CORS on a slow fake model."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server

KEY = "sekret-key"
SLOW = {
    "backend": {"name": "fake", "options": {"step_cost_s": 0.02}},  # 20 ms per step
    "model": {"model": "embedded", "max_model_len": 512},
    "cache": {"num_blocks": 128, "block_size": 16},
    "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64},
    "server": {"api_key": KEY, "max_waiting_requests": 2, "request_timeout": 2.0,
               "cors_origins": ["https://app.example"]},
}


@pytest.fixture(scope="module")
def srv():
    s = start_server(SLOW)
    yield s
    s.stop()


def test_missing_or_wrong_key_is_401(srv):
    with pytest.raises(openai.AuthenticationError) as e:
        srv.client(api_key="wrong").completions.create(model="embedded", prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401
    ok = srv.client(api_key=KEY).completions.create(model="embedded", prompt="x", max_tokens=1)
    assert ok.usage.completion_tokens == 1


def test_health_and_metrics_are_open(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and "llmserve_num_requests_running" in r.text


def test_cors_preflight_and_headers(srv):
    r = httpx.options(srv.url + "/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(srv.url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_full_waiting_queue_is_429_with_retry_after(srv):
    client = srv.client(api_key=KEY)

    def one(_):
        try:
            # 10 tokens at 20 ms a step: the queue stays full for about 0.2 s, and the two that
            # wait finish by about 0.4 s, well inside the 2 s timeout even on a loaded CI machine
            client.completions.create(model="embedded", prompt="q", max_tokens=10, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as e:
            assert e.response.headers["retry-after"] == "1"
            assert e.body["code"] == "queue_full"
            return "429"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    # 2 run, 2 may wait; the rest were refused at once
    assert results.count("429") >= 4 and results.count("ok") >= 2
    assert srv.wait_idle()["cache"]["used_blocks"] == 0


def test_request_timeout_is_504_and_frees_blocks(srv):
    client = srv.client(api_key=KEY)
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="embedded", prompt="long", max_tokens=400, extra_body={"ignore_eos": True})
    assert e.value.status_code == 504 and "request_timeout" in e.value.body["message"]
    assert time.monotonic() - t0 < 5  # 400 steps would take 8 s
    s = srv.wait_idle()
    assert s["running"] == 0 and s["cache"]["used_blocks"] == 0


def test_streaming_request_timeout_ends_with_an_error_event(srv):
    client = srv.client(api_key=KEY)
    n = 0
    with pytest.raises(openai.APIError, match="request_timeout"):
        for _ in client.completions.create(model="embedded", prompt="long", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True}):
            n += 1
    assert n > 0
    assert srv.wait_idle()["cache"]["used_blocks"] == 0

