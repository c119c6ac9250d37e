"""vLLM's /tokenize and /detokenize, and /version."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import llmserve
from llmserve.server.errors import bad_request
from llmserve.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest, validate
from llmserve.server.answer import dumps
from llmserve.server.routes import BIG_TEXT, chat_prompt_ids, encode, off_loop_if
from llmserve.server.state import ServerState


def _tokenizer(st: ServerState, param: str):
    if st.model.tokenizer is None:
        raise bad_request("this server has no tokenizer (tokenizer.name: none)", param)
    return st.model.tokenizer


async def tokenize(request: Request) -> Response:
    """POST /tokenize: {"prompt"} or chat {"messages", …} → {"count", "max_model_len", "tokens", "token_strs"}."""
    st: ServerState = request.app.state.llm
    st.admit()
    raw = await request.body()
    try:
        chat = "messages" in json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        chat = False  # not a JSON object (or nested past the parser's limit): validate says so
    req = validate(TokenizeChatRequest if chat else TokenizeRequest, raw, request.url.path)
    st.check_model(req.model)
    tok = _tokenizer(st, "messages" if chat else "prompt")
    ids = await chat_prompt_ids(st, req) if chat else await encode(tok, req.prompt, req.add_special_tokens)
    strs = await off_loop_if(len(ids) >= BIG_TEXT, _strs, tok, ids) if req.return_token_strs else None
    body = {"count": len(ids), "max_model_len": st.model.max_model_len, "tokens": ids, "token_strs": strs}
    return Response(await off_loop_if(len(ids) >= BIG_TEXT, dumps, body), media_type="application/json")


def _strs(tok, ids: list[int]) -> list[str]:
    """Each token's text (a long prompt's are made in a worker thread: a 4 MB one took ~2 s)."""
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


async def detokenize(request: Request) -> Response:
    """POST /detokenize: {"tokens": [ids]} → {"prompt": text} (special tokens kept)."""
    st: ServerState = request.app.state.llm
    st.admit()
    req = validate(DetokenizeRequest, await request.body(), request.url.path)
    st.check_model(req.model)
    tok = _tokenizer(st, "tokens")
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} in tokens is outside the vocabulary [0, {tok.vocab_size})", "tokens")
    text = await off_loop_if(len(req.tokens) >= BIG_TEXT, tok.decode, req.tokens, False)
    return JSONResponse({"prompt": text})


async def version(request: Request) -> Response:
    """GET /version."""
    return JSONResponse({"version": llmserve.__version__})
