"""AsyncEngine: the EngineClient of an Engine stepped on a thread of this process, serving asyncio callers.

It composes three things: an EngineLoop (engine_loop.py) that builds the engine on its own thread and steps it
there, so the event loop never waits on a forward pass; the Streams (engine_client.py) of the requests in flight,
on the event loop; and a LoopOutbox, the loop's outbox, which hands each step's outputs (and a request's failure)
to those streams in one ``call_soon_threadsafe``. Add, abort and call go on the loop's command list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmserve.engine_client import RequestStream, Streams
from llmserve.engine_loop import EngineLoop
from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.request import PoolingParams, RequestOutput, SamplingParams
from llmserve.serving_model import ServingModel

__all__ = ["AsyncEngine", "EngineDeadError", "LoopOutbox"]


class LoopOutbox:
    """An EngineLoop's outbox in the server's own process: outputs and failures go to the Streams on the event loop."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self.loop: asyncio.AbstractEventLoop | None = None  # bound by AsyncEngine.start (serve binds it late)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """The outputs to their streams, in one hop to the event loop."""
        self.loop.call_soon_threadsafe(self.streams.deliver, outputs)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """One request's stream ends with exc."""
        self.loop.call_soon_threadsafe(self.streams.fail, request_id, exc)

    def fail_all(self, exc: BaseException) -> None:
        """Every stream ends with exc (no loop bound: no stream was ever opened)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.streams.fail_all, exc)

    def idle(self) -> None:
        """Nothing to ship before a wait: the metric sinks run in this process."""


class AsyncEngine:
    """The EngineClient of an Engine in this process: built on a dedicated thread, stepped there; each request gets an
    async stream of outputs."""

    def __init__(self, engine: Any, idle_timeout: float = 1.0, check_threads: bool = True):
        """engine: a zero-argument factory (built on the engine thread: what the server does) or a built Engine
        (EngineLoop says what that costs); check_threads: EngineLoop's."""
        self.streams = Streams()
        self.outbox = LoopOutbox(self.streams)
        self.core = EngineLoop(engine, self.outbox, idle_timeout, check_threads)
        self.built: concurrent.futures.Future = self.core.built  # the Engine, or why it failed
        self.serving: concurrent.futures.Future = concurrent.futures.Future()  # its ServingModel, or why it failed
        self.built.add_done_callback(self._describe)

    def _describe(self, built: concurrent.futures.Future) -> None:
        # on the engine thread, before it steps: the routes start once `serving` resolves
        if built.exception() is not None:
            self.serving.set_exception(built.exception())
        else:
            self.serving.set_result(ServingModel.of(built.result()))

    @property
    def engine(self) -> Any:
        """The Engine (None until built)."""
        return self.core.engine

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the streams live on (None until bound by start)."""
        return self.outbox.loop

    @property
    def dead(self) -> BaseException | None:
        """Why the engine thread stopped, if it crashed or the engine failed to build."""
        return self.core.dead

    @property
    def num_steps(self) -> int:
        """Steps the engine has run."""
        return self.core.num_steps

    # --- life cycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread (it builds the engine first); outputs go to `loop` (default: the running one).

        Called again, it only binds the loop: `serve` starts the thread before uvicorn's loop exists.
        """
        if loop is not None:
            self.outbox.loop = loop
        elif self.outbox.loop is None:
            with contextlib.suppress(RuntimeError):  # no running loop: bound by a later start(loop)
                self.outbox.loop = asyncio.get_running_loop()
        self.core.start_thread()

    def wait_built(self, timeout: float | None = None) -> Any:
        """Block until the engine is built and return it; raise what its factory raised."""
        return self.built.result(timeout)

    @property
    def running(self) -> bool:
        """The engine is built and its thread is stepping."""
        return self.core.running

    @property
    def pid(self) -> int | None:
        """The id of the process the engine steps in (this one)."""
        return os.getpid()

    @property
    def num_active(self) -> int:
        """Requests whose stream has not ended."""
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the engine plus requests not yet handed to it (for backpressure)."""
        return self.core.num_waiting

    @property
    def metric_sinks(self) -> list[MetricSink]:
        """The engine's own sinks (it runs in this process)."""
        return self.engine.metric_sinks

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink to the engine: it gets every later event."""
        self.engine.add_metric_sink(sink)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if the timeout passed first."""
        return await self.streams.wait_idle(timeout)

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to timeout seconds, then fail the rest (their callers answer 503)."""
        for rid in await self.streams.drain(timeout):
            self.core.abort(rid)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Drain for up to drain_timeout, stop the thread."""
        await self.drain(drain_timeout)
        self.core.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.core.join, 10.0)
        self.fail_all(EngineDeadError("the server is shutting down"))  # requests that arrived meanwhile

    def stop_nowait(self) -> None:
        """Tell the engine thread to stop after its current step (it aborts what is left); wait for nothing."""
        self.core.stop()

    # --- requests (call these on the event loop) ----------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None) -> RequestStream:
        """Queue a request for the engine thread and return its stream at once (with `pooling`: an embedding, whose
        one finished output carries the vector; Engine.add_request)."""
        if self.outbox.loop is None or not self.running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        stream = self.streams.open(request_id, params.n, self.outbox.loop)
        self.core.add(stream.request_id, prompt_token_ids, params, priority, cache_salt, time.perf_counter(), pooling)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends now; the engine frees its blocks before its next step."""
        if self.streams.close(request_id):
            self.core.abort(request_id)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (e.g. stats) and return its result.

        Write fn so that it pickles (a module-level function, operator.methodcaller): with
        server.engine_core=process it is sent to the engine's own process (engine_process.py).
        """
        if not self.running:
            return fn(self.engine)  # nothing else touches the engine now
        return await asyncio.wrap_future(self.core.call(fn))

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with exc (its caller answers it); the engine frees their blocks."""
        for rid in self.streams.fail_all(exc):
            self.core.abort(rid)
