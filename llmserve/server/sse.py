"""Server-sent events: a response that writes each finished frame as it comes, pings, and stops when the client leaves.

A streamed answer sends an event per token or few, and what each event costs the event loop is taken from the engine
thread beside it (the GIL, and the same cores). Each frame therefore goes straight to the connection where the
transport offers it (`BODY_WRITER`, llmserve/server/transport.py: one chunked write, no ASGI message, no middleware
wrapper, no h11 event); through ASGI's `send` otherwise (another server, backpressure, a connection going away).
The response's start and its end still go through `send`, so the middleware sees the status and the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone

from starlette.responses import Response

from llmserve.server.generation import wait_disconnect

# scope["extensions"][BODY_WRITER]: write(data) → True once data is written as the next chunk of the response's body;
# False where it cannot be (the caller sends it through ASGI then)
BODY_WRITER = "llmserve.body_writer"

PING_SECONDS = 15.0  # a comment line this often keeps proxies from closing a quiet stream


def ping_frame() -> bytes:
    """The keep-alive comment sse-starlette sends (`: ping - <UTC time>`), which SSE clients skip."""
    return f": ping - {datetime.now(timezone.utc)}\n\n".encode()


def _unavailable(data: bytes) -> bool:
    """The body writer where the server offers none: every frame goes through `send`."""
    return False


class EventStream(Response):
    """text/event-stream of the frames (finished SSE bytes) an async iterator yields; its `aclose` runs once the
    stream ends, fails, or the client disconnects (what frees the request's engine work)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], ping: float | None = None):
        self.frames = frames
        self.ping = PING_SECONDS if ping is None else ping  # (read per response: a test shortens PING_SECONDS)
        self.status_code = 200
        self.background = None
        # no-cache: each request is its own answer; X-Accel-Buffering: nginx passes events on as they come
        self.init_headers({"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        write: Callable[[bytes], bool] = scope.get("extensions", {}).get(BODY_WRITER) or _unavailable

        async def body(data: bytes) -> None:
            if not write(data):
                await send({"type": "http.response.body", "body": data, "more_body": True})

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        main = asyncio.current_task()
        gone = streaming = False

        def on_disconnect(t: asyncio.Task) -> None:
            # the client left (or reading from it failed): cancel the loop below wherever it waits (the frames'
            # generator sees it and aborts)
            nonlocal gone
            if t.cancelled():
                return
            t.exception()  # (retrieved, so that a failed read is not reported as never retrieved)
            if streaming:
                gone = True
                main.cancel()

        watch = asyncio.ensure_future(wait_disconnect(receive))
        watch.add_done_callback(on_disconnect)
        pinger = asyncio.ensure_future(self._pings(body)) if self.ping > 0 else None
        streaming = True
        try:
            async for frame in self.frames:
                if not write(frame):  # (body(), inlined: this runs once an event)
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
        except asyncio.CancelledError:
            if not gone:  # the server cancelled it (a shutdown past its grace period)
                raise
            if hasattr(main, "uncancel"):  # (3.11+) the cancellation was this response's own, and is handled
                main.uncancel()
        finally:
            streaming = False
            watch.cancel()
            if pinger is not None:
                pinger.cancel()
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:  # a generator left at a yield (the send failed, the client left) runs its cleanup
                await aclose()
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pings(self, body: Callable[[bytes], object]) -> None:
        while True:
            await asyncio.sleep(self.ping)
            await body(ping_frame())
