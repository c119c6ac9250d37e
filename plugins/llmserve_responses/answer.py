"""The answer of POST /v1/responses: a chat answer's parsed choice as a Response object, or its typed SSE events."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from llmserve.interfaces import ResponseStore
from llmserve.request import SamplingParams
from llmserve.server.answer import ChatAnswer, dumps
from llmserve.server.errors import map_error
from llmserve.server.generation import Generation
from llmserve.server.state import ServerState
from llmserve_responses.items import Output, new_id
from llmserve_responses.request import ResponsesRequest


class ResponsesAnswer(ChatAnswer):
    """One choice, parsed as a chat answer's is (reasoning, content, tool calls), answered as output items."""

    def __init__(self, st: ServerState, req: ResponsesRequest, sp: SamplingParams, ids: list[int], prompt: str,
                 history: list[dict[str, Any]], store: ResponseStore | None):
        super().__init__(st, req.chat, sp, [ids], prompt)
        self.rreq, self.history, self.store = req, history, store
        self.id = new_id("resp")
        self.created_at = int(time.time())  # whole seconds, as OpenAI sends them (and chat's created)
        self.output = Output()
        self._seq = 0

    def body(self) -> dict[str, Any]:
        """The Response object of the whole answer."""
        ch = self.choices[0]
        self.output.feed(self._parsed("".join(ch.text), True))
        self.output.close(ch.finish == "length")
        self._body = self.response(self._status())
        return self._body

    async def respond(self, request, client):
        """Answer as a chat answer does; a whole answer is stored (store true) before it is sent."""
        self._body: dict[str, Any] | None = None
        resp = await super().respond(request, client)
        if self._body is not None:
            await self.save(self._body)
        return resp

    def _status(self) -> str:
        return "incomplete" if self.choices[0].finish == "length" else "completed"

    def response(self, status: str) -> dict[str, Any]:
        """The Response object as it stands: its output so far, and usage once it has ended."""
        r, ended = self.rreq, status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if ended else None, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
            "model": self.st.model_name, "output": self.output.items if ended else [],
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "service_tier": "default", "store": r.store, "temperature": self.sp.temperature,
            "text": r.text_echo(), "tool_choice": _tool_choice(r), "tools": _tools(r), "top_logprobs": 0,
            "top_p": self.sp.top_p, "truncation": r.truncation or "disabled", "usage": self._usage() if ended else None,
            "user": r.user, "metadata": r.metadata or {},
        }

    def _usage(self) -> dict[str, Any]:
        u, tok, reasoning = self.usage(), self.st.model.tokenizer, self.output.reasoning
        # the engine counts tokens, not which part they went to: the reasoning text's tokens, counted again
        thought = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning and tok is not None else 0
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": min(thought, u["completion_tokens"])},
                "total_tokens": u["total_tokens"]}

    def _parsed(self, text: str, final: bool) -> dict[str, Any]:
        """The chat delta of a piece of the choice's text: reasoning_content, content, tool_calls."""
        if self.parsers is not None:
            return self.parsers[0].feed(text, final=final)
        return {"content": text} if text else {}

    async def save(self, body: dict[str, Any]) -> None:
        """Keep the answer (store true): the response, this request's input items, and the conversation so far."""
        if self.store is None or not self.rreq.store:
            return
        record = {"response": body, "input": self.rreq.input_items,
                  "items": self.history + self.rreq.input_items + body["output"]}
        await asyncio.to_thread(self.store.put, self.id, record)

    def _event(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"], self._seq = self._seq, self._seq + 1
        return f"event: {event['type']}\ndata: ".encode() + dumps(event).encode() + b"\n\n"

    async def _frames(self, gen: Generation, batch):
        # the typed events of OpenAI's Responses stream, as finished SSE frames
        try:
            for kind in ("created", "in_progress"):
                yield self._event({"type": f"response.{kind}", "response": self.response("in_progress")})
            while batch is not None:
                for _, text, _, fin, _ in self._fold(batch):
                    for e in self.output.feed(self._parsed(text, fin is not None)):
                        yield self._event(e)
                batch = await gen.next()
            for e in self.output.close(self.choices[0].finish == "length"):
                yield self._event(e)
            status = self._status()
            body = self.response(status)
            await self.save(body)
            yield self._event({"type": f"response.{status}", "response": body})
        except Exception as e:  # a failure after the stream began: OpenAI's error event
            err = map_error(e)
            yield self._event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
        finally:
            gen.abort()


def _tool_choice(r: ResponsesRequest) -> Any:
    tc = r.tool_choice
    if tc is None:
        return "auto"
    return tc if isinstance(tc, str) else {"type": "function", "name": tc.name}


def _tools(r: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict} for t in r.tools or ()]
