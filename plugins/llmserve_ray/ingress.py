"""The ingress deployment: the server's own starlette app over FleetEngine, plus the fleet's /metrics."""

from __future__ import annotations

from starlette.responses import Response
from starlette.routing import Route

from llmserve.config import config_from_dict
from llmserve.plugins import load_plugins
from llmserve.server.app import create_app
from llmserve.serving_model import ServingModel
from llmserve_ray.fleet import FleetEngine
from llmserve_ray.metrics import merge_replica_metrics


class Ingress:
    """Builds the OpenAI app (llmserve.server.app.create_app) over the replicas' DeploymentHandle."""

    async def __init__(self, config: dict, replicas):
        from llmserve_ray.fleet import REPLICAS, ROUTERS

        self.config = config_from_dict(config)
        info = await replicas.describe.remote()  # also starts this process's router for the replicas
        model = ServingModel.from_facts(self.config, load_plugins(), info)
        self.fleet = FleetEngine(model, replicas, lambda: ROUTERS.get(REPLICAS))

    def __serve_build_asgi_app__(self):
        app = create_app(self.config, self.fleet)
        fleet = self.fleet

        async def metrics(request):
            """GET /metrics: every replica's metrics (as last reported) with a replica label, and the router's."""
            router = fleet.router_state()
            text = merge_replica_metrics({r: rep["metrics"] for r, rep in fleet.reports().items() if rep.get("metrics")})
            if router is not None:
                text += ("# HELP llmserve_router_requests_total Requests the router placed.\n"
                         "# TYPE llmserve_router_requests_total counter\n"
                         f"llmserve_router_requests_total {router.routed_requests}\n"
                         "# HELP llmserve_router_seconds_total Time spent choosing replicas.\n"
                         "# TYPE llmserve_router_seconds_total counter\n"
                         f"llmserve_router_seconds_total {router.routing_seconds}\n")
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        # taken before the plugins' register_routes runs, so the Prometheus plugin's single-engine /metrics steps aside
        app.router.routes.append(Route("/metrics", metrics, methods=["GET"]))
        self.state = app.state.llm  # (`app` is a property of Serve's ASGI wrapper)
        self.state.owned_paths.add("/metrics")
        return app

    async def drain(self, timeout: float) -> bool:
        """SIGTERM: admit no more requests (503) and wait up to timeout for those in flight; False if some were left."""
        self.state.begin_drain()
        return await self.fleet.wait_idle(timeout)
