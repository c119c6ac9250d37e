"""The OpenAI endpoints (/v1/completions, /v1/chat/completions, /v1/models) and /health, /stats."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve.async_engine import AsyncEngine
from llmserve.limits import check_request
from llmserve.request import FinishReason, RequestOutput, SamplingParams
from llmserve.server.errors import bad_request, error_body
from llmserve.server.generation import ClientGone, Generation, guarded, map_error
from llmserve.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from llmserve.server.protocol import ChatRequest, CompletionRequest, openapi, parse
from llmserve.server.state import ServerState

# ASCII-only JSON: raw U+0085 / U+2028 / U+2029 in a chunk would split it for clients that break lines
# the way str.splitlines() does
_dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode


def _state(request: Request) -> ServerState:
    return request.app.state.llm


async def _admit(request: Request, model) -> tuple[ServerState, AsyncEngine, Any, SamplingParams]:
    """The shared start of a generation endpoint, each step once: admission, body, validation, model name."""
    st = _state(request)
    aengine = st.admit()
    # the body limit is enforced by BodyLimitMiddleware while this reads
    req, sp = parse(model, await request.body(), request.url.path)
    st.check_model(req.model)
    return st, aengine, req, sp


def _check(st: ServerState, ids: list[int], sp: SamplingParams, param: str) -> None:
    """The engine's own vocabulary and context checks, run before submitting so every prompt is checked."""
    check_request(ids, sp, st.engine.backend.vocab_size, st.max_model_len, param)


_BIG_TEXT = 16_384  # characters; longer texts are tokenized off the event loop


async def _encode(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of text; a long text is tokenized in a worker thread so streams keep flowing."""
    if len(text) < _BIG_TEXT:
        return tok.encode(text, add_special_tokens)
    return await asyncio.to_thread(tok.encode, text, add_special_tokens)


def _finish(o: RequestOutput) -> str | None:
    r = o.finish_reason
    if r is None:
        return None
    return r.value if isinstance(r, FinishReason) else str(r)


def _usage(prompt_tokens: int, choices: list[_Choice], n: int) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens counts each prompt once (its first choice), as prompt_tokens does."""
    completion = sum(ch.num_output for ch in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(ch.num_cached for ch in choices[::n])}}


class _Choice:
    """The accumulated state of one choice (one of n completions of one prompt)."""

    __slots__ = ("text", "finish", "stop_reason", "num_output", "num_cached", "lp", "chat_lp", "started")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.num_output = 0
        self.num_cached = 0  # prompt tokens served from the prefix cache
        self.lp: CompletionLogprobs | None = None
        self.chat_lp: list[dict] = []
        self.started = False


