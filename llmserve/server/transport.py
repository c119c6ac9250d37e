"""The HTTP/1.1 transport: uvicorn's h11 protocol with the limits a public server needs.

uvicorn's default httptools protocol buffers a header of any size and never times out a half-sent
request; h11 bounds the buffered head (`max_header_bytes`), and this subclass adds a read timeout
from a connection's first byte (or its previous response) until its request is fully received,
a cap on open connections, and refusals in OpenAI's error shape. The keep-alive timeout is
uvicorn's own.
"""

from __future__ import annotations

import asyncio
import functools
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmserve.config import ServerConfig
from llmserve.server.errors import ApiError
from llmserve.server.middleware import head_too_large


def _raw_response(err: ApiError) -> bytes:
    """An HTTP/1.1 response with the error's JSON body that closes the connection (no h11 state needed)."""
    body = json.dumps(err.body()).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
              503: "Service Unavailable"}.get(err.status, "Error")
    head = (f"HTTP/1.1 {err.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    """H11Protocol plus a request read timeout, a connection cap and JSON refusals."""

    def __init__(self, *args, limits: ServerConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(ApiError(503, f"too many open connections (limit max_connections="
                                       f"{self.limits.max_connections}); retry later", code="too_many_connections"))
        else:
            self._arm_read_timer()  # an idle new connection is timed out like a half-sent request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # reading a request (its head, or its body): the clock runs; received in full: it stops
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self._arm_read_timer()
        else:
            self._cancel_read_timer()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this when h11 refuses a request: a head past max_header_bytes, or a malformed one
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
            self._refuse(head_too_large(self.limits.max_header_bytes))
        else:
            self._refuse(ApiError(400, f"malformed HTTP request: {msg}", code="bad_http_request"))

    def _refuse(self, err: ApiError) -> None:
        self._cancel_read_timer()
        if not self.transport.is_closing():
            self.transport.write(_raw_response(err))
            self.transport.close()

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.limits.request_read_timeout, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state is h11.IDLE:  # no complete head yet (or nothing at all)
            self._refuse(ApiError(408, f"the request was not received within request_read_timeout "
                                       f"({self.limits.request_read_timeout:g} s)", code="request_timeout"))
        elif self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # the handler is reading the body: it sees a disconnect and gives up


def uvicorn_config(app, sc: ServerConfig, **overrides) -> uvicorn.Config:
    """The uvicorn settings every server uses (the CLI's and the tests'): h11 with our limits."""
    settings = dict(host=sc.host, port=sc.port, log_level=sc.log_level, lifespan="on", access_log=sc.access_log,
                    http=functools.partial(LimitedH11Protocol, limits=sc),
                    h11_max_incomplete_event_size=sc.max_header_bytes,
                    timeout_keep_alive=sc.keep_alive_timeout,
                    # a backstop only: the drain (llmserve/server/run.py) answers everything by drain_timeout
                    timeout_graceful_shutdown=sc.drain_timeout + 0.5)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)
