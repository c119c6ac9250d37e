"""Default plugin: POST /v1/embeddings (OpenAI's embeddings API) for the served model.

Every input is one engine sequence with pooling (llmserve/pooling.py): it is prefilled in the same steps as the
generations running beside it and ends with a pooled, normalized vector instead of a token. Any model the backend
can pool answers it, as Ollama's do; `server.embeddings: false` registers no route (404). docs/embeddings.md.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_routes(register, model):
    """Serve POST /v1/embeddings (and describe it in /openapi.json), unless server.embeddings is false."""
    if not model.config.server.embeddings:
        return
    from llmserve_embeddings.route import embeddings, openapi

    register("/v1/embeddings", embeddings, methods=("POST",), openapi=openapi())
