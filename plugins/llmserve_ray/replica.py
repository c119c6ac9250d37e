"""One engine replica: an AsyncEngine with its own backend and KV cache, as a Ray Serve deployment class.

Token streams go back through DeploymentHandle streaming (generate is an async generator); when
the caller cancels (its client went away) the generator is cancelled here and the request aborted,
which frees its blocks before the engine's next step. The replica reports the keys of the blocks
it holds as Serve routing stats, which the prefix-aware router reads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from llmserve.async_engine import AsyncEngine
from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.plugins import Registration, load_plugins
from llmserve.request import PoolingParams, SamplingParams
from llmserve.serving_model import describe_model
from llmserve_ray.routers import short_key

log = logging.getLogger("llmserve.ray")


def _with_prometheus(config: dict[str, Any]) -> dict[str, Any]:
    """The config with a Prometheus sink (the fleet's /metrics gathers each replica's)."""
    sinks = list(config.get("metrics", {}).get("sinks", []))
    if not any(s.get("name") == "prometheus" for s in sinks):
        sinks.append({"name": "prometheus"})
    return {**config, "metrics": {**config.get("metrics", {}), "sinks": sinks}}


class EngineReplica:
    """An llmserve engine in a Serve replica: generate (streamed), stats, metrics, routing stats, health."""

    def __init__(self, config: dict[str, Any]):
        from ray import serve

        cfg = config_from_dict(_with_prometheus(config))
        plugins = load_plugins()
        # keep a reference to the allocator the scheduler owns: its held block keys are the routing stats
        reg = plugins.get("cache", cfg.cache.name)
        self._allocator: list[Any] = []

        def capture(config, num_blocks):
            a = reg.factory(config, num_blocks)
            self._allocator.append(a)
            return a

        plugins.registries["cache"][reg.name] = Registration(reg.name, capture, reg.plugin)
        # no OpenMP-pool check: a Ray worker's own native threads (gRPC's, its io) carry stale copies of the names
        # Ray gives its main thread, so the count cannot tell them from a pool (llmserve/threads.py)
        self.aengine = AsyncEngine(lambda: Engine(cfg, plugins), check_threads=False)
        self.aengine.start()
        self.engine = self.aengine.wait_built()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a unit test builds the class directly)
            self.replica_id = "local"

    def _bind(self) -> None:
        # outputs come back to the loop that runs generate (Serve's user-code loop)
        self.aengine.start(asyncio.get_running_loop())

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
                       cache_salt: str | None = None, pooling: PoolingParams | None = None):
        """The request's RequestOutput deltas, one list per engine step that produced some (an embedding's one, with
        `pooling`)."""
        self._bind()
        stream = self.aengine.add_request(prompt_ids, params, request_id=request_id, priority=priority,
                                          cache_salt=cache_salt, pooling=pooling)
        try:
            while batch := await stream.next_batch():
                yield batch
        finally:  # finished, failed or cancelled by the caller: its blocks are freed before the next step
            self.aengine.abort(request_id)

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs of the engine without a model: limits, vocabulary, sampling defaults."""
        return describe_model(self.engine)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats, every distributed.options.stats_period_s: the short keys of the blocks this
        replica holds (the prefix-aware router's view), its /stats body and its Prometheus text (the fleet's)."""
        alloc = self._allocator[0]
        keys, snap = await self.aengine.call(lambda e: (alloc.held_block_keys(), e.stats()))
        snap["replica"] = self.replica_id
        snap["server"] = {"active_requests": self.aengine.num_active, "steps": self.aengine.num_steps}
        return {"keys": [short_key(k) for k in keys], "stats": snap, "metrics": self._metrics()}

    def _metrics(self) -> str:
        from llmserve_prometheus import find_sink

        sink = find_sink(self.engine)
        return sink.render().decode() if sink is not None else ""

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped is replaced."""
        if not self.aengine.running:
            raise RuntimeError(f"the engine is not running: {self.aengine.dead}")

    def __del__(self):
        a = getattr(self, "aengine", None)
        if a is not None and a.running:
            a.stop_nowait()  # no event loop to await shutdown on: stop the thread, which aborts what is left
