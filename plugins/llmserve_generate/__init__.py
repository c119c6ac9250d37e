"""Default plugin: POST /v1/generate, a plain JSON endpoint for scripts and load tools.

`{"prompt": "...", "max_new_tokens": 32, "temperature": 0.7}` → the generated text, its token ids, the token counts
and the timings, in one JSON body: no SDK, no choices array, no stream. The sampling fields are /v1/completions'
(checked by the same rules, with the model's defaults for those left out); errors are OpenAI's error shape.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_routes(register, model):
    """Serve POST /v1/generate (and describe it in /openapi.json)."""
    from llmserve_generate.route import generate, openapi

    register("/v1/generate", generate, methods=("POST",), openapi=openapi())
