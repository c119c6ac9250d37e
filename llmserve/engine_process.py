"""The engine in its own process, so the server's event loop and the engine's step loop stop sharing one GIL.

In one process the engine thread and the event loop take turns on the GIL: at 256 streams on a
GPU, turning each step's deltas into SSE chunks costs the loop about as much Python time as the
step costs the engine, and every step waits for it (an H200 served HTTP at 0.41–0.57 of offline).
vLLM splits the same way (its EngineCore process). The child process runs the very same step loop
(AsyncEngine._run, on its main thread, which builds and steps the engine) and sends over a pipe
what that loop hands the event loop: deltas, errors, call results, and the metric sinks' events.
The server process keeps a ProcessEngine (the EngineClient the routes call), the ServingModel the child
described (tokenizer, limits, grammar), and a SinkRelay: the configured metric sinks, fed the child's events.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from llmserve.async_engine import AsyncEngine
from llmserve.config import EngineConfig
from llmserve.engine import Engine, build_sinks
from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.plugins import load_plugins
from llmserve.serving_model import ServingModel, describe_model

log = logging.getLogger("llmserve.engine_process")

# what the child's loop may ask the server's event loop to run (AsyncEngine methods, by name)
_POSTED = frozenset({"_deliver", "_deliver_error", "fail_all"})


def wants_process(config: EngineConfig) -> bool:
    """server.engine_core: process or thread; auto is a process on a GPU, where the host is the limit."""
    mode = config.server.engine_core
    return mode == "process" or (mode == "auto" and config.model.device.startswith("cuda"))


# --- the server's side --------------------------------------------------------------------------


class SinkRelay:
    """The configured metric sinks on the server's side, fed the events the child's engine emitted."""

    def __init__(self, config: EngineConfig, plugins):
        self.metric_sinks: list[MetricSink] = build_sinks(config, plugins)
        self._last_stats = None  # the latest SchedulerStats: a sink added later starts from the present

    def replay(self, events: list[tuple[str, Any]]) -> None:
        """Give this side's sinks the events the child's engine emitted (on_step, on_scheduler_stats, …)."""
        for hook, payload in events:
            if hook == "on_scheduler_stats":
                self._last_stats = payload
            for s in self.metric_sinks:
                try:
                    getattr(s, hook)(payload)
                except Exception:  # noqa: BLE001 - a broken sink is logged, and the others still get the event
                    log.exception("metric sink %s failed in %s", type(s).__name__, hook)

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink: it starts from the latest scheduler stats and gets every later event."""
        self.metric_sinks.append(sink)
        if self._last_stats is not None:
            sink.on_scheduler_stats(self._last_stats)

    def shutdown(self) -> None:
        """Close the sinks."""
        for s in self.metric_sinks:
            s.close()


