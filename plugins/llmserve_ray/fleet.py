"""The ingress side: the same OpenAI routes over a DeploymentHandle to the engine replicas.

The routes call an EngineClient and read a ServingModel (tokenizer, limits, grammar, plugins). Here
FleetEngine is that EngineClient, with each request's deltas pumped from a replica's streamed
`generate` into the same RequestStream; the ServingModel is built from the facts a replica describes. Everything else (parsing, validation, answers, SSE, disconnects) is the server's
own code, unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import uuid
from typing import Any

from llmserve.engine_client import RequestStream, Streams
from llmserve.errors import EngineDeadError
from llmserve.interfaces import MetricSink
from llmserve.serving_model import ServingModel

log = logging.getLogger("llmserve.ray")

# deployment name → the LLMRequestRouter of that deployment's handle in this process (serve_router.py
# registers it): the ingress reads the running replicas and the router's costs from it
ROUTERS: dict[str, Any] = {}
REPLICAS = "EngineReplica"  # the replicas' deployment (launch.py names it so): the ingress's key into ROUTERS


def own_serve_request_id() -> None:
    """Give the Serve calls of the current task (its own copy of the context) an internal request id of their own.

    Serve's request router indexes pending calls by that id, and every call made while serving one HTTP request
    carries the request's: of two concurrent calls (a request of several prompts) the second was never routed."""
    from ray.serve import context

    ctx = context._get_serve_request_context()
    context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))


class FleetView:
    """What FleetEngine.call hands a function in place of an engine: the fleet's stats, as /stats reads them."""

    def __init__(self, stats: dict[str, Any]):
        self._stats = stats

    def stats(self) -> dict[str, Any]:
        """Each replica's /stats body as last reported, and their sums."""
        return self._stats


def replica_error(exc: BaseException) -> Exception:
    """What the client is told when its replica failed mid-request (it died, or was stopped)."""
    return EngineDeadError(f"the replica serving this request failed ({type(exc).__name__}); retry the request")


