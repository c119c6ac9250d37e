"""POST /v1/embeddings: its body, its answer and its OpenAPI description."""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from llmserve.limits import check_prompt
from llmserve.request import PoolingParams, RequestOutput, SamplingParams
from llmserve.server.answer import dumps
from llmserve.server.errors import bad_request, map_error
from llmserve.server.generation import GONE, Generation, until_answered
from llmserve.server.protocol import Int, plugin_openapi
from llmserve.server.routes import admit_body, check_fan_out, encode

_NO_SAMPLING = SamplingParams(max_tokens=None)  # an embedding samples nothing (what the limits check reads)
# inputs in one request: OpenAI's limit (LangChain's OpenAIEmbeddings sends 1000 a request); they go to the engine in
# waves of server.max_prompts_per_request, so the queue never holds more of one request than a completions body can
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """An /v1/embeddings body (OpenAI's fields, and vLLM's truncate_prompt_tokens, normalize, add_special_tokens)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    # tried in this order (as /v1/completions' prompt): a text, texts, token ids, lists of token ids
    input: Annotated[str | list[str] | list[int] | list[list[int]], Field(union_mode="left_to_right")]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: Int | None = None  # cut each vector to its first `dimensions` (Matryoshka models only)
    user: str | None = None  # accepted, as OpenAI's; it changes nothing here
    truncate_prompt_tokens: Int | None = None  # keep each input's last k tokens (-1: as many as the context holds)
    normalize: bool | None = None  # None: true (unit length)
    add_special_tokens: bool | None = None  # None: true (the tokenizer's [CLS]/[SEP] or BOS, as the model was trained)
    priority: Int | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a string or a list of token ids."""
        x = self.input
        return [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)

    def pooling(self) -> PoolingParams:
        """The pooling every input gets (its kind the model's)."""
        if self.dimensions is not None and self.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1, got {self.dimensions}", "dimensions")
        return PoolingParams(normalize=self.normalize is not False, dimensions=self.dimensions)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """An input after truncate_prompt_tokens: its last k ids (-1: the context length)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if not 1 <= k <= max_model_len:
            raise bad_request(f"truncate_prompt_tokens must be -1 or between 1 and the context length "
                              f"({max_model_len}), got {k}", "truncate_prompt_tokens")
        return ids[-k:]


async def _input_ids(st, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated as asked and checked against the vocabulary and the context (a 400
    naming input[i] before anything is submitted)."""
    tok, m = st.model.tokenizer, st.model
    inputs = req.inputs
    if not inputs:
        raise bad_request("input must not be an empty list", "input")
    out = []
    for i, x in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(x, str):
            if tok is None:
                raise bad_request("this server has no tokenizer: send the input as token ids", param)
            if not x:
                raise bad_request(f"{param} must not be an empty string", param)
            ids = await encode(tok, x, req.add_special_tokens is not False)
        else:
            ids = x
        ids = req.truncated(ids, m.max_model_len)
        check_prompt(ids, _NO_SAMPLING, m.vocab_size, m.max_model_len, param, generates=False)
        out.append(ids)
    return out


def _vector(values: list[float], fmt: str | None) -> list[float] | str:
    """A vector as OpenAI sends it: float32 values as JSON numbers, or their little-endian bytes in base64."""
    packed = struct.pack(f"<{len(values)}f", *values)
    if fmt == "base64":
        return base64.b64encode(packed).decode()
    return list(struct.unpack(f"<{len(values)}f", packed))  # the float32 values base64 would carry, exactly


async def _collect(gen: Generation, n: int) -> list[RequestOutput]:
    """Each input's finished output, in input order."""
    done: list[RequestOutput | None] = [None] * n
    while (batch := await gen.next()) is not None:
        i, outs = batch
        for o in outs:
            if o.finished:
                done[i] = o
    return done


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    st, client, req = await admit_body(request, EmbeddingRequest)
    if len(req.inputs) > MAX_INPUTS:
        raise bad_request(f"{len(req.inputs)} inputs in one request; the limit is {MAX_INPUTS}", "input")
    wave = st.config.server.max_prompts_per_request
    check_fan_out(st, min(len(req.inputs), wave), 1, "input")
    pooling = st.model.check_pooling(req.pooling())  # (the engine's rule: 400 naming dimensions)
    prompts = await _input_ids(st, req)
    rid, outs, started = f"embd-{uuid.uuid4().hex}", [], asyncio.get_running_loop().time()
    for start in range(0, len(prompts), wave):
        part = prompts[start:start + wave]
        if start:
            st.check_room(len(part))  # (the first wave's room: check_fan_out's)
        gen = Generation(client, part, _NO_SAMPLING, req.priority or 0, st.config.server.request_timeout,
                         f"{rid}-{start}" if start else rid, pooling=pooling, started=started)  # one deadline
        got = await until_answered(request.receive, gen, _collect(gen, len(part)))
        if got is GONE:
            return Response(status_code=499)
        outs += got
    data = []
    for i, o in enumerate(outs):
        if o is None or o.embedding is None:  # ended without a vector (aborted by the server): say so, never 200
            raise map_error(RuntimeError(f"input {i} ended without an embedding"))
        data.append({"object": "embedding", "index": i, "embedding": _vector(o.embedding, req.encoding_format)})
    tokens = sum(map(len, prompts))
    body = {"object": "list", "data": data, "model": st.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Response(dumps(body), media_type="application/json")


@functools.cache
def openapi() -> dict[str, Any]:
    """/v1/embeddings' OpenAPI path item and the schemas it refers to (from the body's model)."""
    return plugin_openapi(EmbeddingRequest, "Create embeddings of texts or token ids",
                          "{object: list, data: [{object: embedding, index, embedding}], model, "
                          "usage: {prompt_tokens, total_tokens}}")
