"""A minimal HTTP/1.1 client for streamed responses: one keep-alive connection, body bytes as they arrive.

`bench serve` runs its clients on the machine whose server it measures. Through httpx (httpcore, anyio and h11 for
every chunk) one SSE event cost the client ~0.4 ms of CPU on the 2-core EPYC, which at one stream (~3.5 ms a token)
the server's cores paid for: a token-by-token stream then read ~15 % slower than one sent in bursts, where this
client reads both alike (docs/server.md, "bench serve"). What it speaks: a request with a Content-Length body; a
response framed by chunked encoding, a Content-Length, or the connection's close; keep-alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The server's answer was not HTTP/1.x as this client reads it, or the connection ended inside it."""


class RawConnection:
    """One client's keep-alive connection to `base_url` (http only), opened on first use and again when it closed."""

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"the raw client speaks plain http, not {u.scheme!r} (use --client httpx)")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, AsyncIterator[bytes]]:
        """Send a POST; its status and its body's bytes as they arrive (read the body to its end before reusing)."""
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + body
        reused = self._writer is not None
        try:
            status, fields = await self._send(head)
        except (ConnectionError, asyncio.IncompleteReadError, HTTPError):
            # a kept-alive connection the server closed as the request went out: nothing was answered, so send it
            # once more on a new one (a new connection's failure is the caller's)
            self.close()
            if not reused:
                raise
            status, fields = await self._send(head)
        return status, self._body(fields)

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def _send(self, head: bytes) -> tuple[int, dict[str, str]]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(head)
        await self._writer.drain()
        line = await self._reader.readline()
        if not line:
            raise HTTPError("the server closed the connection without answering")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP/1.x status line: {line[:80]!r}")
        fields: dict[str, str] = {"": parts[0].decode()}  # the version, for the keep-alive rule
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n"):
            if not line:
                raise HTTPError("the connection ended inside the response head")
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        return int(parts[1]), fields

    async def _body(self, fields: dict[str, str]) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        keep = fields[""] == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
        if "chunked" in fields.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailer fields
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        elif "content-length" in fields:
            left = int(fields["content-length"])
            while left > 0:
                data = await reader.read(min(left, 65536))
                if not data:
                    raise HTTPError("the connection ended inside the response body")
                left -= len(data)
                yield data
        else:  # delimited by the connection's close
            keep = False
            while data := await reader.read(65536):
                yield data
        if not keep:
            self.close()
