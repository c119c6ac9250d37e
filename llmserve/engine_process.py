"""The engine in its own process, so the server's event loop and the engine's step loop stop sharing one GIL.

In one process the engine thread and the event loop take turns on the GIL: at 256 streams on a
GPU, turning each step's deltas into SSE chunks costs the loop about as much Python time as the
step costs the engine, and every step waits for it (an H200 served HTTP at 0.41–0.57 of offline).
vLLM splits the same way (its EngineCore process). The child process runs the very same step loop
(EngineLoop, on its main thread, which builds and steps the engine) with a PipeOutbox: what the loop
hands it (deltas, errors) goes over a pipe, with call results and the metric sinks' events.
The server process keeps a ProcessEngine (the EngineClient the routes call), the ServingModel the child
described (tokenizer, limits, grammar), and a SinkRelay: the configured metric sinks, fed the child's events.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
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
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmserve.config import EngineConfig
from llmserve.engine import Engine, build_sinks
from llmserve.engine_client import RequestStream, Streams
from llmserve.engine_loop import EngineLoop
from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.plugins import load_plugins
from llmserve.request import PoolingParams, RequestOutput, SamplingParams
from llmserve.serving_model import ServingModel, describe_model

log = logging.getLogger("llmserve.engine_process")


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


class ProcessEngine:
    """The EngineClient of an engine in a child process: the same streams, abort, drain and call as AsyncEngine.

    It composes the Streams of the requests in flight (on the event loop), a sending thread for the commands, a
    receiving thread for what the child's EngineLoop put in its PipeOutbox, and a SinkRelay for the metric events.
    `call(fn)` sends fn to the child, so fn must pickle (a module-level function, or
    operator.methodcaller("stats")), and its result comes back by pickle too.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.streams = Streams()
        self.loop: asyncio.AbstractEventLoop | None = None  # where the streams live (bound by start)
        self.built: concurrent.futures.Future = concurrent.futures.Future()  # the SinkRelay, or why it failed
        self.serving: concurrent.futures.Future = concurrent.futures.Future()  # the ServingModel, or why it failed
        self.sinks: SinkRelay | None = None
        self.dead: BaseException | None = None  # why the engine process stopped, if it failed
        self.num_steps = 0  # as the child last reported it
        self._stop = False
        self._thread: threading.Thread | None = None  # starts the child, then receives from it
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # sent by one thread: the event loop never blocks
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()  # the event loop adds calls, the receiving thread resolves them
        self._calls_closed = False  # the child is gone: a call fails at once rather than wait forever
        # (num_waiting, sequences added, steps) as of the child's latest message, replaced whole (never torn)
        self._reported = (0, 0, 0)
        self._seqs_sent = 0
        self._bound = threading.Event()  # the event loop is known: `serve` starts this before uvicorn's loop exists

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the child process (it builds the engine); outputs go to `loop` (default: the running one).

        Called again, it only binds the loop."""
        if loop is not None:
            self.loop = loop
        elif self.loop is None:
            with contextlib.suppress(RuntimeError):  # no running loop: bound by a later start(loop)
                self.loop = asyncio.get_running_loop()
        if self.loop is not None:
            self._bound.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmserve-engine-receive", daemon=True)
            self._thread.start()

    def wait_built(self, timeout: float | None = None) -> Any:
        """Block until the child has built its engine (return the SinkRelay); raise why it could not."""
        return self.built.result(timeout)

    @property
    def running(self) -> bool:
        """The child has built its engine and is alive."""
        return self.sinks is not None and not self._stop and self._proc is not None and self._proc.is_alive()

    @property
    def num_active(self) -> int:
        """Requests whose stream has not ended."""
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the child, as it last reported, plus those sent since."""
        waiting, seqs_seen, _ = self._reported
        return waiting + self._seqs_sent - seqs_seen

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before it starts)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def metric_sinks(self) -> list[MetricSink]:
        """The configured sinks, here in the server's process, fed the child's events."""
        return self.sinks.metric_sinks

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink here: it gets every later event of the child's engine."""
        self.sinks.add_metric_sink(sink)

    # --- requests (call these on the event loop) ----------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None) -> RequestStream:
        """Send a request to the child and return its stream at once."""
        if self.loop is None or not self.running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        stream = self.streams.open(request_id, params.n, self.loop)
        self._seqs_sent += params.n
        self._commands.put(("add", (stream.request_id, list(prompt_token_ids), params, priority, cache_salt,
                                     time.perf_counter(), pooling)))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends now; the child frees its blocks before its next step."""
        if self.streams.close(request_id):
            self._commands.put(("abort", request_id))

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with exc; the child frees their blocks."""
        for rid in self.streams.fail_all(exc):
            self._commands.put(("abort", rid))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) run in the child between steps; fn and its result cross the pipe by pickle."""
        if not self.running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - a lambda or a closure: the caller's mistake, not the engine's
            raise TypeError(f"call(fn) sends fn to the engine process, so it must pickle (a module-level "
                            f"function, operator.methodcaller): {e}") from None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._calls_lock:
            if self._calls_closed:
                raise EngineDeadError("the engine process stopped")
            cid = next(self._call_ids)
            self._calls[cid] = fut
        self._commands.put(("call", (fn, cid)))
        return await asyncio.wrap_future(fut)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if the timeout passed first."""
        return await self.streams.wait_idle(timeout)

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to timeout seconds, then fail the rest (their callers answer 503)."""
        for rid in await self.streams.drain(timeout):
            self._commands.put(("abort", rid))

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Drain for up to drain_timeout, stop the child (it aborts what is left), close the sinks here."""
        await self.drain(drain_timeout)
        self._stop = True
        self._close_commands()
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
        if self.sinks is not None:
            self.sinks.shutdown()
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
                self.sinks = SinkRelay(self.config, plugins)
            except BaseException as e:  # noqa: BLE001 - reported to whoever waits on `built`
                err = e
        if err is not None:
            self._fail_start(err)
            return
        self.built.set_result(self.sinks)
        self.serving.set_result(model)
        self._receive(out_r)

    def _close_commands(self) -> None:
        """Tell the child to stop after the commands already queued, then end the sending thread."""
        self._commands.put(("stop", None))
        self._commands.put(None)

    def _kill_child(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _fail_start(self, err: BaseException) -> None:
        self.dead = err
        self._stop = True
        self._close_commands()
        self.built.set_exception(err)
        self.serving.set_exception(err)

    def _send_loop(self, conn) -> None:
        try:
            while (cmd := self._commands.get()) is not None:
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
            self.loop.call_soon_threadsafe(self.streams.fail, arg[0], err)
        elif kind == "call":
            with self._calls_lock:
                fut = self._calls.pop(arg[1], None)
            if fut is not None and not fut.done():
                fut.set_exception(err)

    def _receive(self, conn) -> None:
        self._bound.wait()
        loop = self.loop
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
        # caller does, as in one process), then what the child's PipeOutbox was handed
        try:
            if events:
                self.sinks.replay(events)
        finally:  # a failing sink never costs a request its tokens
            if name == "deliver":
                self.streams.deliver(*args)
            elif name == "fail":
                self.streams.fail(*args)
            elif name == "fail_all":
                self.fail_all(*args)


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


class PipeOutbox:
    """The child's EngineLoop's outbox: what the loop makes, with the metric events made meanwhile, over the pipe.

    Written by the child's main thread only (the step loop, and the calls it completes), so messages never interleave.
    """

    def __init__(self, conn):
        self.conn = conn
        self.core: EngineLoop | None = None  # the loop whose state each message carries (set once it exists)
        self.events = _Forward()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs for the server's streams."""
        self._post("deliver", outputs)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """One request failed: its stream on the server's side ends with exc."""
        self._post("fail", request_id, _picklable(exc))

    def fail_all(self, exc: BaseException) -> None:
        """The loop died: every stream on the server's side ends with exc."""
        self._post("fail_all", _picklable(exc))

    def idle(self) -> None:
        """Ship the metric events made outside a step's outputs (an abort, a prefill chunk) before waiting."""
        if self.events.events:
            self._post(None)

    def _post(self, name: str | None, *args: Any) -> None:
        core = self.core
        self.conn.send(("post", name, args, self.events.take(),
                        (core.engine.num_waiting, core.seqs_added, core.num_steps)))

    def send_built(self, fut: concurrent.futures.Future) -> None:
        """The engine is built (its facts, for the server's ServingModel) or why it is not; its sink forwards here."""
        if fut.exception() is not None:
            self.conn.send(("built", None, _picklable(fut.exception())))
            return
        eng = fut.result()
        eng.add_metric_sink(self.events)
        self.conn.send(("built", describe_model(eng), None))

    def send_result(self, cid: int, fut: concurrent.futures.Future) -> None:
        """A call's result (or its error) for the server's waiting caller."""
        exc = fut.exception()
        value = None if exc is not None else fut.result()
        try:
            self.conn.send(("result", cid, value, _picklable(exc) if exc is not None else None))
        except (OSError, EOFError):  # the server is gone
            pass
        except Exception as e:  # noqa: BLE001 - the result does not pickle: the caller gets why
            self.conn.send(("result", cid, None, RuntimeError(f"the call's result does not pickle: "
                                                               f"{type(e).__name__}: {e}")))


def _picklable(exc: BaseException) -> BaseException:
    """exc itself when it survives pickling (the server maps its type to a status), else its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _read_commands(core: EngineLoop, outbox: PipeOutbox, conn) -> None:
    """The child's second thread: commands from the server onto the step loop's list; EOF stops the loop."""
    try:
        while True:
            kind, arg = conn.recv()
            if kind == "stop":
                break
            if kind == "add":
                core.add(*arg)
            elif kind == "abort":
                core.abort(arg)
            elif kind == "call":
                fn, cid = arg
                core.call(fn).add_done_callback(functools.partial(outbox.send_result, cid))
    except (EOFError, OSError):  # the server process died without stopping this one: nothing to finish for
        os._exit(0)                # anyone, and a model still loading would hold its memory for nothing
    core.stop()


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
    outbox = PipeOutbox(out_conn)
    core = outbox.core = EngineLoop(functools.partial(Engine.from_config, cfg), outbox)
    core.built.add_done_callback(outbox.send_built)
    threading.Thread(target=_read_commands, args=(core, outbox, cmd_conn), name="llmserve-engine-commands",
                     daemon=True).start()
    core.run()
    out_conn.close()