class FleetEngine:
    """The server's EngineClient over Ray Serve: requests go to the replicas the router picks, each one's deltas
    into its stream in the same Streams table the other clients use."""

    def __init__(self, model: ServingModel, handle, router_state):
        self.model = model  # built already, from a replica's facts: no engine here
        self.built: concurrent.futures.Future = concurrent.futures.Future()
        self.serving: concurrent.futures.Future = concurrent.futures.Future()
        self.streams = Streams()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None  # the fleet never dies as a whole: /health reads the replicas
        self.num_steps = 0  # the replicas count their own steps (their /stats)
        self._stop = False
        self._sinks: list[MetricSink] = []  # no steps here: the replicas' sinks are the ones /metrics reads
        self.handle = handle
        self.router_state = router_state  # () -> the LLMRequestRouter of this process (replica list, costs)
        self._tasks: dict[str, asyncio.Task] = {}
        self._waiting = 0  # sequences sent to a replica that has not answered yet

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Bind the event loop the streams live on; the model is known already."""
        self.loop = loop or self.loop or asyncio.get_running_loop()
        if not self.built.done():
            self.built.set_result(self.model)
            self.serving.set_result(self.model)

    def reports(self) -> dict[str, dict]:
        """Each running replica's latest report (routing stats), by replica id."""
        router = self.router_state()
        return router.reports() if router is not None else {}

    @property
    def running(self) -> bool:
        """Some replica is up and the ingress is not shutting down."""
        return not self._stop and bool(self.reports())  # /health: 503 while no replica is up

    @property
    def num_waiting(self) -> int:
        """Sequences sent to a replica that has not answered yet."""
        return self._waiting

    @property
    def num_active(self) -> int:
        """Requests whose stream has not ended."""
        return len(self.streams)

    @property
    def metric_sinks(self) -> list[MetricSink]:
        """Sinks attached here (the replicas' own sinks are what the fleet's /metrics merges)."""
        return self._sinks

    def add_metric_sink(self, sink: MetricSink) -> None:
        """Attach a sink here: no engine steps in this process, so it gets no step events."""
        self._sinks.append(sink)

    @property
    def pid(self) -> int | None:
        """None: the replicas step in processes of their own (each replica's /stats names its own)."""
        return None

    def add_request(self, prompt_token_ids, params, request_id=None, priority=0, cache_salt=None,
                    pooling=None) -> RequestStream:
        """Send the request to the replica the router picks; its stream fills as the replica streams deltas."""
        if self._stop or self.loop is None:
            raise EngineDeadError("the server is shutting down")
        stream = self.streams.open(request_id, params.n, self.loop)
        rid = stream.request_id
        self._tasks[rid] = self.loop.create_task(self._pump(rid, list(prompt_token_ids), params, priority, cache_salt,
                                                            pooling))
        return stream

    async def _pump(self, rid: str, ids: list[int], params, priority: int, salt: str | None, pooling) -> None:
        own_serve_request_id()  # (a task of its own: the HTTP request's other calls keep theirs)
        gen = self.handle.options(stream=True).generate.remote(ids, params, rid, priority, salt, pooling)
        waiting = params.n
        self._waiting += waiting
        try:
            async for batch in gen:
                self._waiting -= waiting
                waiting = 0
                self.streams.deliver(batch)
        except asyncio.CancelledError:
            gen.cancel()  # the client went away: the replica aborts the request and frees its blocks
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed: this stream ends with an error
            log.warning("request %s failed on its replica: %s: %s", rid, type(e).__name__, e)
            self.streams.fail(rid, replica_error(e))
        finally:
            self._waiting -= waiting
            self._tasks.pop(rid, None)
        if rid in self.streams:  # the replica's stream ended before the request did
            self.streams.fail(rid, EngineDeadError("the replica ended the stream early"))

    def abort(self, request_id: str) -> None:
        """End the stream now and cancel its replica call (the replica aborts the request, frees its blocks)."""
        self.streams.close(request_id)
        t = self._tasks.pop(request_id, None)
        if t is not None:
            t.cancel()

    async def call(self, fn):
        """fn(FleetView): the fleet's stats (what /stats reads), refreshed."""
        return fn(FleetView(self.fleet_stats()))

    def fleet_stats(self) -> dict[str, Any]:
        """Each replica's /stats body as it last reported it (every stats_period_s), and their sums."""
        per = {r: rep.get("stats") for r, rep in sorted(self.reports().items())}
        ok = [s for s in per.values() if s]
        total = {k: sum(s["cache"][k] for s in ok)
                 for k in ("num_blocks", "used_blocks", "prefix_queries", "prefix_hits", "evictions")}
        total["prefix_hit_rate"] = total["prefix_hits"] / total["prefix_queries"] if total["prefix_queries"] else 0.0
        router = self.router_state()
        routed = router.routed_requests if router is not None else 0
        return {"model": self.model.config.served_model_name, "max_model_len": self.model.max_model_len,
                "waiting": sum(s["waiting"] for s in ok) + self._waiting, "running": sum(s["running"] for s in ok),
                "cache": total, "replicas": {r: s or {"error": "no report yet"} for r, s in per.items()},
                "router": {"name": self.model.config.distributed.router, "routed_requests": routed,
                           "seconds_per_request": router.routing_seconds / routed if routed else 0.0}}

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False if the timeout passed first."""
        return await self.streams.wait_idle(timeout)

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to timeout seconds, then fail the rest and cancel their calls."""
        for rid in await self.streams.drain(timeout):
            self.abort(rid)

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with exc and cancel its replica call."""
        for rid in self.streams.fail_all(exc):
            self.abort(rid)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let requests finish for up to drain_timeout, then end the rest: the replicas abort them."""
        if drain_timeout > 0:
            await self.wait_idle(drain_timeout)
        self._stop = True
        for rid in list(self._tasks):
            self.abort(rid)
        self.fail_all(EngineDeadError("the server is shutting down"))