class ProcessEngine(AsyncEngine):
    """The server's AsyncEngine over an engine in a child process: the same streams, abort, drain and call.

    `call(fn)` sends fn to the child, so fn must pickle (a module-level function, or
    operator.methodcaller("stats")), and its result comes back by pickle too.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(lambda: None)  # the child builds the engine; the thread here only receives
        self.config = config
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # commands, sent by one thread: the loop never blocks
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()  # the event loop adds calls, the receiving thread resolves them
        self._calls_closed = False  # the child is gone: a call fails at once rather than wait forever
        # (num_waiting, adds applied, steps) as of the child's latest message, replaced whole (never torn)
        self._reported = (0, 0, 0)
        self._adds_sent = 0
        self._bound = threading.Event()  # the event loop is known: `serve` starts this before uvicorn's loop exists

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().start(loop)
        if self._loop is not None:
            self._bound.set()

    @property
    def running(self) -> bool:
        return (self.engine is not None and not self._stop and self._proc is not None and self._proc.is_alive())

    @property
    def num_waiting(self) -> int:
        waiting, adds_seen, _ = self._reported
        return waiting + self._adds_sent - adds_seen

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before it starts)."""
        return self._proc.pid if self._proc is not None else None

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        if not self.running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - a lambda or a closure: the caller's mistake, not the engine's
            raise TypeError(f"call(fn) sends fn to the engine process, so it must pickle (a module-level "
                            f"function, operator.methodcaller): {e}") from None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", (fn, fut)))
        return await asyncio.wrap_future(fut)

    def _submit(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            self._adds_sent += 1
        elif kind == "call":
            fn, fut = arg
            with self._calls_lock:
                if self._calls_closed:
                    fut.set_exception(EngineDeadError("the engine process stopped"))
                    return
                cid = next(self._call_ids)
                self._calls[cid] = fut
            cmd = ("call", (fn, cid))
        self._outbox.put(cmd)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Drain for up to drain_timeout, stop the child (it aborts what is left), close the sinks here."""
        await self.drain(drain_timeout)
        self._stop = True
        self._close_outbox()
        loop = asyncio.get_running_loop()
        if self._proc is not None:
            await loop.run_in_executor(None, self._proc.join, 10.0)
            if self._proc.is_alive():
                log.warning("the engine process did not stop within 10 s; killing it")
                self._proc.kill()
            atexit.unregister(self._kill_child)
        if self._thread is not None:  # its last messages are on the loop once it has ended
            await loop.run_in_executor(None, self._thread.join, 5.0)
            await asyncio.sleep(0)
        if self.engine is not None:
            self.engine.shutdown()
        self.fail_all(EngineDeadError("the server is shutting down"))

    # --- the receiving thread -------------------------------------------------------------------

    def _run(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, args=(self.config, cmd_r, out_w),
                                 name="llmserve-engine-core", daemon=True)
        try:
            self._proc.start()
        except BaseException as e:
            for c in (cmd_r, cmd_w, out_r, out_w):
                c.close()
            self._fail_start(e)
            return
        cmd_r.close()
        out_w.close()  # only the child writes: its exit ends recv() here with EOFError
        # an exit that skipped shutdown (an error after start-up) must not wait on a child that ignores
        # SIGTERM: multiprocessing's own exit handler would terminate and join it; this one runs first
        atexit.register(self._kill_child)
        threading.Thread(target=self._send_loop, args=(cmd_w,), name="llmserve-engine-send", daemon=True).start()
        try:
            _, facts, err = out_r.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            facts, err = None, EngineDeadError(f"the engine process exited during start-up "
                                               f"(exit code {self._proc.exitcode}); its log says why")
        if err is None:
            try:
                plugins = load_plugins()
                model = ServingModel.from_facts(self.config, plugins, facts)
                self.engine = SinkRelay(self.config, plugins)
            except BaseException as e:  # noqa: BLE001 - reported to whoever waits on `built`
                err = e
        if err is not None:
            self._fail_start(err)
            return
        self.built.set_result(self.engine)
        self.serving.set_result(model)
        self._receive(out_r)

    def _close_outbox(self) -> None:
        """Tell the child to stop after the commands already queued, then end the sending thread."""
        self._outbox.put(("stop", None))
        self._outbox.put(None)

    def _kill_child(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _fail_start(self, err: BaseException) -> None:
        self.dead = err
        self._stop = True
        self._close_outbox()
        self.built.set_exception(err)
        self.serving.set_exception(err)

    def _send_loop(self, conn) -> None:
        try:
            while (cmd := self._outbox.get()) is not None:
                try:
                    conn.send(cmd)
                except (OSError, EOFError):  # the child is gone: the receiving thread reports it
                    return
                except Exception as e:  # noqa: BLE001 - this command does not pickle: fail it alone
                    self._unsendable(cmd, e)
        finally:
            conn.close()

    def _unsendable(self, cmd: tuple[str, Any], exc: Exception) -> None:
        kind, arg = cmd
        err = RuntimeError(f"the {kind} could not be sent to the engine process: {type(exc).__name__}: {exc}")
        log.error("%s", err)
        if kind == "add":  # its stream ends with the error; the child never saw it
            self._loop.call_soon_threadsafe(self._deliver_error, arg[0], err)
        elif kind == "call":
            with self._calls_lock:
                fut = self._calls.pop(arg[1], None)
            if fut is not None and not fut.done():
                fut.set_exception(err)

    def _receive(self, conn) -> None:
        self._bound.wait()
        loop = self._loop
        why = ""
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "result":
                    _, cid, value, exc = msg
                    with self._calls_lock:
                        fut = self._calls.pop(cid, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(exc) if exc is not None else fut.set_result(value)
                    continue
                _, name, args, events, self._reported = msg
                self.num_steps = self._reported[2]  # the child counts its steps
                loop.call_soon_threadsafe(self._remote, name, args, events)
        except (EOFError, OSError):
            pass
        except BaseException as e:  # noqa: BLE001 - a message that does not unpickle here: the pipe is unusable
            why = f"; a message from it could not be read: {type(e).__name__}: {e}"
            log.exception("the engine process's message could not be read; stopping it")
        finally:
            conn.close()
            self._proc.join(0 if why else 5)
            self._kill_child()
            if not self._stop:
                err = EngineDeadError(f"the engine process exited (exit code {self._proc.exitcode}){why}")
                log.error("%s; failing the requests in flight", err)
                self.dead = err
                loop.call_soon_threadsafe(self.fail_all, err)
            self._stop = True
            with self._calls_lock:
                self._calls_closed = True
                calls, self._calls = list(self._calls.values()), {}
            for fut in calls:
                if not fut.done():
                    fut.set_exception(EngineDeadError("the engine process stopped"))

    def _remote(self, name: str | None, args: tuple, events: list) -> None:
        # on the event loop: the child's metric events first (the sinks see a request end before its
        # caller does, as in one process), then the hand-over itself
        try:
            if events:
                self.engine.replay(events)
        finally:  # a failing sink never costs a request its tokens
            if name in _POSTED:
                getattr(self, name)(*args)


# --- the child's side ---------------------------------------------------------------------------


class _Forward(MetricSink):
    """The child engine's only sink: it keeps every event for the server process's sinks."""

    def __init__(self):
        self.events: list[tuple[str, Any]] = []

    def on_step(self, metrics) -> None:
        self.events.append(("on_step", metrics))

    def on_request_finished(self, metrics) -> None:
        self.events.append(("on_request_finished", metrics))

    def on_scheduler_stats(self, stats) -> None:
        self.events.append(("on_scheduler_stats", stats))

    def take(self) -> list[tuple[str, Any]]:
        events, self.events = self.events, []
        return events


class _Core(AsyncEngine):
    """The child's step loop: AsyncEngine's own, with every hand-over to the event loop sent over the pipe."""

    def __init__(self, build: Callable[[], Engine], conn):
        super().__init__(build)
        self._conn = conn  # written by the main thread only (the step loop and what it completes)
        self._events = _Forward()
        self._adds = 0
        self.built.add_done_callback(self._send_built)

    def _send_built(self, fut: concurrent.futures.Future) -> None:
        if fut.exception() is not None:
            self._conn.send(("built", None, _picklable(fut.exception())))
            return
        eng = fut.result()
        eng.add_metric_sink(self._events)
        self._conn.send(("built", describe_model(eng), None))

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        args = tuple(_picklable(a) if isinstance(a, BaseException) else a for a in args)
        self._conn.send(("post", fn.__name__, args, self._events.take(), self._state()))

    def _flush(self) -> None:
        if self._events.events:  # events outside a step's outputs (an abort, a prefill chunk)
            self._conn.send(("post", None, (), self._events.take(), self._state()))

    def _state(self) -> tuple[int, int, int]:
        return self.engine.num_waiting, self._adds, self.num_steps

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._adds += 1
        super()._apply(kind, arg)

    def _send_result(self, cid: int, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        value = None if exc is not None else fut.result()
        try:
            self._conn.send(("result", cid, value, _picklable(exc) if exc is not None else None))
        except (OSError, EOFError):  # the server is gone
            pass
        except Exception as e:  # noqa: BLE001 - the result does not pickle: the caller gets why
            self._conn.send(("result", cid, None, RuntimeError(f"the call's result does not pickle: "
                                                                f"{type(e).__name__}: {e}")))


def _picklable(exc: BaseException) -> BaseException:
    """exc itself when it survives pickling (the server maps its type to a status), else its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _read_commands(core: _Core, conn) -> None:
    """The child's second thread: commands from the server onto the step loop's list; EOF stops the loop."""
    try:
        while True:
            kind, arg = conn.recv()
            if kind == "stop":
                break
            if kind == "call":
                fn, cid = arg
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.add_done_callback(functools.partial(core._send_result, cid))
                arg = (fn, fut)
            core._submit((kind, arg))
    except (EOFError, OSError):  # the server process died without stopping this one: nothing to finish for
        os._exit(0)                # anyone, and a model still loading would hold its memory for nothing
    core.stop_nowait()


def _child_main(config: EngineConfig, cmd_conn, out_conn) -> None:
    """The engine process: build the engine on this (main) thread, then step it until told to stop."""
    # Ctrl-C and SIGTERM are the server's: it drains, then stops this process. A signal sent to the whole
    # group (a terminal's Ctrl-C, systemd's default KillMode, `timeout`) must not end the engine under the
    # drain; if the server dies without stopping it, the command pipe's EOF does
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, config.server.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    logging.getLogger("llmserve.plugins").disabled = True  # the server process has reported them already
    # the configured sinks run in the server process (it serves /metrics); here one sink forwards to them
    cfg = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, sinks=[]))
    core = _Core(functools.partial(Engine.from_config, cfg), out_conn)
    threading.Thread(target=_read_commands, args=(core, cmd_conn), name="llmserve-engine-commands",
                     daemon=True).start()
    core._run()
    out_conn.close()
