"""Default plugin: POST /v1/responses, OpenAI's Responses API, served by the chat machinery (docs/responses.md).

Input items become chat messages; the chat template, sampling defaults, tool and reasoning parsers and structured
output do the rest; the answer comes back as output items, or as the typed events of the Responses stream. Answers
sent with store true are kept by the response store that server.response_store names (this plugin's `memory`, or a
plugin's) for previous_response_id and GET/DELETE /v1/responses/{id}.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_routes(register, model):
    """Serve /v1/responses over the store server.response_store names (and describe it in /openapi.json)."""
    from llmserve_responses.route import Responses, openapi

    server = model.config.server
    store = model.plugins.get("response_store", server.response_store).factory(model.config,
                                                                                 server.response_store_options)
    api = Responses(store)
    register("/v1/responses", api.create, methods=("POST",), openapi=openapi())
    register("/v1/responses/{response_id}", api.stored, methods=("GET", "DELETE"))
    register("/v1/responses/{response_id}/input_items", api.input_items, methods=("GET",))


@hookimpl
def register_response_stores(register):
    """Register the memory store (the default): least recently used out past max_responses or max_bytes."""
    from llmserve_responses.memory import MemoryStore

    register("memory", MemoryStore.from_options)
