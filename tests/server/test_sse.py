"""Streamed answers as the wire carries them: HTTP/1.1 chunks a raw client can frame, HTTP/1.0 without chunks,
pings in a quiet stream, a connection that serves on after a stream, and a client that leaves freeing its request."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmserve.server import answer
from tests.server.conftest import start_server
from tests.server.raw_http import connect
from tests.server.test_abort import SLOW  # 5 ms a step: 40 tokens last ~0.2 s, time for pings every 0.03 s


@pytest.fixture(scope="module")
def srv():
    s = start_server(SLOW)
    yield s
    s.stop()


def _post(path: str, body: dict, version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _read_until(sock, buf: bytes, end: bytes) -> bytes:
    """buf plus what arrives until it holds `end` (the socket times out after 5 s)."""
    while end not in buf:
        more = sock.recv(65536)
        assert more, f"the server closed the connection before {end!r}: {buf[-300:]!r}"
        buf += more
    return buf


def _read_chunked(sock, buf: bytes = b"") -> tuple[dict[str, str], list[bytes], bytes]:
    """One chunked HTTP/1.1 response, framed strictly: its headers, its chunks, and the bytes after it."""
    buf = _read_until(sock, buf, b"\r\n\r\n")
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK", lines[0]
    headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:])}
    chunks = []
    while True:
        buf = _read_until(sock, buf, b"\r\n")
        size_line, _, buf = buf.partition(b"\r\n")
        size = int(size_line, 16)  # a malformed size line fails here
        if size == 0:
            buf = _read_until(sock, buf, b"\r\n")
            assert buf.startswith(b"\r\n"), buf[:50]  # no trailers
            return headers, chunks, buf[2:]
        while len(buf) < size + 2:
            more = sock.recv(65536)
            assert more, "the connection closed inside a chunk"
            buf += more
        assert buf[size:size + 2] == b"\r\n", buf[size:size + 10]
        chunks.append(buf[:size])
        buf = buf[size + 2:]


def _data(frames: bytes) -> list[str]:
    """The `data:` payloads of SSE frames, in order (comments skipped)."""
    assert frames.endswith(b"\n\n"), frames[-50:]
    return [ev.removeprefix("data: ") for ev in frames.decode().split("\n\n")[:-1] if not ev.startswith(":")]


def _whole(srv, body: dict) -> str:
    """The text of the same request answered whole."""
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _text(payloads: list[str]) -> str:
    assert payloads[-1] == "[DONE]"
    return "".join(c["text"] for p in payloads[:-1] for c in json.loads(p)["choices"])


def test_each_event_is_one_http_chunk_and_the_connection_serves_on(srv):
    body = {"model": "embedded", "prompt": "count with me", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = _whole(srv, body)
    with connect(srv) as s:
        s.sendall(_post("/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}}))
        headers, chunks, rest = _read_chunked(s)
        assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
        # every chunk is whole events (the client parses each as it arrives), and they make up the answer
        assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
        payloads = _data(b"".join(chunks))
        assert _text(payloads) == whole
        usage = json.loads(payloads[-2])["usage"]
        assert usage["completion_tokens"] == 24 and rest == b""
        # the same connection takes the next request: the response ended as h11 ends one
        s.sendall(_post("/v1/chat/completions", {"model": "embedded", "max_tokens": 5, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]}))
        _, chunks, _ = _read_chunked(s)
        payloads = _data(b"".join(chunks))
        first = json.loads(payloads[0])
        assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
        assert payloads[-1] == "[DONE]"


def test_an_http_1_0_client_gets_the_events_unchunked_then_the_close(srv):
    body = {"model": "embedded", "prompt": "old client", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = _whole(srv, body)
    with connect(srv) as s:
        s.sendall(_post("/v1/completions", body | {"stream": True}, version="1.0"))
        raw = b""
        while more := s.recv(65536):
            raw += more
    head, _, frames = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding" not in head.lower()
    assert _text(_data(frames)) == whole


def test_a_stream_gets_pings_and_the_sdk_reads_past_them(srv, monkeypatch):
    monkeypatch.setattr(answer, "PING_SECONDS", 0.03)
    body = {"model": "embedded", "prompt": "ping me", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with connect(srv) as s:
        s.sendall(_post("/v1/completions", body | {"stream": True}))
        _, chunks, _ = _read_chunked(s)
    frames = b"".join(chunks)
    pings = [ev for ev in frames.decode().split("\n\n") if ev.startswith(": ping - ")]
    assert len(pings) >= 2, frames[:500]
    assert len(_text(_data(frames))) > 0
    # the OpenAI SDK skips the comment lines
    ignore_eos = body.pop("ignore_eos")
    stream = srv.client().completions.create(**body, stream=True, extra_body={"ignore_eos": ignore_eos})
    got = [c for c in stream if c.choices]
    assert sum(len(c.choices[0].text) for c in got) > 0 and got[-1].choices[0].finish_reason == "length"


def test_a_client_that_leaves_mid_stream_frees_its_request_at_once(srv):
    before = srv.stats()["metrics"]["requests_finished"]
    with connect(srv) as s:
        # 900 tokens at 5 ms a step: 4.5 s if nothing stopped it
        s.sendall(_post("/v1/chat/completions", {"model": "embedded", "max_tokens": 900, "stream": True,
                                                 "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "go on"}]}))
        _read_until(s, b"", b'"content"')
        left = time.monotonic()
    while (stats := srv.wait_idle(3.0))["metrics"]["requests_finished"].get("abort", 0) == before.get("abort", 0):
        assert time.monotonic() - left < 3.0, "the request was not aborted"  # (the count follows the abort closely)
        time.sleep(0.05)
    assert stats["server"]["active_requests"] == 0 and stats["cache"]["used_blocks"] == 0
    after = stats["metrics"]["requests_finished"]
    assert after.get("abort", 0) == before.get("abort", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)  # it did not run to its 900 tokens
