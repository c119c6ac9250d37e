"""serve(config): build the engine, run uvicorn, drain gracefully on SIGTERM and exit 0."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import socket

from llmserve.errors import ConfigError

log = logging.getLogger("llmserve.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it; a ConfigError saying what to pass when it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart is not refused by old TIME_WAITs
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = f"port {port} on {host} is already in use; pass --port N (or stop the other server)"
        elif e.errno == errno.EACCES:
            why = f"port {port} on {host} needs privileges this user lacks; pass --port N above 1023"
        else:  # an address this machine does not have, a name that does not resolve
            why = f"cannot listen on {host} port {port} ({e.strerror or e}); pass --host ADDRESS, e.g. 127.0.0.1"
        raise ConfigError(why) from None
    return sock


def serve(config) -> int:
    """Run the OpenAI-compatible server until SIGTERM/SIGINT; 0 after a clean drain."""
    sc = config.server
    # bound first, before torch is even imported, so a port in use fails the command in a second, not after the
    # model loads (not yet listening: a client is refused until the engine is ready, as before)
    sock = bind_socket(sc.host, sc.port)
    import uvicorn
    from sse_starlette.sse import AppStatus

    from llmserve.async_engine import AsyncEngine
    from llmserve.engine import Engine
    from llmserve.engine_process import ProcessEngine, wants_process
    from llmserve.server.app import create_app
    from llmserve.server.transport import uvicorn_config

    # built on the thread that then steps it (one thread owns torch: llmserve/threads.py), in this process
    # or its own (engine_process.py), and before listening, so a bad config or model fails the command
    if wants_process(config):
        aengine = ProcessEngine(config)
    else:
        aengine = AsyncEngine(lambda: Engine.from_config(config))
    aengine.start()
    engine, threads = aengine.wait_built(), aengine.serving.result().backend_info.get("threads", "-")
    if isinstance(aengine, ProcessEngine):
        log.info("engine core: process %d; torch threads %s", aengine.pid, threads)
    else:
        log.info("engine threads: %s; torch threads %s", engine.threads.layout()["load_thread"], threads)
    app = create_app(config, aengine)
    state = app.state.llm

    class DrainingServer(uvicorn.Server):
        """On SIGTERM: stop admitting (503), give requests drain_timeout to finish, answer the rest 503, exit 0."""

        def handle_exit(self, sig, frame):
            if not state.draining:
                state.begin_drain()
                loop = asyncio.get_running_loop()  # signal handlers run on the main thread, inside uvicorn's loop
                self.drain = loop.create_task(aengine.drain(sc.drain_timeout))
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and getattr(self, "_captured_signals", None):
                # uvicorn re-raises captured signals after shutdown, which would end the process
                # with 143; a drained SIGTERM is a clean exit
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    # sse-starlette would end open streams at once on shutdown; we drain them instead
    AppStatus.disable_automatic_graceful_drain()

    server = DrainingServer(uvicorn_config(app, sc))
    # what start-up made (torch, the model, the plugins) lives until exit: keep it out of every
    # collection, which shortens GC pauses while serving (the serve command then exits without the
    # interpreter's teardown: cli._leave_after_serving says why)
    gc.freeze()
    log.info("serving %s on http://%s:%d", config.served_model_name, sc.host, sock.getsockname()[1])
    server.run(sockets=[sock])
    return 0
