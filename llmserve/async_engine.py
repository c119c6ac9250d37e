"""AsyncEngine: builds the (not thread-safe) Engine on one thread, steps it there, serves asyncio callers.

The engine thread builds the engine from a factory, then runs the step loop, so torch is loaded,
warmed up and stepped on one thread (llmserve/threads.py says why that matters on a CPU) and
the event loop never waits on a forward pass. Callers on the event loop never touch the Engine:
add, abort and arbitrary calls are put on a command list that the engine thread drains at the
start of every iteration, so an abort takes effect before the next step (and frees the
request's blocks then). Each step's outputs go back to the event loop in one
``call_soon_threadsafe`` and are dispatched to per-request streams. An idle engine thread sleeps
on a condition variable, not in a busy spin.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from llmserve.engine_client import RequestStream
from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.request import FinishReason, PoolingParams, RequestOutput, SamplingParams
from llmserve.serving_model import ServingModel
from llmserve.threads import ENGINE_THREAD_NAME, name_os_thread, warn_if_foreign_pool

log = logging.getLogger("llmserve.async_engine")

_ids = itertools.count()


class AsyncEngine:
    """The EngineClient of an Engine in this process: built on a dedicated thread, stepped there; each request gets an
    async stream of outputs."""

    def __init__(self, engine: Any, idle_timeout: float = 1.0):
        """engine: a zero-argument factory (built on the engine thread: what the server does) or a built Engine.

        A built Engine is stepped on another thread than the one that built it, which costs a torch
        backend ~40% on a CPU once that thread has run torch; fine for the fake backend in tests.
        """
        self._build: Callable[[], Any] = engine if callable(engine) else (lambda: engine)
        self.engine: Any = None if callable(engine) else engine
        self.built: concurrent.futures.Future = concurrent.futures.Future()  # the Engine, or why it failed
        self.serving: concurrent.futures.Future = concurrent.futures.Future()  # its ServingModel, or why it failed
        self.idle_timeout = idle_timeout  # an idle thread wakes this often anyway (a safety net)
        self._cv = threading.Condition()
        self._cmds: list[tuple[str, Any]] = []
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead: BaseException | None = None  # why the thread stopped, if it crashed
        self.num_steps = 0
        # engine-thread only: request id → sequences not yet finished, to abort them after a crash
        self._live: dict[str, int] = {}

    # --- life cycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread (it builds the engine first); outputs go to `loop` (default: the running one).

        Called again, it only binds the loop: `serve` starts the thread before uvicorn's loop exists.
        """
        if loop is not None:
            self._loop = loop
        elif self._loop is None:
            with contextlib.suppress(RuntimeError):  # no running loop: bound by a later start(loop)
                self._loop = asyncio.get_running_loop()
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    def wait_built(self, timeout: float | None = None) -> Any:
        """Block until the engine is built and return it; raise what its factory raised."""
        return self.built.result(timeout)

    @property
    def running(self) -> bool:
        """The engine is built and its thread is stepping."""
        return (self.engine is not None and self._thread is not None and self._thread.is_alive()
                and not self._stop)

    @property
    def pid(self) -> int | None:
        """The id of the process the engine steps in (this one)."""
        return os.getpid()

    @property
    def num_active(self) -> int:
        """Requests whose stream has not ended."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the engine plus requests not yet handed to it (for backpressure)."""
        return self.engine.num_waiting + sum(1 for c in self._cmds if c[0] == "add")

    @property
    def metric_sinks(self) -> list[MetricSink]:
        """The engine's own sinks (it runs in this process)."""
        return self.engine.metric_sinks

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink to the engine: it gets every later event."""
        self.engine.add_metric_sink(sink)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if the timeout passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._streams:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to timeout seconds, then fail the rest (their callers answer 503)."""
        if not await self.wait_idle(timeout):
            self.fail_all(EngineDeadError(f"the server is shutting down; the request did not finish within "
                                          f"the drain timeout ({timeout:g} s)"))

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Drain for up to drain_timeout, stop the thread."""
        await self.drain(drain_timeout)
        self.stop_nowait()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self.fail_all(EngineDeadError("the server is shutting down"))  # requests that arrived meanwhile

    def stop_nowait(self) -> None:
        """Tell the engine thread to stop after its current step (it aborts what is left); wait for nothing."""
        with self._cv:
            self._stop = True
            self._cv.notify()

    # --- requests (call these on the event loop) ----------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None) -> RequestStream:
        """Queue a request for the engine thread and return its stream at once (with `pooling`: an embedding, whose
        one finished output carries the vector; Engine.add_request)."""
        if self._loop is None or not self.running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        rid = request_id or f"req-{next(_ids)}-{time.monotonic_ns():x}"
        stream = RequestStream(rid, params.n, self._loop)
        self._streams[rid] = stream
        self._submit(("add", (rid, list(prompt_token_ids), params, priority, cache_salt, time.perf_counter(),
                              pooling)))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends now; the engine frees its blocks before its next step."""
        s = self._streams.pop(request_id, None)
        if s is None:
            return
        s.close()
        self._submit(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (e.g. stats) and return its result.

        Write fn so that it pickles (a module-level function, operator.methodcaller): with
        server.engine_core=process it is sent to the engine's own process (engine_process.py).
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.running:
            fut.set_result(fn(self.engine))  # nothing else touches the engine now
        else:
            self._submit(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    def _submit(self, cmd: tuple[str, Any]) -> None:
        with self._cv:
            self._cmds.append(cmd)
            self._cv.notify()

    # --- delivery (runs on the event loop) ----------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for o in outputs:
            s = streams.get(o.request_id)
            if s is None:
                continue  # aborted: drop what was already computed
            s.put(o)
            if s.done:
                del streams[o.request_id]

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        s = self._streams.pop(request_id, None)
        if s is not None:
            s.fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with exc (its caller answers it); the engine frees their blocks."""
        for rid in list(self._streams):
            self._deliver_error(rid, exc)
            self._submit(("abort", rid))

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread(ENGINE_THREAD_NAME)  # the OpenMP workers this thread starts carry its name
        try:
            warn_if_foreign_pool()
            eng = self.engine = self._build()
        except BaseException as e:  # reported to whoever waits on `built` (the CLI, /health)
            self.dead = e
            self._stop = True
            self.built.set_exception(e)
            self.serving.set_exception(e)
            return
        self.built.set_result(eng)
        self.serving.set_result(ServingModel.of(eng))
        if hasattr(eng, "early"):  # an Engine: a step's forwards reach their streams as each ends (Engine.early)
            eng.early = self._emit
        try:
            while True:
                self._flush()
                with self._cv:
                    while not self._cmds and not self._stop and not eng.has_unfinished:
                        self._cv.wait(self.idle_timeout)
                    cmds, self._cmds = self._cmds, []
                    stop = self._stop
                for kind, arg in cmds:
                    self._apply(kind, arg)
                if stop:
                    break
                if not eng.has_unfinished:
                    continue
                try:
                    out = eng.step()
                except Exception as e:
                    # the engine itself failed (the backend's failures are handled inside step()
                    # and fail only that batch); fail every request in flight, keep serving
                    log.exception("engine step failed; failing the requests in flight")
                    self._recover(e)
                    continue
                self.num_steps += 1
                if out.outputs:
                    self._emit(out.outputs)
        except BaseException as e:  # pragma: no cover - a bug in this loop
            log.exception("the engine thread crashed")
            self.dead = e
            self._post(self.fail_all, EngineDeadError(f"the engine thread crashed: {e}"))
        finally:
            self._stop = True
            try:
                eng.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine shutdown failed")

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, the finished ones' requests leaving `_live`: from the engine
        thread, or mid-step from the backend's relay while the engine thread waits in the backend's call."""
        live = self._live
        for o in outputs:
            if o.finished and o.request_id in live:
                live[o.request_id] -= 1
                if live[o.request_id] <= 0 or o.finish_reason is FinishReason.ERROR:
                    del live[o.request_id]
        self._post(self._deliver, outputs)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the event loop: how the engine thread hands outputs and errors to the streams."""
        self._loop.call_soon_threadsafe(fn, *args)

    def _flush(self) -> None:
        """Before each wait for work: nothing here (an engine in another process ships its metric events)."""

    def _apply(self, kind: str, arg: Any) -> None:
        eng = self.engine
        if kind == "add":
            rid, prompt, params, priority, salt, arrival, pooling = arg
            try:
                eng.add_request(prompt, params, request_id=rid, priority=priority, arrival_time=arrival,
                                cache_salt=salt, pooling=pooling)
            except Exception as e:  # InvalidRequestError and friends go back to that caller only
                self._post(self._deliver_error, rid, e)
                return
            self._live[rid] = params.n
        elif kind == "abort":
            eng.abort(arg)
            self._live.pop(arg, None)
        elif kind == "call":
            fn, fut = arg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(eng))
                except Exception as e:
                    fut.set_exception(e)

    def _recover(self, exc: Exception) -> None:
        ids, self._live = list(self._live), {}
        for rid in ids:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort
                log.exception("abort of %s failed during recovery", rid)
        err = RuntimeError(f"engine error: {type(exc).__name__}: {exc}")
        for rid in ids:
            self._post(self._deliver_error, rid, err)