def _merge(batch: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    """Deltas grouped by choice index, in order (several steps may have queued up)."""
    by: dict[int, list[RequestOutput]] = {}
    for o in batch:
        by.setdefault(o.index, []).append(o)
    return by


async def _first(request: Request, gen: Generation):
    """The first batch of deltas, so an immediate failure still gets its own status code."""
    try:
        return await guarded(request.receive, gen.next(), gen.abort)
    except ClientGone:
        raise
    except Exception as e:
        gen.abort()
        raise map_error(e) from None


async def _collect(request: Request, gen: Generation, first, apply_batch) -> Response | None:
    """Non-streaming: hand every batch of deltas to apply_batch until the end (499 if the client left)."""
    async def run():
        batch = first
        while batch is not None:
            apply_batch(batch)
            batch = await gen.next()

    try:
        await guarded(request.receive, run(), gen.abort)
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:
        gen.abort()
        raise map_error(e) from None
    gen.abort()
    return None


class _EventStream(EventSourceResponse):
    """sse-starlette's response, minus a cancel scope around every chunk when no send timeout is set."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)  # the per-chunk anyio scope would cost more than the JSON
        else:
            await super()._send_with_timeout(send, message)


def _sse(gen: Generation, events) -> Response:
    async def run():
        # events are yielded as finished SSE frames (bytes), which sse-starlette passes through
        try:
            async for ev in events:
                yield b"data: " + ev.encode() + b"\n\n"
        except Exception as e:  # a failure after the first chunk: an error event, then [DONE]
            err = map_error(e)
            yield b"data: " + _dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            gen.abort()  # ends, or the client went away: free the engine's blocks either way

    return _EventStream(run(), sep="\n", ping=15, headers={"Cache-Control": "no-cache"})


# --- /v1/completions --------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    st, aengine, req, sp = await _admit(request, CompletionRequest)
    tok = st.tokenizer
    prompt_ids: list[list[int]] = []
    prompt_texts: list[str] = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if tok is None:
                raise bad_request("this server has no tokenizer: send the prompt as token ids", "prompt")
            ids = await _encode(tok, p)
            text = p
        else:
            ids = p
            text = tok.decode(ids, skip_special_tokens=False) if (tok is not None and req.echo) else ""
        _check(st, ids, sp, param)
        prompt_ids.append(ids)
        prompt_texts.append(text)
    zero_gen = req.scores_only
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = Generation(aengine, prompt_ids, sp, req.priority, st.config.server.request_timeout, rid, req.cache_salt)
    try:
        first = await _first(request, gen)
    except ClientGone:
        return Response(status_code=499)
    tt = TokenText(tok)
    n = sp.n
    choices = [_Choice() for _ in range(len(prompt_ids) * n)]
    prompt_tokens = [len(p) for p in prompt_ids]

    def apply(pi: int, outs: list[RequestOutput]) -> tuple[int, str, dict | None, str | None, Any]:
        """Fold one choice's deltas in; return (choice index, new text, logprobs delta, finish, stop_reason)."""
        idx = pi * n + outs[0].index
        ch = choices[idx]
        text = ""
        if not ch.started:
            ch.started = True
            if req.echo:
                text = prompt_texts[pi]
            if req.logprobs is not None:
                ch.lp = CompletionLogprobs(tt, req.logprobs)
        for o in outs:
            if req.echo and req.logprobs is not None and o.prompt_logprobs is not None and ch.lp is not None:
                ch.lp.add_many(prompt_ids[pi], o.prompt_logprobs)
            if not zero_gen:
                text += o.new_text
                if ch.lp is not None and o.new_token_ids:
                    ch.lp.add_many(o.new_token_ids, o.logprobs)
                ch.num_output = o.num_output_tokens
            ch.num_cached = o.num_cached_tokens
            if o.finished:
                ch.finish = "length" if zero_gen else _finish(o)
                ch.stop_reason = None if zero_gen else o.stop_reason
        ch.text.append(text)
        # streamed chunks carry only the new entries; a whole answer keeps them all
        lp_delta = ch.lp.take() if (ch.lp is not None and req.stream) else None
        return idx, text, lp_delta, (ch.finish if outs[-1].finished else None), ch.stop_reason

    def usage() -> dict:
        return _usage(sum(prompt_tokens), choices, n)

    if not req.stream:
        def apply_batch(batch):
            pi, outs = batch
            for group in _merge(outs).values():
                apply(pi, group)

        gone = await _collect(request, gen, first, apply_batch)
        if gone is not None:
            return gone
        body = {
            "id": rid, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": [{"index": i, "text": "".join(ch.text),
                         "logprobs": ch.lp.to_dict() if ch.lp is not None else None,
                         "finish_reason": ch.finish, "stop_reason": ch.stop_reason}
                        for i, ch in enumerate(choices)],
            "usage": usage(), "system_fingerprint": None,
        }
        return Response(_dumps(body), media_type="application/json")

    include_usage = req.include_usage

    async def events():
        batch = first
        while batch is not None:
            pi, outs = batch
            for group in _merge(outs).values():
                idx, text, lp, fin, sr = apply(pi, group)
                if not text and fin is None and not (lp and lp["tokens"]) and tok is not None:
                    continue  # text held back (a stop string may be forming, a character is cut)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                         "choices": [{"index": idx, "text": text, "logprobs": lp, "finish_reason": fin,
                                      "stop_reason": sr if fin else None}]}
                if include_usage:
                    chunk["usage"] = None
                yield _dumps(chunk)
            batch = await gen.next()
        if include_usage:
            yield _dumps({"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                          "choices": [], "usage": usage()})
        yield "[DONE]"

    return _sse(gen, events())


# --- /v1/chat/completions ---------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    st, aengine, req, sp = await _admit(request, ChatRequest)
    tok = st.tokenizer
    if tok is None:
        raise bad_request("this server has no tokenizer, so it cannot render chat messages; "
                          "use /v1/completions with token ids", "messages")
    try:
        prompt = tok.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt)
    except NotImplementedError as e:
        raise bad_request(str(e), "messages") from None
    ids = await _encode(tok, prompt, add_special_tokens=False)
    _check(st, ids, sp, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = Generation(aengine, [ids], sp, req.priority, st.config.server.request_timeout, rid, req.cache_salt)
    try:
        first = await _first(request, gen)
    except ClientGone:
        return Response(status_code=499)
    tt = TokenText(tok)
    n = sp.n
    choices = [_Choice() for _ in range(n)]
    want_lp = req.logprobs

    def apply(outs: list[RequestOutput]):
        ch = choices[outs[0].index]
        text = "".join(o.new_text for o in outs)
        lps = None
        if want_lp:
            lps = []
            for o in outs:
                if o.new_token_ids:
                    lps.extend(chat_logprobs(tt, o.new_token_ids, o.logprobs, req.top_logprobs or 0))
            ch.chat_lp.extend(lps)
        last = outs[-1]
        ch.num_output = last.num_output_tokens
        ch.num_cached = last.num_cached_tokens
        fin = None
        if last.finished:
            fin = ch.finish = _finish(last)
            ch.stop_reason = last.stop_reason
        ch.text.append(text)
        return ch, outs[0].index, text, lps, fin

    def usage() -> dict:
        return _usage(len(ids), choices, sp.n)

    if not req.stream:
        def apply_batch(batch):
            for group in _merge(batch[1]).values():
                apply(group)

        gone = await _collect(request, gen, first, apply_batch)
        if gone is not None:
            return gone
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(ch.text)},
                         "logprobs": {"content": ch.chat_lp, "refusal": None} if want_lp else None,
                         "finish_reason": ch.finish, "stop_reason": ch.stop_reason}
                        for i, ch in enumerate(choices)],
            "usage": usage(), "system_fingerprint": None,
        }
        return Response(_dumps(body), media_type="application/json")

    include_usage = req.include_usage

    def chunk(index: int, delta: dict, lps, fin, sr=None) -> str:
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
             "choices": [{"index": index, "delta": delta,
                          "logprobs": {"content": lps, "refusal": None} if lps is not None else None,
                          "finish_reason": fin, "stop_reason": sr if fin else None}]}
        if include_usage:
            d["usage"] = None
        return _dumps(d)

    async def events():
        for i in range(n):  # the role first, as OpenAI does
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        batch = first
        while batch is not None:
            for group in _merge(batch[1]).values():
                ch, idx, text, lps, fin = apply(group)
                if text or (lps and want_lp):
                    yield chunk(idx, {"content": text}, lps if want_lp else None, fin, ch.stop_reason)
                elif fin is not None:
                    yield chunk(idx, {}, None, fin, ch.stop_reason)
            batch = await gen.next()
        if include_usage:
            yield _dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                          "choices": [], "usage": usage()})
        yield "[DONE]"

    return _sse(gen, events())


