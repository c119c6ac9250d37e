"""Default plugin: POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

Claude-style clients (the anthropic SDK, agents that read ANTHROPIC_BASE_URL) talk to the served model through the
chat machinery: the chat template, the sampling defaults, the tool and reasoning parsers, structured output and stop
sequences are /v1/chat/completions'. Errors on these paths are Anthropic's shape. See docs/messages.md.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_routes(register, model):
    """Serve POST /v1/messages and /v1/messages/count_tokens, with Anthropic-shaped errors (and /openapi.json)."""
    from llmserve_anthropic.errors import error_body
    from llmserve_anthropic.route import count_tokens, messages, openapi

    docs = openapi()
    register("/v1/messages", messages, methods=("POST",), openapi=docs["/v1/messages"], errors=error_body)
    register("/v1/messages/count_tokens", count_tokens, methods=("POST",), openapi=docs["/v1/messages/count_tokens"])
