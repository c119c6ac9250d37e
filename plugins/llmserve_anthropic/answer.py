"""The answer of POST /v1/messages: the chat answer's text, reasoning and tool calls as Anthropic's content blocks,
in one message body or as Anthropic's stream of events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from llmserve.request import SamplingParams
from llmserve.server.answer import ChatAnswer, dumps
from llmserve.server.errors import map_error
from llmserve.server.state import ServerState
from llmserve_anthropic.errors import error_body
from llmserve_anthropic.protocol import MessagesRequest


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic names them: `event: <type>` and its JSON."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}).encode() + b"\n\n"


def tool_id(call_id: str) -> str:
    """The chat answer's call id as Anthropic spells tool_use ids."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use input object ({} when a max_tokens cut left them unfinished)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Blocks:
    """A streamed message's content blocks: the events that open, extend and close them as the deltas arrive."""

    def __init__(self):
        self.count = 0  # blocks opened so far
        self.open: tuple[str, int] | None = None  # (kind, tool call index or -1) of the block being written
        self.calls: dict[int, int] = {}  # tool call index → its block's index

    def events(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (reasoning_content, content, tool_calls), in that order."""
        out = []
        if delta.get("reasoning_content"):
            out += self._to(("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._to(("text", -1), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for piece in delta.get("tool_calls", ()):
            i, fn = piece["index"], piece["function"]
            if "id" in piece:  # a call's first piece names it: its block opens
                out += self._to(("tool_use", i), {"type": "tool_use", "id": tool_id(piece["id"]), "name": fn["name"],
                                                  "input": {}})
                self.calls[i] = self.count - 1
            if fn["arguments"]:
                out.append(event("content_block_delta", {"index": self.calls[i], "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out

    def close(self) -> list[bytes]:
        """The stop of the block being written, if any."""
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.count - 1})]

    def _to(self, key: tuple[str, int], start: dict[str, Any]) -> list[bytes]:
        if self.open == key and key[0] != "tool_use":
            return []
        out = self.close()
        self.open, self.count = key, self.count + 1
        return out + [event("content_block_start", {"index": self.count - 1, "content_block": start})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.count - 1, "delta": delta})


class MessagesAnswer(ChatAnswer):
    """One message: the chat answer's choice (always one) as Anthropic's content blocks, stop_reason and usage."""

    def __init__(self, st: ServerState, req: MessagesRequest, sp: SamplingParams, ids: list[int], prompt: str):
        super().__init__(st, req.chat_request, sp, [ids], prompt)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.stop_sequences = set(req.stop_sequences)

    def _message_delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat delta of the next piece of text: reasoning, content and tool-call pieces."""
        if self.parsers is None:
            return {"content": text}
        return self.parsers[0].feed(text, final=final)

    def _stop(self) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence for how the choice ended."""
        ch = self.choices[0]
        if ch.finish == "length":
            return "max_tokens", None
        if self.parsers is not None and self.parsers[0].calls:
            return "tool_use", None
        if isinstance(ch.stop_reason, str) and ch.stop_reason in self.stop_sequences:
            return "stop_sequence", ch.stop_reason
        return "end_turn", None

    def message_usage(self) -> dict[str, int]:
        """Anthropic's usage: input_tokens are the prompt's tokens the prefix cache did not hold, as Anthropic
        counts them apart from cache_read_input_tokens."""
        ch = self.choices[0]
        return {"input_tokens": len(self.prompts[0]) - ch.num_cached, "output_tokens": ch.num_output,
                "cache_read_input_tokens": ch.num_cached, "cache_creation_input_tokens": 0}

    def _message(self, content: list[dict], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.st.model_name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": self.message_usage()}

    def body(self) -> dict[str, Any]:
        """The whole message: thinking, text and tool_use blocks, stop_reason, stop_sequence and usage."""
        d = self._message_delta("".join(self.choices[0].text), final=True)
        content = []
        if d.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": d["reasoning_content"], "signature": ""})
        if d.get("content"):
            content.append({"type": "text", "text": d["content"]})
        for call in self.parsers[0].calls if self.parsers is not None else ():
            fn = call["function"]
            content.append({"type": "tool_use", "id": tool_id(call["id"]), "name": fn["name"],
                            "input": tool_input(fn["arguments"])})
        return self._message(content, self._stop())

    async def _frames(self, gen, batch):
        # Anthropic's events; the first batch is folded before message_start, which carries the prefix-cache hits
        blocks = _Blocks()
        try:
            folded = self._fold(batch)
            yield event("message_start", {"message": self._message([], (None, None)) | {
                "usage": self.message_usage() | {"output_tokens": 0}}})
            yield event("ping", {})
            while True:
                for _idx, text, _lp, fin, _sr in folded:
                    for e in blocks.events(self._message_delta(text, final=fin is not None)):
                        yield e
                batch = await gen.next()
                if batch is None:
                    break
                folded = self._fold(batch)
            for e in blocks.close():
                yield e
            stop, sequence = self._stop()
            yield event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence},
                                          "usage": self.message_usage()})
            yield event("message_stop", {})
        except Exception as e:  # a failure after the first event: Anthropic's error event ends the stream
            yield event("error", {"error": error_body(map_error(e))["error"]})
        finally:
            gen.abort()  # ends, or the client went away: free the engine's blocks either way