# --- models, health, stats --------------------------------------------------------------------


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "llmserve",
            "root": st.config.model.model, "parent": None,
            "max_model_len": st.engine.max_model_len if st.engine is not None else None}


async def list_models(request: Request) -> Response:
    """GET /v1/models."""
    st = _state(request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}."""
    st = _state(request)
    st.check_model(request.path_params["model"])
    return JSONResponse(_model_card(st))


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the request schemas of the generation endpoints (from the pydantic models)."""
    return JSONResponse(openapi())


async def health(request: Request) -> Response:
    """GET /health: 200 when ready, 503 while loading, draining or after the engine stopped."""
    st = _state(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not st.ready:
        body = {"status": "error" if st.load_error else "loading"}
        if st.load_error:
            body["error"] = st.load_error
        return JSONResponse(body, status_code=503)
    if not st.aengine.running:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    """GET /stats: the engine's snapshot (queue, running, cache, prefix cache, latencies)."""
    st = _state(request)
    if st.engine is None:
        return Response(_dumps(error_body("the engine is not ready", "service_unavailable", None, "not_ready")),
                        status_code=503, media_type="application/json")
    snap = await st.aengine.call(lambda e: e.stats())
    snap["server"] = {"ready": st.ready, "draining": st.draining, "active_requests": st.aengine.num_active,
                      "steps": st.aengine.num_steps}
    return Response(_dumps(snap), media_type="application/json")
