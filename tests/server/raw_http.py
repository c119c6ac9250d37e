"""HTTP/1.1 on raw sockets, as an attacker or a careless client speaks it: connect, send bytes, read to the close."""

from __future__ import annotations

import json
import socket
import time

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n"  # a request head that never ends


def connect(server) -> socket.socket:
    """A TCP connection to a LiveServer (reads time out after 5 s)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (fails the test if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def responses(raw: bytes) -> list[tuple[int, dict]]:
    """The (status, JSON body) of each HTTP/1.1 response in raw (Content-Length framed)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = int(next(v for k, _, v in (ln.partition(": ") for ln in lines[1:]) if k.lower() == "content-length"))
        out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
        raw = rest[length:]
    return out


def request(body: bytes, extra_headers: str = "", close: bool = False) -> bytes:
    """A POST /v1/completions with this JSON body, as bytes."""
    conn = "connection: close\r\n" if close else ""
    return (f"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n{conn}{extra_headers}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def assert_error_shape(body: dict, code: str) -> None:
    """body is OpenAI's error object, with this code."""
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code


def refused(server, status: int, code: str, send: bytes = b"", pause: float = 0.0) -> dict:
    """Connect, send (after pause), read to the close: one response, this status, Retry-After: 1, this code."""
    with connect(server) as s:
        time.sleep(pause)
        if send:
            s.sendall(send)
        raw = read_all(s)  # a reset would raise ConnectionResetError here
    [(got, body)] = responses(raw)
    assert got == status and b"\r\nretry-after: 1\r\n" in raw.lower(), raw[:300]
    assert_error_shape(body, code)
    return body
