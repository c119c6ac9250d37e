"""ServerState: the engine client and the model it serves, readiness and draining, and the admission check every /v1
request passes once."""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.config import EngineConfig
from llmserve.engine_client import EngineClient
from llmserve.server.connections import Connections
from llmserve.server.errors import ApiError
from llmserve.serving_model import ServingModel

log = logging.getLogger("llmserve.server")

_STATS = operator.methodcaller("stats")


@dataclass
class ServerState:
    """What the routes share; one per app."""

    config: EngineConfig
    client: EngineClient  # requests in, streams out: the only way the routes reach the engine
    model: ServingModel | None = None  # what the routes read of the model (tokenizer, limits, defaults) once built
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    connections: Connections | None = None  # the transport's table (transport.uvicorn_config); None without one
    # path → {"path": its OpenAPI path item, "schemas": the component schemas it refers to}: route plugins' own
    openapi_paths: dict[str, dict] = field(default_factory=dict)
    # path → what writes an ApiError as that route's API writes errors (a route plugin's own shape; OpenAI's else)
    error_bodies: dict[str, Callable[[Any], dict]] = field(default_factory=dict)
    # paths whose route the app's owner set in place of any plugin's (the Ray ingress's fleet-wide /metrics): a
    # plugin's route there is skipped quietly, not reported as a clash
    owned_paths: set[str] = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))
    _snapshot: tuple[float, dict] | None = None  # (monotonic time, /stats body): polling never costs a step
    _snapshot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def stats_snapshot(self, max_age: float = 0.1) -> dict:
        """The engine's /stats body, recomputed on the engine thread at most every max_age seconds."""
        async with self._snapshot_lock:  # many pollers at once still cost one engine call
            # (never a cached body once the engine has stopped: a dead engine process answers 503, not its last 200)
            if self._snapshot is None or not self.client.running or time.monotonic() - self._snapshot[0] >= max_age:
                # a callable that pickles (the engine may be in another process) and calls the engine's own stats()
                snap = await self.client.call(_STATS)
                snap["server"] = {"ready": self.ready, "draining": self.draining,
                                  "active_requests": self.client.num_active, "steps": self.client.num_steps,
                                  "engine_pid": self.client.pid,
                                  "connections": self.connections.stats() if self.connections else None}
                self._snapshot = (time.monotonic(), snap)
            return self._snapshot[1]

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def begin_drain(self) -> None:
        """Stop admitting requests (503) and report unhealthy; in-flight requests continue."""
        if not self.draining:
            log.info("draining: new requests get 503, in-flight requests continue")
        self.draining = True

    def admit(self) -> EngineClient:
        """503 when not ready or draining, 429 with Retry-After when the waiting queue is full."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="draining", headers={"Retry-After": "5"})
        if not self.ready:
            why = f": {self.load_error}" if self.load_error else " (the model is loading)"
            raise ApiError(503, f"the engine is not ready{why}", code="not_ready", headers={"Retry-After": "5"})
        if not self.client.running:
            raise ApiError(503, "the engine has stopped", code="engine_unavailable")
        self.check_room(1)
        return self.client

    def check_room(self, sequences: int) -> None:
        """429 with Retry-After when this many more sequences would queue past max_waiting_requests."""
        limit = self.config.server.max_waiting_requests
        waiting = self.client.num_waiting
        if waiting + sequences > limit:
            raise ApiError(429, f"too many requests are waiting ({waiting}, limit max_waiting_requests={limit}); "
                                "retry later", code="queue_full", headers={"Retry-After": "1"})

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (a missing model means the served one)."""
        if model is None or model in (self.model_name, self.config.model.model):
            return
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                       param="model", code="model_not_found")
