"""Default plugin: scale-out on Ray Serve (`llmserve serve --replicas N`) and the replica routers.

Routers are plain objects (llmserve.interfaces.Router) that rank replicas from a request's leading
block keys and the replicas' loads; the Ray Serve adapter (serve_router.py) and the `bench router`
simulation call the same ones. Nothing here imports Ray until a launcher runs: `llmserve serve`
without --replicas never loads it.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_routers(register):
    """Register the "round-robin", "power-of-two" and "prefix-aware" routers."""
    from llmserve_ray import routers

    register("round-robin", routers.RoundRobin)
    register("power-of-two", routers.PowerOfTwo)
    register("prefix-aware", routers.PrefixAware)


@hookimpl
def register_launchers(register):
    """Register "ray": the engine replicas as a Ray Serve deployment behind one OpenAI ingress."""

    def launch(config) -> int:
        from llmserve_ray.launch import serve_fleet

        return serve_fleet(config)

    register("ray", launch)
