"""Clients that go away — streaming or not — abort their requests and free every KV block."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server

# 5 ms per step, no request timeout: only a disconnect can end these requests early
SLOW = {
    "backend": {"name": "fake", "options": {"step_cost_s": 0.005}},
    "model": {"model": "embedded", "max_model_len": 1024},
    "cache": {"num_blocks": 1024, "block_size": 16},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "server": {"request_timeout": None},
}


@pytest.fixture(scope="module")
def srv():
    s = start_server(SLOW)
    yield s
    s.stop()


def _aborted(stats: dict) -> int:
    return stats["metrics"]["requests_finished"].get("abort", 0)


def test_twenty_streaming_clients_dropped_mid_stream_free_every_block(srv):
    before = _aborted(srv.stats())

    async def one(i: int, client: httpx.AsyncClient) -> int:
        body = {"prompt": f"client {i} says hello " * 3, "max_tokens": 800, "stream": True, "ignore_eos": True}
        got = 0
        async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break  # leave mid-stream: closing the response drops the connection
        return got

    async def main():
        # one connection per client, so leaving closes a socket the server sees
        clients = [httpx.AsyncClient(timeout=30) for _ in range(20)]
        try:
            return await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.aclose()

    got = asyncio.run(main())
    assert got == [3] * 20
    s = srv.wait_idle(5.0)
    assert s["running"] == 0 and s["waiting"] == 0 and s["server"]["active_requests"] == 0
    cache = s["cache"]
    assert cache["used_blocks"] == 0 and cache["num_sequences"] == 0
    assert cache["free_blocks"] + cache["cached_free_blocks"] == cache["num_blocks"]
    assert _aborted(s) == before + 20
    # 20 × 800 tokens at 5 ms a step would take seconds more: they were not run to the end
    assert s["metrics"]["requests_finished"].get("length", 0) == 0
    r = srv.client().completions.create(model="embedded", prompt="still here?", max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_client_timeout_aborts_a_non_streaming_request(srv):
    before = _aborted(srv.stats())
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        # 1 s: time to reach the engine on a loaded machine, a quarter of the whole generation
        srv.client(timeout=1.0).completions.create(model="embedded", prompt="bye", max_tokens=800,
                                                   extra_body={"ignore_eos": True})
    s = srv.wait_idle(5.0)
    assert time.monotonic() - t0 < 3.5  # the whole generation would take about 4 s
    assert s["running"] == 0 and s["cache"]["used_blocks"] == 0
    assert _aborted(s) == before + 1


def test_disconnect_while_waiting_in_the_queue_aborts(srv):
    """Requests that never got a slot are dropped from the waiting queue too."""
    first = srv.stats()
    before, finished = _aborted(first), first["metrics"]["requests_finished"].get("length", 0)

    async def main():
        clients = [httpx.AsyncClient(timeout=30) for _ in range(40)]  # 40 > max_num_seqs 32
        body = {"prompt": "wait", "max_tokens": 800, "ignore_eos": True}
        posts = [asyncio.ensure_future(c.post(srv.url + "/v1/completions", json=body)) for c in clients]
        try:
            # leave once 32 run and 8 wait (a fixed client timeout raced their arrival on a loaded machine)
            deadline = time.monotonic() + 20
            while True:
                s = await asyncio.to_thread(srv.stats)
                if (s["running"], s["waiting"]) == (32, 8) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            for p in posts:
                p.cancel()  # cancelling a request mid-response closes its connection
            ended = await asyncio.gather(*posts, return_exceptions=True)
            assert all(isinstance(e, asyncio.CancelledError) for e in ended)  # none was answered
            return s
        finally:
            for c in clients:
                await c.aclose()

    held = asyncio.run(main())
    assert (held["running"], held["waiting"]) == (32, 8)
    s = srv.wait_idle(5.0)
    assert s["waiting"] == 0 and s["running"] == 0 and s["cache"]["used_blocks"] == 0
    assert _aborted(s) == before + 40
    assert s["metrics"]["requests_finished"].get("length", 0) == finished  # none ran to its end


def test_the_drain_answers_what_is_left_in_our_shape_and_frees_every_block(srv):
    """What SIGTERM runs (AsyncEngine.drain): past the timeout, running and queued work ends with a 503."""
    async def load(client: httpx.AsyncClient):
        body = {"prompt": "drain", "max_tokens": 900, "ignore_eos": True}
        streamed = client.post(srv.url + "/v1/completions", json=body | {"stream": True})
        return await asyncio.gather(*[client.post(srv.url + "/v1/completions", json=body) for _ in range(4)],
                                    streamed)

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            work = asyncio.ensure_future(load(client))
            await asyncio.sleep(0.5)
            assert srv.stats()["cache"]["used_blocks"] > 0
            drained = asyncio.run_coroutine_threadsafe(srv.state.client.drain(0.2), srv.state.client.loop)
            await asyncio.wrap_future(drained)
            return await work

    *whole, streamed = asyncio.run(main())
    for r in whole:
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert '"code":"engine_unavailable"' in streamed.text
    assert srv.wait_idle()["cache"]["used_blocks"] == 0
