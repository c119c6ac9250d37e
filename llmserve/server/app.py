"""The starlette app factory: routes, middleware, lifespan (engine start, drain, stop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from llmserve.async_engine import AsyncEngine
from llmserve.config import EngineConfig
from llmserve.engine import Engine
from llmserve.engine_client import EngineClient
from llmserve.server import routes, tokenize, tools
from llmserve.server.errors import EXCEPTION_HANDLERS
from llmserve.server.middleware import ApiKeyMiddleware, RequestIdMiddleware, RequestLogMiddleware, SizeLimitMiddleware
from llmserve.server.state import ServerState

log = logging.getLogger("llmserve.server")


def create_app(config: EngineConfig, engine=None) -> Starlette:
    """The HTTP app. engine: None (built from config on the engine thread at start-up; /health says 503
    meanwhile), an EngineClient (what `serve` passes: an AsyncEngine, a ProcessEngine; a test's own), or a built
    Engine (tests)."""
    if engine is None:
        engine = functools.partial(Engine.from_config, config)
    client: EngineClient = AsyncEngine(engine) if callable(engine) or isinstance(engine, Engine) else engine
    st = ServerState(config=config, client=client)

    base = [
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/models", routes.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes.get_model, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/stats", routes.stats, methods=["GET"]),
        Route("/openapi.json", routes.openapi_json, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/version", tokenize.version, methods=["GET"]),
    ]

    async def attach_when_built(app: Starlette) -> None:
        try:
            model = await asyncio.wrap_future(client.serving)
            tools.check(model, config.server)
        except Exception as e:  # reported by /health and the log; the server stays up to say so
            log.error("the engine failed to start: %s: %s", type(e).__name__, e)
            st.load_error = f"{type(e).__name__}: {e}"
            return
        taken = {r.path for r in app.router.routes if isinstance(r, Route)}

        def register(path: str, endpoint, methods=("GET",), openapi: dict | None = None, errors=None) -> None:
            # the register_routes hook's callback; openapi: {"path": path item, "schemas": components} for
            # /openapi.json; errors: ApiError → the error body of the route's API, for it and the paths below it
            if path in taken:
                if path not in st.owned_paths:
                    log.warning("a plugin route %s clashes with an existing route; skipped", path)
                return
            app.router.routes.append(Route(path, endpoint, methods=list(methods)))
            if openapi is not None:
                st.openapi_paths[path] = {"path": openapi["path"], "schemas": openapi.get("schemas", {})}
            if errors is not None:
                st.error_bodies[path] = errors

        model.plugins.pm.hook.register_routes(register=register, model=model, client=client)
        st.model = model
        st.ready = True

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        client.start(asyncio.get_running_loop())
        attaching = asyncio.ensure_future(attach_when_built(app))
        if not callable(engine) or client.serving.done():
            await attaching  # a built engine serves from the first request
        try:
            yield
        finally:
            st.begin_drain()
            attaching.cancel()
            await client.shutdown(config.server.drain_timeout)

    # outermost, so a 401 or 413 has its id, and the line its status and latency, too
    middleware = [Middleware(RequestIdMiddleware)]
    if config.server.log_requests:
        middleware.append(Middleware(RequestLogMiddleware))
    if config.server.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.server.cors_origins),
                                     allow_methods=["*"], allow_headers=["*"], allow_credentials=False))
    middleware.append(Middleware(SizeLimitMiddleware, max_bytes=config.server.max_body_bytes,
                                 max_header_bytes=config.server.max_header_bytes))
    key = config.server.api_key or os.environ.get("LLMSERVE_API_KEY")  # what /v1/* requires, if any
    if key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=key))

    app = Starlette(routes=base, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.llm = st
    return app
