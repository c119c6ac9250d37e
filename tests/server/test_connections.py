"""Connections under load and attack: idle ones make room, half-sent heads are cut, refusals are read, never reset."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.server.connections import Connections
from tests.server.conftest import FAKE, start_server
from tests.server.raw_http import HALF_HEAD, assert_error_shape, connect, read_all, refused, request, responses

CAP = 20
LIMITS = {"max_connections": CAP, "header_timeout": 1.0, "keep_alive_timeout": 4.0, "request_read_timeout": 5.0}
STREAM = {"prompt": "hi", "max_tokens": 8, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    s = start_server({**FAKE, "server": LIMITS})
    yield s
    s.stop()


def conns(server) -> dict:
    return server.stats()["server"]["connections"]


def wait_closed(server, timeout: float = 5.0) -> dict:
    """Poll /stats until only the poller's own connection is open; the last counts."""
    deadline = time.monotonic() + timeout
    while (c := conns(server))["open"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return c


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes sock (FIN, after any answer) within this many seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def stream_once(url: str) -> tuple[int, float, str]:
    """A streaming completion on a fresh connection: status, seconds to [DONE], the last data line."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=10) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    return r.status_code, time.perf_counter() - t0, lines[-1] if lines else ""


# --- the table -----------------------------------------------------------------------------------


class FakeConn:
    def __init__(self):
        self.evicted = False

    def evict(self):
        self.evicted = True


def test_the_table_evicts_the_longest_idle_and_refuses_when_none_is_idle():
    t = Connections(limit=2)
    a, b, c, d = FakeConn(), FakeConn(), FakeConn(), FakeConn()
    assert t.admit(a, "x") is None and t.admit(b, "x") is None
    t.busy(a)
    assert t.admit(c, "x") is None and b.evicted and not a.evicted  # the idle one goes, not the busy one
    t.busy(c)
    assert t.admit(d, "x") == "max_connections"  # nothing idle: refused
    t.idle(c)
    t.idle(a)
    assert t.admit(d, "x") is None and c.evicted and not a.evicted  # c has been idle longer than a
    t.forget(d)
    t.forget(d)  # idempotent
    assert t.stats() == {"open": 1, "idle": 1, "limit": 2, "per_client_limit": 0, "evicted": 2, "timed_out": 0,
                         "refused": {"max_connections": 1, "max_connections_per_client": 0}, "lingering": 0}


def test_the_table_limits_each_address_when_asked():
    t = Connections(limit=10, per_client=2)
    x = [FakeConn() for _ in range(3)]
    assert [t.admit(c, "10.0.0.1") for c in x] == [None, None, "max_connections_per_client"]
    assert t.admit(FakeConn(), "10.0.0.2") is None  # another address has its own two
    t.forget(x[0])
    assert t.admit(x[2], "10.0.0.1") is None
    assert t.stats()["refused"]["max_connections_per_client"] == 1


def test_the_open_file_limit_is_raised_and_sizes_the_cap():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2048:
        pytest.skip(f"needs a finite hard limit of at least 2048 open files, not {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        t = Connections.for_server(None, 0)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        assert t.limit == min(16384, hard - max(256, hard // 8))
        assert Connections.for_server(7, 0).limit == 7  # a configured cap stands
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024), hard))


# --- a live server on raw sockets -----------------------------------------------------------------


def test_idle_connections_make_room_and_half_sent_heads_are_cut_at_the_header_timeout(server):
    wait_closed(server)
    idle = [connect(server) for _ in range(CAP)]  # the whole cap, sending nothing
    time.sleep(0.2)
    half = [connect(server) for _ in range(CAP // 2)]  # each makes an idle one give up its place
    sent = []
    for s in half:
        s.sendall(HALF_HEAD)
        sent.append(time.monotonic())
    try:
        status, _, last = stream_once(server.url)  # gets in too, in place of another idle one
        assert status == 200 and last == "data: [DONE]"
        for s, t0 in zip(half, sent):
            [(code, body)] = responses(read_all(s))
            assert code == 408 and 0.8 < time.monotonic() - t0 < 2.5
            assert_error_shape(body, "request_timeout")
            assert "header_timeout" in body["error"]["message"]
        made_room = [responses(read_all(s)) for s in idle[:CAP // 2 + 1]]  # the longest idle, told why
        assert all(code == 503 and "made room" in body["error"]["message"] for [(code, body)] in made_room)
        assert not any(closed_by_server(s, 0.05) for s in idle[CAP // 2 + 1:])  # the rest still held
    finally:
        for s in idle + half:
            s.close()
    c = wait_closed(server)
    assert c["evicted"] >= CAP // 2 + 1 and c["timed_out"] >= CAP // 2
    assert c["refused"]["max_connections"] == 0  # nobody was turned away: there was always an idle one


def test_a_full_cap_answers_503_that_a_client_sending_at_once_reads_not_a_reset(server):
    wait_closed(server)
    busy = [connect(server) for _ in range(CAP)]
    for s in busy:
        s.sendall(HALF_HEAD)
    try:
        time.sleep(0.1)
        big = request(json.dumps({"prompt": "x" * 20000, "max_tokens": 1}).encode())
        for pause in (0, 0, 0, 0.05, 0.05):  # the request is in before the 503 is written, or lands after it
            body = refused(server, 503, "too_many_connections", send=big, pause=pause)
            assert body["error"]["type"] == "service_unavailable"
    finally:
        for s in busy:
            s.close()
    assert wait_closed(server)["refused"]["max_connections"] >= 5


def test_a_burst_past_the_cap_gets_answers_not_transport_errors(server):
    wait_closed(server)
    n = 3 * CAP

    async def burst():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=20) as client:
            async def one():
                try:
                    r = await client.post(server.url + "/v1/completions", json=STREAM)
                    return r.status_code, r.headers.get("retry-after"), r.json() if r.status_code != 200 else r.text
                except httpx.TransportError as e:
                    return "transport error", type(e).__name__, str(e)

            return await asyncio.gather(*[one() for _ in range(n)])

    got = asyncio.run(burst())
    errors = [g for g in got if g[0] == "transport error"]
    assert not errors, errors
    ok = [g for g in got if g[0] == 200]
    refused = [g for g in got if g[0] != 200]
    assert ok and refused  # both paths ran
    assert all(text.rstrip().endswith("data: [DONE]") for _, _, text in ok)
    for status, retry_after, body in refused:
        assert status in (429, 503) and retry_after == "1"
        assert_error_shape(body, "too_many_connections" if status == 503 else "queue_full")
    s = server.wait_idle()
    assert s["cache"]["used_blocks"] == 0 and s["running"] == 0 and s["server"]["active_requests"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    series = {(x.name, x.labels.get("limit")): x.value
              for fam in text_string_to_metric_families(metrics) for x in fam.samples}
    told = series[("llmserve_http_connections_refused_total", "max_connections")]  # newcomers turned away
    told += series[("llmserve_http_connections_evicted_total", None)]  # and idle ones that made room for them
    assert told >= len(refused)
    assert series[("llmserve_http_connections_limit", None)] == CAP
    assert series[("llmserve_http_connections_open", None)] >= 1  # the scrape's own


@pytest.fixture(scope="module")
def per_client_server():
    s = start_server({**FAKE, "server": {"max_connections_per_client": 3, "keep_alive_timeout": 4.0}})
    yield s
    s.stop()


def test_one_address_cannot_take_more_than_its_share_when_asked(per_client_server):
    held = [connect(per_client_server) for _ in range(3)]  # 127.0.0.1's three
    try:
        time.sleep(0.1)
        body = refused(per_client_server, 429, "too_many_connections_per_client")
        assert body["error"]["type"] == "rate_limit_error"
    finally:
        held.pop().close()
    time.sleep(0.2)  # one closed: room for one more from the same address
    try:
        status, _, last = stream_once(per_client_server.url)
        assert status == 200 and last == "data: [DONE]"
    finally:
        for s in held:
            s.close()
