"""EngineLoop: builds the (not thread-safe) Engine on one thread and steps it there; what it makes goes to an Outbox.

Every engine client runs this one loop, wherever the loop's outputs go: `AsyncEngine` runs it on a thread of the
server's process with the event loop as its outbox, the engine process (engine_process.py) runs it on its main
thread with the pipe to the server as its outbox. The loop builds the engine from a factory, then steps it, so torch
is loaded, warmed up and stepped on one thread (llmserve/threads.py says why that matters on a CPU). Callers on
other threads never touch the Engine: `add`, `abort` and `call` put a command on a list that the loop drains at the
start of every iteration, so an abort takes effect before the next step (and frees the request's blocks then). An
idle loop sleeps on a condition variable, not in a busy spin. When a step fails, the requests in flight fail and the
loop serves on (`live` knows which requests were in flight).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llmserve.errors import BackendLostError, EngineDeadError
from llmserve.request import FinishReason, PoolingParams, RequestOutput, SamplingParams
from llmserve.threads import ENGINE_THREAD_NAME, name_os_thread, warn_if_foreign_pool

log = logging.getLogger("llmserve.engine_loop")


class Outbox(Protocol):
    """Where an EngineLoop hands what it makes; called on the loop's thread (or the backend's relay, mid-step)."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (or one forward's, mid-step), for the requests' streams."""

    def fail(self, request_id: str, exc: BaseException) -> None:
        """One request could not run (the engine refused it, or its step failed): its stream ends with exc."""

    def fail_all(self, exc: BaseException) -> None:
        """The loop itself died: every request in flight ends with exc."""

    def idle(self) -> None:
        """The loop is about to wait for work (the pipe ships the metric events made outside a step's outputs)."""


class EngineLoop:
    """The step loop of one Engine and its command list; `run` on the thread that is to own the engine."""

    def __init__(self, build: Callable[[], Any] | Any, outbox: Outbox, idle_timeout: float = 1.0,
                 check_threads: bool = True):
        """build: a zero-argument factory (called by `run`, on the loop's thread) or a built Engine.

        A built Engine is stepped on another thread than the one that built it, which costs a torch
        backend ~40% on a CPU once that thread has run torch; fine for the fake backend in tests.
        check_threads: warn at start-up when another thread already holds an OpenMP pool (threads.py); off where
        the process's own native threads defeat the count (a Ray worker's).
        """
        self.check_threads = check_threads
        self._build: Callable[[], Any] = build if callable(build) else (lambda: build)
        self.engine: Any = None if callable(build) else build
        self.outbox = outbox
        self.built: concurrent.futures.Future = concurrent.futures.Future()  # the Engine, or why it failed
        self.idle_timeout = idle_timeout  # an idle loop wakes this often anyway (a safety net)
        self.dead: BaseException | None = None  # why the loop stopped, if it crashed or the build failed
        self.num_steps = 0
        self.seqs_added = 0  # sequences added so far (an engine process reports it: its client's backpressure)
        self._cv = threading.Condition()
        self._cmds: list[tuple[str, Any]] = []
        self._stop = False
        self._started = False  # run() was called, or its thread started
        self._thread: threading.Thread | None = None
        # loop-thread only: request id → sequences not yet finished, to abort them after a failed step
        self._live: dict[str, int] = {}

    # --- commands (any thread) ------------------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, priority: int = 0,
            cache_salt: str | None = None, arrival_time: float | None = None,
            pooling: PoolingParams | None = None) -> None:
        """Queue a request for the engine (Engine.add_request); a refusal reaches the outbox as fail(request_id)."""
        self._submit(("add", (request_id, list(prompt_token_ids), params, priority, cache_salt, arrival_time,
                              pooling)))

    def abort(self, request_id: str) -> None:
        """Queue an abort: the engine frees the request's blocks before its next step."""
        self._submit(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Queue fn(engine), run between steps; the future holds its result (completed on the loop's thread)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", (fn, fut)))
        return fut

    def stop(self) -> None:
        """Stop after the commands already queued and the current step (the engine aborts what is left)."""
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _submit(self, cmd: tuple[str, Any]) -> None:
        with self._cv:
            self._cmds.append(cmd)
            self._cv.notify()

    # --- state (any thread) ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """The engine is built and the loop steps it (not stopped, its thread, if it has one of its own, alive)."""
        return (self.engine is not None and self._started and not self._stop
                and (self._thread is None or self._thread.is_alive()))

    @property
    def stopped(self) -> bool:
        """The loop was told to stop, failed to build, or ended."""
        return self._stop

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the engine plus those of the requests not yet handed to it (n each: a request of
        n = 128 counted as one let concurrent ones past max_waiting_requests)."""
        queued = sum(c[1][2].n for c in list(self._cmds) if c[0] == "add")
        return (self.engine.num_waiting if self.engine is not None else 0) + queued

    @property
    def num_live(self) -> int:
        """Requests the engine holds, as the loop counts them (read it between steps: through `call`)."""
        return len(self._live)

    # --- the loop (its own thread) ---------------------------------------------------------------

    def start_thread(self) -> None:
        """Run the loop on a new thread (ENGINE_THREAD_NAME); a second call does nothing."""
        if self._thread is None:
            self._started = True
            self._thread = threading.Thread(target=self.run, name=ENGINE_THREAD_NAME, daemon=True)
            self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop's own thread to end (after `stop`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        """Build the engine on this thread (`built` resolves), then step it until `stop`; shut it down then."""
        self._started = True
        name_os_thread(ENGINE_THREAD_NAME)  # the OpenMP workers this thread starts carry its name
        try:
            if self.check_threads:
                warn_if_foreign_pool()
            eng = self.engine = self._build()
        except BaseException as e:  # reported to whoever waits on `built` (the CLI, /health)
            self.dead = e
            self._stop = True
            self.built.set_exception(e)
            return
        self.built.set_result(eng)
        if hasattr(eng, "early"):  # an Engine: a step's forwards reach their streams as each ends (Engine.early)
            eng.early = self._emit
        try:
            while True:
                self.outbox.idle()
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
                except BackendLostError as e:  # nothing can run until a restart: say so once, and stop
                    log.error("%s; the engine stops (its requests fail with 503 and /health says so)", e)
                    self.dead = e
                    self.outbox.fail_all(EngineDeadError(str(e)))
                    break
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
            self.outbox.fail_all(EngineDeadError(f"the engine thread crashed: {e}"))
        finally:
            self._stop = True
            try:
                eng.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine shutdown failed")

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to the outbox, the finished ones' requests leaving `_live`: from the loop's thread, or
        mid-step from the backend's relay while the loop's thread waits in the backend's call."""
        live = self._live
        for o in outputs:
            if o.finished and o.request_id in live:
                live[o.request_id] -= 1
                if live[o.request_id] <= 0 or o.finish_reason is FinishReason.ERROR:
                    del live[o.request_id]
        self.outbox.deliver(outputs)

    def _apply(self, kind: str, arg: Any) -> None:
        eng = self.engine
        if kind == "add":
            rid, prompt, params, priority, salt, arrival, pooling = arg
            self.seqs_added += params.n
            try:
                eng.add_request(prompt, params, request_id=rid, priority=priority, arrival_time=arrival,
                                cache_salt=salt, pooling=pooling)
            except Exception as e:  # InvalidRequestError and friends go back to that caller only
                self.outbox.fail(rid, e)
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
            self.outbox.fail(rid, err)
