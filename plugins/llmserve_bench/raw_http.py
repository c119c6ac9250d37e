"""A minimal HTTP/1.1 client for streamed responses: one keep-alive connection, body bytes handed on as they arrive.

`bench serve` runs its clients on the machine whose server it measures. Through httpx (httpcore, anyio and h11 for
every chunk) one SSE event cost the client ~0.4 ms of CPU on the 2-core EPYC, which at one stream (~3.5 ms a token)
the server's cores paid for, and a token-by-token stream read ~15 % slower than one sent in bursts. Here a response
is parsed in the protocol's data_received, and its body's bytes go to the caller's callback there: no coroutine
switch per event (asyncio's StreamReader, three awaits a chunk, still cost ~8 %). It speaks a request with a
Content-Length body; a response framed by chunked encoding, a Content-Length, or the connection's close; keep-alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# body bytes and the time they arrived (time.perf_counter()); False: the caller needs no more (the rest is read and
# dropped, so the connection stays usable)
OnData = Callable[[bytes, float], bool]


class HTTPError(Exception):
    """The server's answer was not HTTP/1.x as this client reads it, or the connection ended inside it."""


class _Response(asyncio.Protocol):
    """One connection's reader: the response in progress, parsed as its bytes arrive."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._begin(None, None)

    def _begin(self, done: asyncio.Future | None, on_data: OnData | None) -> None:
        self.done, self.on_data = done, on_data
        self.buf = b""
        self.status = 0
        self.state = "head"  # head, then chunked (size / data / crlf / trailer), length or close
        self.left = 0  # bytes left in this chunk (chunked) or body (length)
        self.keep = True
        self.wanted = True  # the caller still reads the body
        self.error_body = b""  # a status other than 200: its body, for the message

    def expect(self, on_data: OnData) -> asyncio.Future:
        """The next response: its body to on_data; the future resolves to (status, keep-alive, error body)."""
        fut = asyncio.get_running_loop().create_future()
        self._begin(fut, on_data)
        return fut

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.state == "close" and self.done is not None and not self.done.done():
            self.done.set_result((self.status, False, self.error_body))  # a body delimited by the close
        self._fail(HTTPError("the server closed the connection without answering" if self.state == "head"
                             else "the connection ended inside the response"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.done is None or self.done.done():
            return  # nothing asked for (a server's stray bytes): dropped
        self.buf += data
        try:
            self._parse(now)
        except (HTTPError, ValueError) as e:
            self._fail(HTTPError(str(e)))
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    def _emit(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.error_body += data
        elif self.wanted and data:
            self.wanted = self.on_data(data, now)

    def _finish(self) -> None:
        self.done.set_result((self.status, self.keep, self.error_body))

    def _parse(self, now: float) -> None:
        while not self.done.done():
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self.buf = self.buf[:end].decode("latin-1").split("\r\n"), self.buf[end + 4:]
                parts = head[0].split(None, 2)
                if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                    raise HTTPError(f"not an HTTP/1.x status line: {head[0][:80]!r}")
                fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
                self.status = int(parts[1])
                self.keep = parts[0] == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
                if "chunked" in fields.get("transfer-encoding", "").lower():
                    self.state = "size"
                elif "content-length" in fields:
                    self.state, self.left = "length", int(fields["content-length"])
                else:
                    self.state, self.keep = "close", False
            elif self.state == "size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                self.left = int(self.buf[:end].split(b";", 1)[0], 16)
                self.buf = self.buf[end + 2:]
                self.state = "data" if self.left else "trailer"
            elif self.state in ("data", "length"):
                piece, self.buf = self.buf[:self.left], self.buf[self.left:]
                self.left -= len(piece)
                self._emit(piece, now)
                if self.left:
                    return
                if self.state == "length":
                    self._finish()
                else:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return
                self.buf, self.state = self.buf[2:], "size"
            elif self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line, self.buf = self.buf[:end], self.buf[end + 2:]
                if not line:
                    self._finish()
            else:  # "close": everything until the connection ends
                piece, self.buf = self.buf, b""
                self._emit(piece, now)
                return


class RawConnection:
    """One client's keep-alive connection to `base_url` (http only), opened on first use and again when it closed."""

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"the raw client speaks plain http, not {u.scheme!r} (use --client httpx)")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self._conn: _Response | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str], on_data: OnData) -> tuple[int, bytes]:
        """Send a POST and read its answer to the end: a 200's body goes to on_data as it arrives; the status, and
        another status's body."""
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body
        reused = self._conn is not None and not self._conn.closed
        try:
            status, keep, error_body = await self._send(head, on_data)
        except HTTPError as e:
            # a kept-alive connection the server closed as the request went out: nothing was answered, so send it
            # once more on a new one (a new connection's failure is the caller's)
            self.close()
            if not reused or "without answering" not in str(e):
                raise
            status, keep, error_body = await self._send(head, on_data)
        if not keep:
            self.close()
        return status, error_body

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None

    async def _send(self, head: bytes, on_data: OnData) -> tuple[int, bool, bytes]:
        if self._conn is None or self._conn.closed:
            _, self._conn = await asyncio.get_running_loop().create_connection(_Response, self.host, self.port)
        done = self._conn.expect(on_data)
        self._conn.transport.write(head)
        return await done
