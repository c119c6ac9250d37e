"""EngineClient: what the server needs of an engine, wherever it runs (a thread, a child process, a fleet, a test).

The routes hold an EngineClient and a ServingModel (llmserve/serving_model.py) and nothing else of the engine:
they add requests (generation or pooling) and read each one's RequestStream, abort them, call a function on the
engine between steps (stats), and read its state for admission, /health and /stats. vLLM v1's EngineClient is the
model: the server process holds a client; the engine core it talks to may live anywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.request import FinishReason, PoolingParams, RequestOutput, SamplingParams
from llmserve.serving_model import ServingModel

_ids = itertools.count()  # with the clock, a request id unique in this process when the caller names none


class RequestStream:
    """The async stream of RequestOutput deltas of one request (all n of its sequences)."""

    __slots__ = ("request_id", "n", "_loop", "_items", "_waiter", "_finished", "done", "error")

    def __init__(self, request_id: str, n: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.n = n
        self._loop = loop
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None
        self._finished: set[int] = set()
        self.done = False  # every sequence ended (or the request failed): no more items will come
        self.error: BaseException | None = None  # set when the request could not be run at all

    # called on the event loop by the engine client that made the stream
    def put(self, out: RequestOutput) -> None:
        """Queue one delta; the stream ends once each of its n sequences has finished (or the request failed)."""
        self._items.append(out)
        if out.finished:
            if out.finish_reason is FinishReason.ERROR:
                self._finished.update(range(self.n))  # a failed request ends as a whole
            else:
                self._finished.add(out.index)
            if len(self._finished) >= self.n:
                self.done = True
        self.wake()

    def fail(self, exc: BaseException) -> None:
        """End the stream with exc, which its reader raises once the queued deltas are out."""
        self.error = exc
        self.done = True
        self.wake()

    def close(self) -> None:
        """End the stream now (its request was aborted): a reader waiting on it returns."""
        if not self.done:
            self.done = True
            self.wake()

    def wake(self) -> None:
        """Wake the reader waiting on the stream."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        """Until an item is queued or the stream has ended; raises the stream's error once the items are out."""
        while not self._items and not self.done:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if not self._items and self.error is not None:
            raise self.error

    async def next_batch(self) -> list[RequestOutput]:
        """Every delta queued so far (at least one); [] when the stream has ended. Raises its error."""
        await self._wait()
        items = list(self._items)
        self._items.clear()
        return items

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self._wait()
        if not self._items:
            raise StopAsyncIteration
        return self._items.popleft()


class Streams:
    """The open RequestStreams of one engine client, by request id: what every client's outputs are dispatched to.

    Used on the event loop only. The client opens a stream when it adds a request; its outputs and errors (from
    whatever outbox the client has: the engine thread, a pipe, a fleet's replicas) end it; an abort closes it.
    """

    def __init__(self):
        self._open: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(self, request_id: str | None, n: int, loop: asyncio.AbstractEventLoop) -> RequestStream:
        """A new stream for a request of n sequences (an id made up when None)."""
        rid = request_id or f"req-{next(_ids)}-{time.monotonic_ns():x}"
        stream = self._open[rid] = RequestStream(rid, n, loop)
        return stream

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Dispatch outputs to their streams; a stream that ends leaves the table."""
        streams = self._open
        for o in outputs:
            s = streams.get(o.request_id)
            if s is None:
                continue  # aborted: drop what was already computed
            s.put(o)
            if s.done:
                del streams[o.request_id]

    def fail(self, request_id: str, exc: BaseException) -> None:
        """End one stream with exc (its caller answers it)."""
        s = self._open.pop(request_id, None)
        if s is not None:
            s.fail(exc)

    def fail_all(self, exc: BaseException) -> list[str]:
        """End every open stream with exc; return their ids (for the engine to abort)."""
        ids = list(self._open)
        for rid in ids:
            self.fail(rid, exc)
        return ids

    def close(self, request_id: str) -> bool:
        """End a stream now (its request was aborted); False if it was not open."""
        s = self._open.pop(request_id, None)
        if s is None:
            return False
        s.close()
        return True

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no stream is open; False if the timeout passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def drain(self, timeout: float) -> list[str]:
        """Let open streams end for up to timeout seconds, then fail the rest; return their ids (to abort)."""
        if await self.wait_idle(timeout):
            return []
        return self.fail_all(EngineDeadError(f"the server is shutting down; the request did not finish within "
                                             f"the drain timeout ({timeout:g} s)"))


class EngineClient(Protocol):
    """What the server calls of an engine: requests in, their streams out, state, life cycle.

    Call every method on the server's event loop. `serving` resolves to the ServingModel once the engine is
    built (or raises why it could not be), which is when the server starts admitting requests.
    """

    serving: concurrent.futures.Future  # → ServingModel
    dead: BaseException | None  # why the engine stopped, if it failed
    num_steps: int

    @property
    def running(self) -> bool:
        """The engine is built and serving: False makes /health and admission answer 503."""

    @property
    def pid(self) -> int | None:
        """The id of the process the engine steps in (None: several, or not known)."""

    @property
    def num_active(self) -> int:
        """Requests whose stream has not ended."""

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for the engine (the admission check's backpressure)."""

    @property
    def metric_sinks(self) -> list[MetricSink]:
        """The sinks this process's copy of the engine's metric events reach (what /metrics renders)."""

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink (a route plugin serving it): it gets every later metric event."""

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine (or bind the event loop outputs go to, if it is started already)."""

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let requests in flight finish for up to drain_timeout, fail the rest, stop the engine."""

    async def drain(self, timeout: float) -> None:
        """Let requests in flight finish for up to timeout seconds, then fail the rest."""

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None) -> RequestStream:
        """Queue a request (with `pooling`: an embedding) and return its stream at once."""

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends now and the engine frees what it holds."""

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) run by the engine between steps (stats); fn must pickle for an engine in another process."""

