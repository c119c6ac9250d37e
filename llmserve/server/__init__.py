"""The OpenAI-compatible HTTP server: `create_app(config, engine=None)` and `serve(config) -> int`."""

from llmserve.server.app import create_app
from llmserve.server.run import serve

__all__ = ["create_app", "serve"]
