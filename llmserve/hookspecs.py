"""The hooks plugins implement, grouped by phase.

Every hook is a registration hook called once at start-up: it hands the core a name and a
factory, and the core calls the built object directly afterwards. None is firstresult: every
implementation is called and may register any number of components.
"""

from __future__ import annotations

import pluggy

PROJECT = "llmserve"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- engine components ----------------------------------------------------------------------


@hookspec
def register_backends(register):
    """Register model backends: ``register(name, factory)``, ``factory(config) -> ModelBackend``."""


@hookspec
def register_schedulers(register):
    """Register scheduler policies: ``register(name, factory)``, ``factory(config, allocator) -> Scheduler``."""


@hookspec
def register_cache_allocators(register):
    """Register KV-cache allocators: ``register(name, factory)``, ``factory(config, num_blocks) -> CacheAllocator``."""


@hookspec
def register_tokenizers(register):
    """Register tokenizers: ``register(name, factory)``, ``factory(config) -> Tokenizer``."""


@hookspec
def register_metric_sinks(register):
    """Register metric sinks: ``register(name, factory)``, ``factory(config, options) -> MetricSink``."""


@hookspec
def register_structured_output(register):
    """Register grammar engines: ``register(name, factory)``, ``factory(config, tokenizer, vocab_size) -> GrammarEngine``."""


# --- scale-out ------------------------------------------------------------------------------


@hookspec
def register_routers(register):
    """Register replica routers: ``register(name, factory)``, ``factory(options) -> Router`` (llmserve.interfaces)."""


@hookspec
def register_launchers(register):
    """Register ways to serve several replicas: ``register(name, factory)``, ``factory(config) -> exit status``."""


# --- server and command line ------------------------------------------------------------------


@hookspec
def register_routes(register, model, client):
    """Add HTTP routes: ``register(path, endpoint, methods=("GET",), openapi=None, errors=None)`` with a starlette
    endpoint; ``openapi={"path": <OpenAPI path item>, "schemas": <component schemas it refers to>}`` lists it in
    /openapi.json; ``errors(ApiError) -> dict`` writes the error bodies of it and the paths below it. ``model`` is
    the ServingModel, ``client`` the EngineClient (an endpoint reads both from ``request.app.state.llm``)."""


@hookspec
def register_tool_parsers(register):
    """Register tool-call parsers: ``register(name, factory)``, ``factory(tokenizer, tools) -> ToolParser``."""


@hookspec
def register_reasoning_parsers(register):
    """Register reasoning parsers: ``register(name, factory)``, ``factory(tokenizer, prompt) -> ReasoningParser``."""


@hookspec
def register_response_stores(register):
    """Register stores of POST /v1/responses' answers: ``register(name, factory)``, ``factory(config, options) ->
    ResponseStore``."""


@hookspec
def register_commands(subparsers):
    """Add ``llmserve`` subcommands to the argparse ``subparsers``; set ``func=callable(args)`` as default."""
