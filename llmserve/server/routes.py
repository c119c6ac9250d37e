"""The OpenAI endpoints (/v1/completions, /v1/chat/completions, /v1/models) and /health, /stats."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve.engine_client import EngineClient
from llmserve.errors import InvalidRequestError
from llmserve.limits import check_request
from llmserve.request import MAX_BAD_WORDS, SamplingParams
from llmserve.server.answer import ChatAnswer, CompletionAnswer, dumps
from llmserve.server.errors import ApiError, bad_request, map_error
from llmserve.server.protocol import ChatRequest, CompletionRequest, openapi, parse, sampling_defaults, validate
from llmserve.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.llm


async def admit(request: Request, model) -> tuple[ServerState, EngineClient, Any, SamplingParams]:
    """The shared start of a generation endpoint (a route plugin's too), each step once: admission, body,
    validation, model name."""
    st = _state(request)
    client = st.admit()
    body = await request.body()  # within the limits SizeLimitMiddleware enforces while this reads
    # validating long token-id lists costs ~20 ms per MB: a big body is parsed off the event loop
    req, sp = await off_loop_if(len(body) > _BIG_BODY, parse, model, body, request.url.path,
                                 st.model.generation_defaults)
    st.check_model(req.model)
    prompts = len(req.prompts) if isinstance(req, CompletionRequest) else 1
    check_fan_out(st, prompts, sp.n)
    if sp.logprobs is not None and not req.stream:
        check_logprob_entries(prompts * sp.n * (sp.max_tokens or st.model.max_model_len) * (1 + sp.logprobs))
    if req.bad_words:
        sp.bad_words_token_ids = _bad_words(st.model.tokenizer, req.bad_words)
    if sp.structured is not None or sp.allowed_token_ids is not None:
        # compiled off the event loop (a large schema takes a while), cached for the engine's own check; a bad one
        # named in the body's own fields (a route plugin's body served as a chat body says how: its renamed())
        try:
            await asyncio.to_thread(st.model.constraints.check, sp)
        except InvalidRequestError as e:
            rename = getattr(req, "renamed", None)
            raise (rename(map_error(e)) if rename else e) from None
    return st, client, req, sp


async def admit_body(request: Request, model) -> tuple[ServerState, EngineClient, Any]:
    """The start of an endpoint that generates nothing (a route plugin's embeddings, say): admission, the body
    validated into `model` (a big one off the event loop), its model name."""
    st = _state(request)
    client = st.admit()
    body = await request.body()
    req = await off_loop_if(len(body) > _BIG_BODY, validate, model, body, request.url.path)
    st.check_model(req.model)
    return st, client, req


def check_fan_out(st: ServerState, prompts: int, n: int, param: str = "prompt") -> None:
    """Bounded work per request: prompts (the body's field `param`) and prompts × n within the server's caps, and
    room in the queue for them."""
    cfg = st.config.server
    if prompts > cfg.max_prompts_per_request:
        raise bad_request(f"{prompts} prompts in one request; the limit is max_prompts_per_request="
                          f"{cfg.max_prompts_per_request}", param)
    limit = min(cfg.max_sequences_per_request, cfg.max_waiting_requests)  # more could never be admitted
    if prompts * n > limit:
        raise bad_request(f"{prompts} prompts × n={n} is {prompts * n} sequences; the limit is {limit} "
                          "(server.max_sequences_per_request, server.max_waiting_requests)", "n")
    st.check_room(prompts * n)


# logprob entries (tokens × (1 + top logprobs)) an answer that is not streamed may hold: n = 128 choices of 4000
# tokens with 20 alternatives each made a 660 MB body and held 5 GB while it was built
MAX_LOGPROB_ENTRIES = 1 << 21


def check_logprob_entries(entries: int) -> None:
    """A 400 naming logprobs when a whole answer could hold more than MAX_LOGPROB_ENTRIES (streamed, none piles up)."""
    if entries > MAX_LOGPROB_ENTRIES:
        raise bad_request(f"this answer could hold {entries} logprob entries (prompts × n × max_tokens × (1 + "
                          f"logprobs)); the limit is {MAX_LOGPROB_ENTRIES}: stream it, or ask for fewer", "logprobs")


def _bad_words(tok, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (vLLM's rule: both spellings are banned)."""
    if tok is None:
        raise bad_request("bad_words needs a tokenizer and this server has none", "bad_words")
    if len(words) > MAX_BAD_WORDS:  # (before tokenizing them all on the event loop)
        raise bad_request(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}", "bad_words")
    seqs = {tuple(tok.encode(p + w, add_special_tokens=False)) for w in words for p in ("", " ") if w.strip()}
    return [list(s) for s in seqs if s]


BIG_TEXT = 16_384  # characters (or tokens); longer texts are tokenized (detokenized) off the event loop
_BIG_BODY = 64 * 1024  # bytes; larger bodies are parsed off the event loop


async def off_loop_if(big: bool, fn, *args):
    """fn(*args), in a worker thread when the input is big, so streams keep flowing meanwhile."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


async def encode(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of text; a long text is tokenized in a worker thread."""
    return await off_loop_if(len(text) >= BIG_TEXT, tok.encode, text, add_special_tokens)


# --- /v1/completions --------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    st, client, req, sp = await admit(request, CompletionRequest)
    m = st.model
    tok = m.tokenizer
    prompt_ids: list[list[int]] = []
    prompt_texts: list[str] = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if tok is None:
                raise bad_request("this server has no tokenizer: send the prompt as token ids", "prompt")
            full, text = await encode(tok, p, req.add_special_tokens), p
        else:  # token ids: echo shows them decoded
            full, text = p, None
        ids = req.truncated(full, m.max_model_len, sp.max_tokens)
        check_request(ids, sp, m.vocab_size, m.max_model_len, param)
        if len(ids) < len(full) or text is None:  # echo shows the ids the model was given
            text = tok.decode(ids, skip_special_tokens=False) if (tok is not None and req.echo) else ""
        prompt_ids.append(ids)
        prompt_texts.append(text)
    return await CompletionAnswer(st, req, sp, prompt_ids, prompt_texts).respond(request, client)


# --- /v1/chat/completions ---------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    st, client, req, sp = await admit(request, ChatRequest)
    ids, prompt = await chat_ids(st, req, sp)
    return await ChatAnswer(st, req, sp, [ids], prompt).respond(request, client)


async def chat_ids(st: ServerState, req: ChatRequest, sp: SamplingParams) -> tuple[list[int], str]:
    """The prompt's token ids and text: the messages rendered, tokenized, truncated and checked against the context
    (a route plugin's chat body too); a max_tokens left out becomes the model's default, within the room left."""
    prompt, m = chat_prompt(st, req), st.model
    ids = req.truncated(await encode(m.tokenizer, prompt, req.add_special_tokens), m.max_model_len, sp.max_tokens)
    check_request(ids, sp, m.vocab_size, m.max_model_len, "messages")
    # the model's default max_tokens, within the room the prompt leaves, where the client gave none
    given = {} if sp.max_tokens is None else {"max_tokens": sp.max_tokens}
    sp.max_tokens = m.defaults(given, ("max_tokens",), room=m.max_model_len - len(ids)).get("max_tokens")
    return ids, prompt


async def chat_prompt_ids(st: ServerState, req: ChatRequest) -> list[int]:
    """The token ids of the chat messages rendered by the tokenizer's chat template."""
    return await encode(st.model.tokenizer, chat_prompt(st, req), req.add_special_tokens)


# the request fields chat_prompt hands the renderer by name (Tokenizer.apply_chat_template's own arguments)
_RENDER_FIELDS = frozenset({"messages", "add_generation_prompt", "tools", "continue_final_message"})


def chat_prompt(st: ServerState, req: ChatRequest) -> str:
    """The chat messages (and tools) rendered by the tokenizer's chat template."""
    tok = st.model.tokenizer
    if tok is None:
        raise bad_request("this server has no tokenizer, so it cannot render chat messages; "
                          "use /v1/completions with token ids", "messages")
    extra = req.chat_template_kwargs or {}
    for k in extra.keys() & _RENDER_FIELDS:  # (passed on, a second value for one argument: a TypeError, a 500)
        raise bad_request(f"chat_template_kwargs may not set {k!r} (an argument of the renderer; use the request "
                          "field)", f"chat_template_kwargs.{k}")
    try:
        return tok.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                       tools=req.template_tools(), continue_final_message=req.continue_final_message,
                                       **extra)
    except NotImplementedError as e:
        raise bad_request(str(e), "messages") from None


# --- models, health, stats --------------------------------------------------------------------


def _model_card(st: ServerState) -> dict:
    m = st.model
    card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "llmserve",
            "root": st.config.model.model, "parent": None, "max_model_len": m.max_model_len if m is not None else None}
    if m is not None:  # what a request that leaves them out samples with, and who said so (llmserve's field)
        card["sampling_defaults"] = {**sampling_defaults(m.generation_defaults),
                                     "source": m.generation_defaults_source or "the OpenAI API's defaults"}
    return card


async def list_models(request: Request) -> Response:
    """GET /v1/models."""
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}."""
    st = _state(request)
    st.check_model(request.path_params["model"])
    return JSONResponse(_model_card(st))


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the request schemas of the generation endpoints (from the pydantic models), with the
    paths route plugins describe."""
    doc = openapi()
    extra = _state(request).openapi_paths
    if extra:
        doc = {**doc, "paths": {**doc["paths"], **{p: item["path"] for p, item in extra.items()}},
               "components": {"schemas": {**doc["components"]["schemas"],
                                          **{k: v for item in extra.values() for k, v in item["schemas"].items()}}}}
    return JSONResponse(doc)


async def health(request: Request) -> Response:
    """GET /health: 200 when ready, 503 while loading, draining or after the engine stopped."""
    st = _state(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not st.ready:
        body = {"status": "error", "error": st.load_error} if st.load_error else {"status": "loading"}
        return JSONResponse(body, status_code=503)
    if not st.client.running:
        dead = getattr(st.client, "dead", None)  # why it stopped, where the client knows
        return JSONResponse({"status": "stopped"} | ({"error": str(dead)} if dead else {}), status_code=503)
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    """GET /stats: the engine's snapshot (queue, running, cache, prefix cache, latencies)."""
    st = _state(request)
    if st.model is None:
        raise ApiError(503, "the engine is not ready", code="not_ready")
    return Response(dumps(await st.stats_snapshot()), media_type="application/json")
