"""ServerState: the engine, readiness and draining, and the admission checks every /v1 request passes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.async_engine import AsyncEngine
from llmserve.config import EngineConfig
from llmserve.server.errors import ApiError, bad_request

log = logging.getLogger("llmserve.server")


@dataclass
class ServerState:
    """What the routes share; one per app."""

    config: EngineConfig
    aengine: AsyncEngine
    engine: Any = None  # llmserve.engine.Engine once built (read-only here: the engine thread owns it)
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def begin_drain(self) -> None:
        """Stop admitting requests (503) and report unhealthy; in-flight requests continue."""
        if not self.draining:
            log.info("draining: new requests get 503, in-flight requests continue")
        self.draining = True

    def admit(self) -> AsyncEngine:
        """503 when not ready or draining, 429 with Retry-After when the waiting queue is full."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="draining", headers={"Retry-After": "5"})
        if not self.ready:
            why = f": {self.load_error}" if self.load_error else " (the model is loading)"
            raise ApiError(503, f"the engine is not ready{why}", code="not_ready", headers={"Retry-After": "5"})
        if not self.aengine.running:
            raise ApiError(503, "the engine has stopped", code="engine_unavailable")
        limit = self.config.server.max_waiting_requests
        waiting = self.aengine.num_waiting
        if waiting >= limit:
            raise ApiError(429, f"too many requests are waiting ({waiting}, limit max_waiting_requests={limit}); "
                                "retry later", code="queue_full", headers={"Retry-After": "1"})
        return self.aengine

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (a missing model means the served one)."""
        if model is None or model in (self.model_name, self.config.model.model):
            return
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                       param="model", code="model_not_found")

    def check_fit(self, num_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
        """400 when the prompt plus max_tokens cannot fit the context, naming both numbers."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                              f"{num_prompt} tokens, which leaves no room for the completion. Please reduce the "
                              "length of the prompt.", prompt_param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                              "completion). Please reduce the prompt or max_tokens.", "max_tokens",
                              code="context_length_exceeded")

    def check_ids(self, ids: list[int], param: str) -> None:
        """400 for a token id outside the vocabulary, or an empty prompt."""
        if not ids:
            raise bad_request(f"{param} is empty: it has no tokens", param)
        vocab = self.engine.backend.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} in {param} is outside the vocabulary [0, {vocab})", param)
