"""The HTTP/1.1 transport: uvicorn's h11 protocol with the limits a public server needs.

uvicorn's default httptools protocol buffers a header of any size and never times out a half-sent
request; h11 bounds the buffered head (`max_header_bytes`), and this subclass adds timeouts (a new
connection's first byte, a request's head, the whole request), a cap on open connections at which the
longest idle connection gives up its place before anyone busy is refused, and refusals in OpenAI's
error shape that the client gets to read. The keep-alive timeout between requests is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import functools
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmserve.config import ServerConfig
from llmserve.server.connections import Connections
from llmserve.server.errors import ApiError
from llmserve.server.middleware import head_too_large

# A refused connection is closed only once its client has read the answer (it closes, having read it)
# or after this long: closing a socket with unread request bytes in it sends a reset, and the client
# then reports a transport error instead of the 503. What arrives meanwhile is dropped, up to a bound.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 * 1024


def _raw_response(err: ApiError) -> bytes:
    """An HTTP/1.1 response with the error's JSON body and headers that closes the connection (no h11 state)."""
    body = json.dumps(err.body()).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests",
              431: "Request Header Fields Too Large", 503: "Service Unavailable"}.get(err.status, "Error")
    extra = "".join(f"{k}: {v}\r\n" for k, v in err.headers.items())
    head = (f"HTTP/1.1 {err.status} {reason}\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def _past_limit(limit: str, table: Connections, why: str = "") -> ApiError:
    """The refusal of a connection past max_connections (503) or max_connections_per_client (429)."""
    if limit == "max_connections":
        return ApiError(503, f"too many open connections (limit max_connections={table.limit}){why}; retry later",
                        code="too_many_connections", headers={"Retry-After": "1"})
    return ApiError(429, f"too many open connections from your address (limit max_connections_per_client="
                         f"{table.per_client}); retry later", code="too_many_connections_per_client",
                    headers={"Retry-After": "1"})


class LimitedH11Protocol(H11Protocol):
    """H11Protocol plus timeouts, a connection cap with idle eviction, and JSON refusals that are read, not reset."""

    def __init__(self, *args, limits: ServerConfig, table: Connections, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.table = table
        self._timer: asyncio.TimerHandle | None = None
        self._first_byte: float | None = None  # loop time the request being read began to arrive
        self._served = False  # a response has been sent (idle now means kept alive, uvicorn's timer)
        self._dropped: int | None = None  # refused: bytes read and dropped since; None while serving
        self._opened = self.loop.time()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        past = self.table.admit(self, self.client[0] if self.client else "")
        if past is not None:
            self._refuse(_past_limit(past, self.table))
        else:  # idle until its first byte, which must come within keep_alive_timeout
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.table.forget(self)
        if self._dropped is not None:
            self.table.lingered()
            self._dropped = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropped is not None:  # refused: read only so the socket holds nothing unread at close
            self._dropped += len(data)
            if self._dropped > _LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        self._served = True
        super().on_response_complete()  # arms uvicorn's keep-alive timer; handles a pipelined request
        self._watch()

    def shutdown(self) -> None:
        if self._dropped is None:  # (a refused one is closing already, and h11 may be in its ERROR state)
            super().shutdown()

    def evict(self) -> None:
        """Answer 503 and close, to make room: a request crossing the answer reads it, not a reset."""
        self._unset_keepalive_if_required()
        self._refuse(_past_limit("max_connections", self.table, ": this idle connection made room for another"))

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this when h11 refuses a request: a head past max_header_bytes, or a malformed one
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
            self._refuse(head_too_large(self.limits.max_header_bytes))
        else:
            self._refuse(ApiError(400, f"malformed HTTP request: {msg}", code="bad_http_request"))

    def _watch(self) -> None:
        """Set the timer for what the connection is doing now: reading a head, reading a body, or neither."""
        if self._dropped is not None:  # refused: the linger timer runs
            return
        if self.transport.is_closing():
            self._cancel_timer()
            return
        state = self.conn.their_state
        if state is h11.IDLE and not self.conn.trailing_data[0]:  # no request in progress
            self._first_byte = None
            self.table.idle(self)
            if self._served:  # kept alive: uvicorn's keep-alive timer runs
                self._cancel_timer()
            elif self._timer is None or self._timer.when() != self._opened + self.limits.keep_alive_timeout:
                self._cancel_timer()  # (bytes that made no request do not buy a new connection more time)
                self._timer = self.loop.call_at(self._opened + self.limits.keep_alive_timeout, self._timed_out)
            return
        self.table.busy(self)
        if self._first_byte is None:  # its first byte is in (or a pipelined request, buffered already)
            self._first_byte = self.loop.time()
        if state is h11.IDLE:
            limit = min(self.limits.header_timeout, self.limits.request_read_timeout)
        elif state is h11.SEND_BODY:
            limit = self.limits.request_read_timeout
        else:  # received in full: what the handler takes is request_timeout's business
            self._cancel_timer()
            return
        deadline = self._first_byte + limit
        if self._timer is None or self._timer.when() != deadline:
            self._cancel_timer()
            self._timer = self.loop.call_at(deadline, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.table.timed_out_one()
        state, limits = self.conn.their_state, self.limits
        if self._first_byte is None:  # never sent a byte (a kept-alive one is uvicorn's timer's)
            self._refuse(ApiError(408, f"no request arrived within keep_alive_timeout "
                                       f"({limits.keep_alive_timeout:g} s) of connecting", code="request_timeout"))
        elif state is h11.IDLE:  # the head is not all in
            key = "header_timeout" if limits.header_timeout <= limits.request_read_timeout else "request_read_timeout"
            self._refuse(ApiError(408, f"the request head was not received within {key} "
                                       f"({getattr(limits, key):g} s)", code="request_timeout"))
        else:
            self.transport.close()  # the handler is reading the body: it sees a disconnect and gives up

    def _refuse(self, err: ApiError) -> None:
        """Answer err and close, once the client has read it (or _LINGER_SECONDS have passed)."""
        self._cancel_timer()
        self.table.forget(self)  # a refused connection no longer takes a place under the cap
        if self.transport.is_closing():
            return
        self.transport.write(_raw_response(err))
        if not self.table.linger():  # no descriptor to spare: close now (a client yet to send sees a reset)
            self.transport.close()
            return
        self._dropped = 0
        self.transport.write_eof()  # the answer, then FIN; reading goes on until the client closes
        self.transport.resume_reading()
        self._timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def uvicorn_config(app, sc: ServerConfig, **overrides) -> uvicorn.Config:
    """The uvicorn settings every server uses (the CLI's and the tests'): h11 with our limits.

    Raises the process's open-file limit, sizes the connection cap from it (unless set) and hands the
    app's state the connection table that /stats and /metrics read."""
    table = Connections.for_server(sc.max_connections, sc.max_connections_per_client)
    app.state.llm.connections = table
    settings = dict(host=sc.host, port=sc.port, log_level=sc.log_level, lifespan="on", access_log=sc.access_log,
                    http=functools.partial(LimitedH11Protocol, limits=sc, table=table),
                    h11_max_incomplete_event_size=sc.max_header_bytes,
                    timeout_keep_alive=sc.keep_alive_timeout,
                    # a backstop only: the drain (llmserve/server/run.py) answers everything by drain_timeout
                    timeout_graceful_shutdown=sc.drain_timeout + 0.5)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)
