"""A response's output items, built from a choice's parsed deltas, and the stream events that build them.

The deltas come from the chat machinery's ChoiceParser (reasoning_content, content, tool_calls); each kind opens its
own item: a reasoning item, a message with one output_text part, a function_call per call. An item is done when
the next one opens or the answer ends. A whole answer is the same deltas fed at once, so a streamed answer's final
response equals the unstreamed one.
"""

from __future__ import annotations

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: prefix_ and 48 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


class Output:
    """The output items of one answer; feed() and close() return the events that got them there."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # the index of the item still being written
        self._calls: dict[int, int] = {}  # a tool call's index in the choice → its item's index

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one parsed delta: reasoning first, then content, then tool-call pieces (the order in which
        the parsers let them out of one piece of text)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for piece in delta.get("tool_calls") or ():
            events += self._call(piece)
        return events

    def close(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that end the answer: the open item done (incomplete when max_output_tokens cut it); an
        empty message when nothing was written."""
        events = [] if self.items else self._open_item(_message())
        return events + self._done("incomplete" if incomplete else "completed")

    @property
    def reasoning(self) -> str:
        """The reasoning text of every reasoning item."""
        return "".join(c["text"] for it in self.items if it["type"] == "reasoning" for c in it["content"])

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.items[self._open]["type"] != kind:
            events = self._done("completed") + self._open_item(_message() if kind == "message" else _reasoning())
        i = self._open
        item = self.items[i]
        item["content"][0]["text"] += text
        return events + [{"type": f"response.{'output' if kind == 'message' else 'reasoning'}_text.delta",
                          "item_id": item["id"], "output_index": i, "content_index": 0, "delta": text}
                         | ({"logprobs": []} if kind == "message" else {})]

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        fn = piece["function"]
        if "name" in fn:  # the first piece of a call: a new item
            events = self._done("completed") + self._open_item(
                {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece["id"],
                 "name": fn["name"], "arguments": ""})
            self._calls[piece["index"]] = self._open
        i = self._calls[piece["index"]]
        item = self.items[i]
        if not fn.get("arguments"):
            return events
        item["arguments"] += fn["arguments"]
        return events + [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": i,
                          "delta": fn["arguments"]}]

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = i = len(self.items) - 1
        # the item as it starts: no text yet
        shown = {**item, "content": []} if "content" in item else dict(item)
        events = [{"type": "response.output_item.added", "output_index": i, "item": shown}]
        if "content" in item:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": i,
                           "content_index": 0, "part": {**item["content"][0], "text": ""}})
        return events

    def _done(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        i, self._open = self._open, None
        item = self.items[i]
        item["status"] = status
        ids = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            return [{"type": "response.function_call_arguments.done", **ids, "name": item["name"],
                     "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": i, "item": item}]
        part = item["content"][0]
        kind = "output" if item["type"] == "message" else "reasoning"
        text_done = {"type": f"response.{kind}_text.done", **ids, "content_index": 0, "text": part["text"]}
        if kind == "output":
            text_done["logprobs"] = []
        return [text_done, {"type": "response.content_part.done", **ids, "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": i, "item": item}]


def _message() -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


def _reasoning() -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}]}
