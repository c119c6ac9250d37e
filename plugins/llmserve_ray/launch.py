"""`llmserve serve --replicas N`: the engine replicas and the OpenAI ingress as one Ray Serve application.

build_app(config) makes the application (tests deploy it with serve.run); serve_fleet(config)
starts or joins Ray, runs it on server.host:server.port, and on SIGTERM drains: the ingress answers
503 to new requests and waits up to server.drain_timeout for those in flight, then Serve stops.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from llmserve.config import EngineConfig, check_options
from llmserve.errors import LLMServeError
from llmserve.plugins import load_plugins
from llmserve_ray.fleet import REPLICAS

log = logging.getLogger("llmserve.ray")

APP_NAME = "llmserve"
INGRESS = "Ingress"
_OPTIONS = {"router": {}, "max_ongoing_requests": 256, "stats_period_s": 0.5, "ingress_num_cpus": 0.0,
            "health_check_period_s": 2.0}


def import_ray():
    """Ray and Ray Serve, or an error that says how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise LLMServeError(f"--replicas needs Ray Serve, which is not installed ({e}): "
                            "pip install 'llmserve[ray]'") from None
    return ray, serve


def build_app(config: EngineConfig):
    """The Serve application: distributed.replicas EngineReplica replicas behind one Ingress."""
    _ray, serve = import_ray()
    from ray.serve.config import RequestRouterConfig

    from llmserve_ray.ingress import Ingress
    from llmserve_ray.replica import EngineReplica
    from llmserve_ray.serve_router import LLMRequestRouter

    d = config.distributed
    o = check_options(d.options, _OPTIONS, "distributed.options")
    load_plugins().get("router", d.router)  # a misspelled router fails here, listing the registered ones
    data = config.to_dict()
    routing = RequestRouterConfig(
        request_router_class=LLMRequestRouter,
        request_router_kwargs={"router": d.router, "options": o["router"], "block_size": config.cache.block_size},
        request_routing_stats_period_s=o["stats_period_s"], request_routing_stats_timeout_s=5.0)
    replicas = serve.deployment(
        EngineReplica, name=REPLICAS, num_replicas=d.replicas, max_ongoing_requests=o["max_ongoing_requests"],
        ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus},
        graceful_shutdown_timeout_s=config.server.drain_timeout, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=o["health_check_period_s"], request_router_config=routing)
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS,
                               max_ongoing_requests=config.server.max_waiting_requests,
                               ray_actor_options={"num_cpus": o["ingress_num_cpus"]},
                               graceful_shutdown_timeout_s=config.server.drain_timeout)
    return ingress.bind(data, replicas.bind(data))


def serve_fleet(config: EngineConfig) -> int:
    """Start (or join) Ray, serve the fleet on server.host:server.port until SIGTERM/SIGINT; 0 after draining."""
    ray, serve = import_ray()
    d, sc = config.distributed, config.server
    ray.init(address=d.ray_address, namespace=APP_NAME, log_to_driver=sc.log_level == "debug")
    serve.start(http_options={"host": sc.host, "port": sc.port})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        log.info("serving %s on http://%s:%d with %d replicas (router %s)", config.served_model_name, sc.host,
                 sc.port, d.replicas, d.router)
        stop.wait()
        log.info("draining: new requests get 503; waiting up to %gs for those in flight", sc.drain_timeout)
        # Serve's own shutdown would close the proxy's open streams at once: drain through the ingress first
        ingress = serve.get_deployment_handle(INGRESS, app_name=APP_NAME)
        if not ingress.drain.remote(sc.drain_timeout).result(timeout_s=sc.drain_timeout + 10):
            log.warning("requests still in flight after %gs; stopping anyway", sc.drain_timeout)
    finally:
        serve.shutdown()  # then every replica stops (each waits for what it still runs)
        ray.shutdown()
    return 0
