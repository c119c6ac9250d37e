"""POST /v1/generate: its body, its answer and its OpenAPI description."""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from llmserve.limits import check_request
from llmserve.request import SamplingParams
from llmserve.server.answer import Answer
from llmserve.server.errors import bad_request
from llmserve.server.protocol import GenerationRequest, Int, plugin_openapi
from llmserve.server.routes import admit, encode
from llmserve.server.state import ServerState


class GenerateRequest(GenerationRequest):
    """A /v1/generate body: one prompt (text or token ids), max_new_tokens, and /v1/completions' sampling fields."""

    prompt: Annotated[str | list[int], Field(union_mode="left_to_right")]
    max_new_tokens: Int = 16
    add_special_tokens: bool = True

    def sampling(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of this body: one sequence, not streamed, its length in max_new_tokens."""
        if "max_tokens" in self.model_fields_set:
            raise bad_request("max_tokens is /v1/completions' name here: use max_new_tokens", "max_tokens")
        if self.stream:
            raise bad_request("/v1/generate answers in one body; stream with /v1/completions", "stream")
        if self.n != 1:
            raise bad_request("/v1/generate makes one sequence (n = 1); several come from /v1/completions", "n")
        if not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if self.max_new_tokens < 1:
            raise bad_request("max_new_tokens must be at least 1", "max_new_tokens")
        return self._sampling(self.max_new_tokens, None, renamed={"max_tokens": "max_new_tokens"}, defaults=defaults)


class GenerateAnswer(Answer):
    """The whole answer as text, token ids, counts and timings (no choices)."""

    prefix = "gen"

    def __init__(self, st: ServerState, req: GenerateRequest, sp: SamplingParams, ids: list[int], started: float):
        super().__init__(st, req, sp, [ids])
        self.started = started
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None

    def _new_lp(self):
        return None

    def _fold(self, batch):
        for o in batch[1]:
            if o.new_token_ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.token_ids += o.new_token_ids
        return super()._fold(batch)

    def body(self) -> dict[str, Any]:
        """text, token_ids, finish_reason (stop_reason), the counts and the timings in seconds."""
        ch, now = self.choices[0], time.perf_counter()
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        decode = now - self.first_token_at if self.first_token_at is not None else None
        n = len(self.token_ids)
        return {
            "id": self.id, "model": self.st.model_name, "text": "".join(ch.text), "token_ids": self.token_ids,
            "finish_reason": ch.finish, "stop_reason": ch.stop_reason, "prompt_tokens": len(self.prompts[0]),
            "generated_tokens": n, "cached_prompt_tokens": ch.num_cached,
            "timings": {"total_s": now - self.started, "first_token_s": ttft,
                        # tokens after the first, over the time after it
                        "decode_tokens_per_s": (n - 1) / decode if decode and n > 1 else None},
        }


async def generate(request: Request) -> Response:
    """POST /v1/generate."""
    started = time.perf_counter()
    st, client, req, sp = await admit(request, GenerateRequest)
    m = st.model
    tok = m.tokenizer
    if isinstance(req.prompt, str):
        if tok is None:
            raise bad_request("this server has no tokenizer: send the prompt as token ids", "prompt")
        ids = await encode(tok, req.prompt, req.add_special_tokens)
    else:
        ids = req.prompt
    ids = req.truncated(ids, m.max_model_len, sp.max_tokens)
    check_request(ids, sp, m.vocab_size, m.max_model_len, "prompt")
    return await GenerateAnswer(st, req, sp, ids, started).respond(request, client)


@functools.cache
def openapi() -> dict[str, Any]:
    """/v1/generate's OpenAPI path item and the schemas it refers to (from the body's model)."""
    return plugin_openapi(GenerateRequest, "Generate text from one prompt (a plain JSON body, no SDK needed)",
                          "text, token_ids, finish_reason, stop_reason, prompt_tokens, generated_tokens, "
                          "cached_prompt_tokens, timings {total_s, first_token_s, decode_tokens_per_s}")
