"""Errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}, the type named by the status."""

from __future__ import annotations

from typing import Any

from llmserve.server.errors import ApiError

# status → Anthropic's error type (another 4xx: invalid_request_error; another 5xx: api_error)
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error", 504: "timeout_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    """err as Anthropic's error body (the message names the field where OpenAI's `param` would)."""
    kind = _TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    named = not err.param or err.param in err.message
    return {"type": "error", "error": {"type": kind, "message": err.message if named else f"{err.param}: {err.message}"}}
