"""The OpenAI-compatible HTTP server: `create_app(config, engine=None)` and `serve(config) -> int`."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    # imported on first use: the app imports the engine and torch, and `llmserve serve` binds its port before that
    if name == "create_app":
        from llmserve.server.app import create_app

        return create_app
    if name == "serve":
        from llmserve.server.run import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
