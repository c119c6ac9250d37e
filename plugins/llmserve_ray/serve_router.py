"""The Ray Serve RequestRouter that runs an llmserve Router (any registered one) on the routing path.

Serve calls choose_replicas for every call on the replicas' handle. A `generate` call is ranked
by the configured Router from the prompt's leading block keys and each replica's load (Serve's
queue-length cache) and held keys (its routing stats, record_routing_stats on the replica). The
ingress also reads each replica's /stats and metrics from those routing stats (fleet.py).
"""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

import llmserve_ray.fleet as fleet_module  # by reference: Serve pickles this module by value
from llmserve.interfaces import ReplicaLoad
from llmserve.plugins import load_plugins
from llmserve_ray.routers import request_keys


class LLMRequestRouter(RequestRouter):
    """Serve's routing hook around an llmserve Router; also times its own work (cost per request)."""

    def initialize_state(self, router: str = "prefix-aware", options: dict | None = None, block_size: int = 16):
        self.policy = load_plugins().get("router", router).factory(dict(options or {}))
        self.block_size = block_size
        self._keys_of: dict[str, list[int]] = {}  # internal request id → its keys, until it is routed
        self._held: dict[str, tuple[int, frozenset[int]]] = {}  # replica → (id of its stats, their keys)
        self.routed_requests = 0
        self.routing_seconds = 0.0
        fleet_module.ROUTERS[self._deployment_id.name] = self  # the ingress reads the fleet from it

    def reports(self) -> dict[str, dict]:
        """Each running replica's latest routing stats (keys, /stats body, metrics), by replica id."""
        return {r.replica_id.unique_id: r.routing_stats or {} for r in self._replicas_list}

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
        cached = self._held.get(rid)
        if cached is None or cached[0] != id(stats):  # a new report: build its key set once
            cached = self._held[rid] = (id(stats), frozenset(stats.get("keys", ())))
        return ReplicaLoad(rid, self.replica_queue_len_cache.get(r.replica_id) or 0, cached[1])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        if pending_request.metadata.call_method != "generate":
            return [candidate_replicas]
        t0 = time.perf_counter()
        ids, salt = pending_request.args[0], pending_request.args[4]  # (ReplicaDeployment.generate's arguments)
        keys = request_keys(ids, self.block_size, salt)
        ranks = self.policy.rank(keys, [self._load(r) for r in candidate_replicas])
        if len(self._keys_of) > 10_000:  # requests cancelled before they were routed leave theirs behind
            self._keys_of.clear()
        self._keys_of[pending_request.metadata.internal_request_id] = keys
        self.routed_requests += 1
        self.routing_seconds += time.perf_counter() - t0
        return [[candidate_replicas[i] for i in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        keys = self._keys_of.pop(pending_request.metadata.internal_request_id, None)
        if keys is not None:
            self.policy.routed(keys, replica_id.unique_id)
