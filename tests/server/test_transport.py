"""Transport limits on raw sockets: header size, read timeout, idle keep-alive, connection cap, pipelining."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from tests.server.conftest import FAKE, start_server
from tests.server.raw_http import HALF_HEAD, assert_error_shape, connect, read_all, refused, request, responses

LIMITS = {"max_header_bytes": 4096, "request_read_timeout": 0.6, "keep_alive_timeout": 0.6, "max_connections": 6}


@pytest.fixture(scope="module")
def server():
    s = start_server({**FAKE, "server": LIMITS})
    yield s
    s.stop()


def test_a_complete_header_over_the_limit_is_a_431_in_our_shape(server):
    with connect(server) as s:
        s.sendall(request(b'{"prompt": "hi", "max_tokens": 1}', "x-big: " + "a" * 8000 + "\r\n"))
        [(status, body)] = responses(read_all(s))
    assert status == 431
    assert_error_shape(body, "headers_too_large")


def test_an_unfinished_header_is_cut_off_at_the_limit_not_buffered(server):
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-big: ")
        sent = 0
        with pytest.raises(OSError):  # the server closes the connection long before 32 MiB arrive
            for _ in range(32 * 1024):
                s.sendall(b"a" * 1024)
                sent += 1024
        assert sent < 4 * 1024 * 1024


def test_a_half_sent_request_gets_a_408_after_the_read_timeout(server):
    with connect(server) as s:
        t0 = time.monotonic()
        s.sendall(HALF_HEAD)  # and never the rest
        [(status, body)] = responses(read_all(s))
        waited = time.monotonic() - t0
    assert status == 408 and 0.5 < waited < 3
    assert_error_shape(body, "request_timeout")


def test_a_slowly_dribbled_head_is_timed_from_its_first_byte(server):
    with connect(server) as s:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for c in b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n" * 10:
                s.sendall(bytes([c]))
                time.sleep(0.05)
        assert time.monotonic() - t0 < 3  # one byte per 50 ms never keeps the connection alive


def test_a_body_that_stops_arriving_closes_the_connection(server):
    with connect(server) as s:
        s.sendall(request(b'{"prompt": "hi", "max_tokens": 1}')[:-10])
        t0 = time.monotonic()
        read_all(s)
        assert 0.5 < time.monotonic() - t0 < 3
    assert server.wait_idle()["server"]["active_requests"] == 0


def test_a_client_that_leaves_mid_body_is_no_error_of_ours(server, caplog):
    # it closes its side after 10 of the 100 bytes it announced: nobody to answer, no 500 and no traceback logged
    with connect(server) as s:
        s.sendall(request(b'{"prompt": "hi", "max_tokens": 1}' + b" " * 66)[:-90])
        s.shutdown(socket.SHUT_WR)
        assert read_all(s) == b""
    assert server.wait_idle()["server"]["active_requests"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_an_idle_connection_is_closed_new_or_kept_alive(server):
    with connect(server) as s:  # never sends anything
        t0 = time.monotonic()
        [(status, _)] = responses(read_all(s))
        assert status == 408 and time.monotonic() - t0 < 3
    with connect(server) as s:  # one request, then idle on keep-alive
        s.sendall(request(b'{"prompt": "hi", "max_tokens": 1}'))
        t0 = time.monotonic()
        [(status, body)] = responses(read_all(s))
        assert status == 200 and body["object"] == "text_completion" and time.monotonic() - t0 < 3


def test_connections_past_the_cap_get_a_503_in_our_shape(server):
    held = [connect(server) for _ in range(LIMITS["max_connections"])]
    try:
        for s in held:  # half a head each: busy, so none of them is closed to make room
            s.sendall(HALF_HEAD)
        time.sleep(0.1)
        refused(server, 503, "too_many_connections")
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)  # once they are closed, connections are welcome again
    with connect(server) as s:
        s.sendall(request(b'{"prompt": "hi", "max_tokens": 1}', close=True))
        [(status, _)] = responses(read_all(s))
    assert status == 200


def test_a_bad_body_does_not_take_a_pipelined_request_down_with_it(server):
    bad = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    good = b'{"prompt": "hi", "max_tokens": 2}'
    with connect(server) as s:
        s.sendall(request(bad) + request(b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}")
                  + request(good, close=True))
        got = responses(read_all(s))
    assert [status for status, _ in got] == [400, 400, 200]
    assert got[0][1]["error"]["type"] == "invalid_request_error"
    assert got[2][1]["choices"][0]["text"]
