"""`llmserve worker`: any registered model backend served over the worker contract (worker.proto)."""

from __future__ import annotations

import json
import logging
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from llmserve.config import EngineConfig
from llmserve.errors import ConfigError
from llmserve.interfaces import ModelBackend
from llmserve.plugins import PluginSet
from llmserve_grpc import worker_pb2 as pb
from llmserve_grpc import worker_pb2_grpc as pb_grpc
from llmserve_grpc.backend import CHANNEL_OPTIONS
from llmserve_grpc.contract import (NO_SESSION, PROTOCOL, SequenceTokens, batch_from_proto, model_info,
                                   output_to_proto)

log = logging.getLogger("llmserve.grpc")


class Worker(pb_grpc.ModelWorkerServicer):
    """One backend and its KV cache, for one server session at a time."""

    def __init__(self, backend: ModelBackend, name: str, model: str):
        self.backend = backend
        self.name = name
        self.model = model
        self.worker_id = uuid.uuid4().hex
        self.session = ""
        self.geometry: tuple[int, int] | None = None
        self.tokens = SequenceTokens()
        self.lock = threading.Lock()  # the backend is not thread-safe: one call at a time

    def Connect(self, request, context):
        """The hosted model's facts, for a server of the same contract version."""
        if request.protocol != PROTOCOL:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this worker speaks contract version {PROTOCOL}, the server {request.protocol}")
        return model_info(self.backend, self.name, self.model, self.worker_id)

    def NumKvBlocks(self, request, context):
        """How many blocks of the asked size the backend's KV budget holds."""
        if request.block_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_size must be at least 1")
        with self.lock:
            return pb.NumKvBlocksReply(num_blocks=self._guarded(context, self.backend.num_kv_blocks,
                                                                request.block_size))

    def InitKvCache(self, request, context):
        """Allocate the cache (kept when a new session asks the same geometry) and start a new session."""
        if request.num_blocks < 1 or request.block_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks and block_size must be at least 1")
        with self.lock:
            geometry = (request.num_blocks, request.block_size)
            if geometry != self.geometry:
                self._guarded(context, self.backend.init_kv_cache, *geometry)
                self.geometry = geometry
            if self.session:
                log.warning("a new server session replaces the last one: that server's steps are refused from now on")
            # a fresh server's allocator holds no cached block, so blocks the last session wrote are never read
            self.session = uuid.uuid4().hex
            self.tokens = SequenceTokens()
            log.info("KV cache: %d blocks of %d tokens; session %s", *geometry, self.session)
            return pb.InitKvCacheReply(session=self.session)

    def Execute(self, request, context):
        """Run one step of the session's batch on the backend."""
        with self.lock:
            if not self.session or request.session != self.session:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{NO_SESSION} for that server: it restarted, or another server connected since; "
                              "restart the server" if self.session else
                              f"{NO_SESSION} yet (it restarted?): restart the server")
            try:
                batch = batch_from_proto(request, self.tokens, self.backend.vocab_size)
            except LookupError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if not batch.requests:
                return pb.StepResult()
            out = self._guarded(context, self.backend.execute, batch)
            return output_to_proto(out, len(batch.requests))

    def Describe(self, request, context):
        """The hosted backend's describe(), as JSON."""
        with self.lock:
            return pb.DescribeReply(json=json.dumps({"worker_id": self.worker_id, **self.backend.describe()},
                                                    default=str))

    def _guarded(self, context, fn, *args):
        """fn(*args); a failure answers INTERNAL with its type and message (and is logged here in full)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the server fails the step and says why
            log.exception("%s failed", getattr(fn, "__name__", "the backend"))
            context.abort(grpc.StatusCode.INTERNAL, f"the worker's {self.name} backend failed: {type(e).__name__}: {e}")


def start(config: EngineConfig, plugins: PluginSet) -> tuple[grpc.Server, int, ModelBackend]:
    """Build the configured backend and start serving it at server.host:server.port: the server, its port, the
    backend."""
    name = config.backend.name
    if name == "grpc":
        raise ConfigError("backend.name: a worker hosts a model backend (torch, onnx, fake, ...), not grpc")
    backend = plugins.get("backend", name).factory(config)
    # one thread: the backend runs on the thread it always runs on (its thread pools stay one), calls queue
    # (not gRPC's default SO_REUSEPORT: a second worker on a busy port would take half of its connections)
    server = grpc.server(ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-worker"),
                         options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
    pb_grpc.add_ModelWorkerServicer_to_server(Worker(backend, name, config.model.model), server)
    host, port = config.server.host, config.server.port
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpcio raises where it cannot bind
        backend.shutdown()
        raise ConfigError(f"the worker cannot listen on {host}:{port} (in use, or not an address of this "
                          f"machine): {e}") from None
    server.start()
    return server, bound, backend


def serve(config: EngineConfig, plugins: PluginSet) -> int:
    """`llmserve worker`: serve until SIGINT or SIGTERM; the exit status."""
    server, port, backend = start(config, plugins)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    # the line a script (or a test) waits for, with the port where it asked for any free one (0)
    print(f"llmserve worker: serving the {config.backend.name} backend ({config.model.model}) on "
          f"{config.server.host}:{port}", flush=True)
    stopped.wait()
    server.stop(grace=5).wait()
    backend.shutdown()
    return 0
