"""The answer of a generation endpoint: the engine's deltas folded into choices, sent whole or as SSE chunks.

Answer holds what /v1/completions and /v1/chat/completions share: the choices, usage, the collect
and stream loops. CompletionAnswer and ChatAnswer hold only how their choices look: `_new_lp`,
`_logprobs`, `_choice` (a whole one), `_delta` (a streamed one) and `_opening` (chunks before any delta).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from llmserve.engine_client import EngineClient
from llmserve.request import RequestOutput, SamplingParams
from llmserve.server.errors import map_error
from llmserve.server.generation import GONE, Generation, until_answered
from llmserve.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs, prompt_logprobs
from llmserve.server.state import ServerState
from llmserve.server.tools import choice_parsers

# ASCII-only JSON: raw U+0085 / U+2028 / U+2029 in a chunk would split it for clients that break lines
# the way str.splitlines() does
dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode


@dataclass(slots=True)
class _Choice:
    """The accumulated state of one choice (one of n completions of one prompt)."""

    lp: Any  # the shape's logprobs so far, None when not asked for
    text: list[str] = field(default_factory=list)  # one piece per fold: empty means nothing arrived yet
    finish: str | None = None
    stop_reason: Any = None
    num_output: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache


_BIG_ANSWER = 16_384  # tokens × (1 + logprobs): a larger whole answer is built off the event loop
PING_SECONDS = 15  # a quiet stream's keep-alive comment (": ping - <time>"), for proxies that drop idle connections


class _EventStream(EventSourceResponse):
    """sse-starlette's response, minus a cancel scope around every chunk when no send timeout is set."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)  # the per-chunk anyio scope would cost more than the JSON
        else:
            await super()._send_with_timeout(send, message)


