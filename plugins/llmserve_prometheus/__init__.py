"""Default plugin: a Prometheus metric sink ("prometheus") and the GET /metrics route.

Each sink owns its own CollectorRegistry (never the process-global one), so two engines in
one process — or one per test — never collide on metric names.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _build(config, options):
    from llmserve.config import check_options
    from llmserve_prometheus.sink import PrometheusSink

    o = check_options(options, {"model_name": None}, "metrics.sinks[prometheus].options")
    return PrometheusSink(model_name=o["model_name"] or config.served_model_name)


def find_sink(engine):
    """The PrometheusSink among the metric sinks of `engine` (an Engine or an EngineClient), or None."""
    from llmserve_prometheus.sink import PrometheusSink

    return next((s for s in engine.metric_sinks if isinstance(s, PrometheusSink)), None)


@hookimpl
def register_metric_sinks(register):
    """Register the Prometheus sink as "prometheus"."""
    register("prometheus", _build)


@hookimpl
def register_routes(register, model, client):
    """Serve GET /metrics: the engine's registry (a sink added if its config has none), the server's connections."""
    from starlette.responses import Response

    from llmserve_prometheus.sink import CONTENT_TYPE, PrometheusSink, render_connections

    sink = find_sink(client)
    if sink is None:  # the one place that gives a server its Prometheus metrics
        sink = PrometheusSink(model_name=model.config.served_model_name)
        client.add_metric_sink(sink)

    async def metrics(request):
        body = sink.render(max_age=0.1)  # a snapshot: scrapers cost little
        table = request.app.state.llm.connections  # the server's, not the engine's: None without our transport
        if table is not None:
            body += render_connections(table.stats(), sink.model_name)
        return Response(body, media_type=CONTENT_TYPE)

    register("/metrics", metrics, methods=("GET",))