class Answer:
    """Runs one request's Generation and folds its deltas into choices: one JSON body, or SSE chunks."""

    prefix = object_name = chunk_object_name = ""  # the id's prefix and OpenAI's object names, set by each shape
    echo: list[str] | None = None  # text that opens each prompt's choices (completions' echo)
    scores_only = False  # the prompt is scored and nothing is generated

    def __init__(self, st: ServerState, req: Any, sp: SamplingParams, prompts: list[list[int]]):
        self.st, self.req, self.sp, self.prompts = st, req, sp, prompts
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tt = TokenText(st.model.tokenizer, as_ids=req.return_tokens_as_token_ids)
        self.choices = [_Choice(self._new_lp()) for _ in range(len(prompts) * sp.n)]

    async def respond(self, request: Request, client: EngineClient) -> Response:
        """Submit the prompts; answer the whole body, or stream it (499 if the client leaves before either)."""
        request.state.answer = self  # its id and usage for the request log (RequestLogMiddleware)
        gen = Generation(client, self.prompts, self.sp, self.req.priority, self.st.config.server.request_timeout,
                         self.id, self.req.cache_salt)
        # the first batch is awaited here, so an immediate failure still gets its own status code
        batch = await until_answered(request.receive, gen, gen.next(), keep=True)  # (the rest reads on)
        if batch is GONE:
            return Response(status_code=499)
        if self.req.stream:
            return _EventStream(self._frames(gen, batch), sep="\n", ping=PING_SECONDS,
                                headers={"Cache-Control": "no-cache"})
        if await until_answered(request.receive, gen, self._fold_all(gen, batch)) is GONE:
            return Response(status_code=499)
        if self.usage()["completion_tokens"] * (1 + (self.sp.logprobs or 0)) < _BIG_ANSWER:
            return Response(dumps(self.body()), media_type="application/json")
        # many long choices with logprobs: megabytes, built in a worker thread while the streams flow on
        return Response(await asyncio.to_thread(lambda: dumps(self.body())), media_type="application/json")

    def body(self) -> dict[str, Any]:
        """The whole answer's JSON body, once every choice has ended."""
        choices = [self._choice(i, "".join(ch.text), ch.lp)
                   | {"finish_reason": self._finish(i, ch.finish), "stop_reason": ch.stop_reason}
                   for i, ch in enumerate(self.choices)]
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.st.model_name,
                "choices": choices, "usage": self.usage(), "system_fingerprint": None}

    async def _fold_all(self, gen: Generation, batch) -> None:
        while batch is not None:
            self._fold(batch)
            batch = await gen.next()

    async def _frames(self, gen: Generation, batch):
        # finished SSE frames (bytes), which sse-starlette passes through
        try:
            for choice in self._opening():
                yield self._chunk([choice | {"finish_reason": None, "stop_reason": None}])
            while batch is not None:
                for idx, text, lp, fin, sr in self._fold(batch):
                    choice = self._delta(idx, text, lp, fin)
                    if choice is not None:
                        yield self._chunk([choice | {"finish_reason": self._finish(idx, fin),
                                                     "stop_reason": sr if fin else None}])
                batch = await gen.next()
            if self.req.include_usage:
                yield self._chunk([], self.usage())
            yield b"data: [DONE]\n\n"
        except Exception as e:  # a failure after the first chunk: an error event, then [DONE]
            yield b"data: " + dumps(map_error(e).body()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            gen.abort()  # ends, or the client went away: free the engine's blocks either way

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        d = {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.st.model_name,
             "choices": choices}
        if self.req.include_usage:  # null until the last chunk, or the usage so far on every one (vLLM's option)
            d["usage"] = self.usage() if usage is None and self.req.stream_options.continuous_usage_stats else usage
        return b"data: " + dumps(d).encode() + b"\n\n"

    def _fold(self, batch: tuple[int, list[RequestOutput]]) -> list[tuple[int, str, Any, str | None, Any]]:
        """Fold a batch in; per choice that moved: (index, new text, new logprobs, finish reason, stop reason)."""
        pi, outs = batch
        by: dict[int, list[RequestOutput]] = {}  # several steps of one choice may have queued up
        for o in outs:
            by.setdefault(o.index, []).append(o)
        folded = []
        for group in by.values():
            idx = pi * self.sp.n + group[0].index
            ch, last = self.choices[idx], group[-1]
            text = self.echo[pi] if self.echo is not None and not ch.text else ""
            lp = self._logprobs(ch, pi, group) if ch.lp is not None else None
            if not self.scores_only:
                text += "".join(o.new_text for o in group)
                ch.num_output = last.num_output_tokens
            ch.num_cached = last.num_cached_tokens
            if last.finished:
                ch.finish = "length" if self.scores_only else last.finish_reason.value
                ch.stop_reason = None if self.scores_only else last.stop_reason
            ch.text.append(text)
            folded.append((idx, text, lp, ch.finish if last.finished else None, ch.stop_reason))
        return folded

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; cached_tokens counts each prompt once (its first choice), as prompt_tokens does."""
        prompt = sum(map(len, self.prompts))
        completion = sum(ch.num_output for ch in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(ch.num_cached for ch in self.choices[::self.sp.n])}}

    def _opening(self) -> list[dict]:
        return []

    def _finish(self, index: int, reason: str | None) -> str | None:
        return reason


class CompletionAnswer(Answer):
    """/v1/completions: choices carry `text` and the legacy logprobs object; echo and scoring the prompt."""

    prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, st: ServerState, req, sp: SamplingParams, prompts: list[list[int]], texts: list[str]):
        super().__init__(st, req, sp, prompts)
        self.echo = texts if req.echo else None
        self.scores_only = req.scores_only
        self.prompt_lps: list[list | None] = [None] * len(self.choices)  # vLLM's prompt_logprobs, when asked for

    def _fold(self, batch):
        for o in batch[1]:
            if o.prompt_logprobs is not None and self.req.prompt_logprobs is not None:
                self.prompt_lps[batch[0] * self.sp.n + o.index] = prompt_logprobs(self.tt, o.prompt_logprobs)
        return super()._fold(batch)

    def _new_lp(self):
        return CompletionLogprobs(self.tt, self.req.logprobs) if self.req.logprobs is not None else None

    def _logprobs(self, ch, pi, outs):
        for o in outs:
            if self.echo is not None and o.prompt_logprobs is not None:
                ch.lp.add_many(self.prompts[pi], o.prompt_logprobs)
            if not self.scores_only:
                ch.lp.add_many(o.new_token_ids, o.logprobs)
        # streamed chunks carry only the new entries; a whole answer keeps them all
        return ch.lp.take() if self.req.stream else None

    def _choice(self, index, text, lp):
        return {"index": index, "text": text, "logprobs": lp.to_dict() if lp is not None else None,
                "prompt_logprobs": self.prompt_lps[index]}

    def _delta(self, index, text, lp, fin):
        if not text and fin is None and not (lp and lp["tokens"]) and self.tt.tok is not None:
            return None  # text held back (a stop string may be forming, a character is cut)
        return {"index": index, "text": text, "logprobs": lp}


class ChatAnswer(Answer):
    """/v1/chat/completions: choices carry an assistant message (deltas when streamed) and logprobs.content."""

    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, st: ServerState, req, sp: SamplingParams, prompts: list[list[int]], prompt: str = ""):
        super().__init__(st, req, sp, prompts)
        make = choice_parsers(st, req, sp, prompt)  # reasoning and tool-call parsing, when asked for
        self.parsers = [make() for _ in self.choices] if make else None

    def _new_lp(self):
        return [] if self.req.logprobs else None

    def _opening(self):
        # the role first, as OpenAI does
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                for i in range(len(self.choices))]

    def _logprobs(self, ch, pi, outs):
        new = [e for o in outs for e in chat_logprobs(self.tt, o.new_token_ids, o.logprobs, self.req.top_logprobs or 0)]
        ch.lp.extend(new)
        return new

    def _choice(self, index, text, lp):
        message = {"role": "assistant", "content": text}
        if self.parsers is not None:
            p = self.parsers[index]
            d = p.feed(text, final=True)
            message["content"] = d.get("content") or (None if p.calls else "")
            if p.reasoning is not None:
                message["reasoning_content"] = d.get("reasoning_content")
            if p.calls:
                message["tool_calls"] = p.calls
        return {"index": index, "message": message, "logprobs": _content(lp)}

    def _delta(self, index, text, lp, fin):
        if self.parsers is not None:
            delta = self.parsers[index].feed(text, final=fin is not None)
            return {"index": index, "delta": delta, "logprobs": _content(lp)} if delta or lp or fin else None
        if text or lp:
            return {"index": index, "delta": {"content": text}, "logprobs": _content(lp)}
        return None if fin is None else {"index": index, "delta": {}, "logprobs": None}

    def _finish(self, index, reason):
        # OpenAI's reason when the model ended by calling tools
        return "tool_calls" if reason == "stop" and self.parsers and self.parsers[index].calls else reason


def _content(lp: list[dict] | None) -> dict | None:
    return {"content": lp, "refusal": None} if lp is not None else None
