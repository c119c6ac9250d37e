"""Tool calls and reasoning in chat answers: each choice's text split into reasoning, content and tool calls.

tool_choice auto reads calls with the tool parser plugin named by server.tool_parser; reasoning comes out through
server.reasoning_parser. tool_choice required or a named function is enforced by the grammar (`tool_grammar`), so
its JSON is read here directly. JsonCalls reads calls out of JSON as it streams, for both (plugins use it too).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from typing import Any

from llmserve.interfaces import ReasoningParser, ToolCallDelta, ToolParser
from llmserve.request import StructuredOutput
from llmserve.server.errors import bad_request

_WS = " \t\r\n"


class JsonScanner:
    """Scans JSON text as it grows: for each object `depth` containers deep, the text span of each key's value."""

    def __init__(self, depth: int = 1):
        self.text, self.depth = "", depth
        self.objects: list[dict[str, list]] = []  # key → [start, end]; end is None while the value is open
        self.closed = 0  # how many of the objects are complete
        self._stack: list[str] = []
        self._str = self._esc = False
        self._key_at: int | None = None  # where the key string being read starts
        self._key: str | None = None  # the key whose value comes next or is being read

    def feed(self, text: str) -> None:
        start, self.text = len(self.text), self.text + text
        for i in range(start, len(self.text)):
            self._step(self.text[i], i)

    def value(self, obj: dict[str, list], key: str) -> tuple[str, bool] | None:
        """The raw text of obj's value of key so far (trailing whitespace held back), and whether it is complete."""
        if (span := obj.get(key)) is None:
            return None
        start, end = span
        return (self.text[start:].rstrip(_WS), False) if end is None else (self.text[start:end], True)

    def _step(self, c: str, i: int) -> None:
        if self._str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._str = False
                if self._key_at is not None:
                    self._key, self._key_at = json.loads(self.text[self._key_at:i + 1]), None
            return
        at = len(self._stack) == self.depth and self._stack[-1] == "{"  # directly inside an object we track
        if at and self._key is not None and c not in _WS and c not in ":,}" and self._key not in self.objects[-1]:
            self.objects[-1][self._key] = [i, None]
        if c == '"':
            self._str = True
            if at and self._key is None:
                self._key_at = i
        elif c in "{[":
            self._stack.append(c)
            if c == "{" and len(self._stack) == self.depth:
                self.objects.append({})
                self._key = None
        elif c in "}]":
            if at:
                self._end(i)
                self.closed += 1
            if self._stack:
                self._stack.pop()
        elif c == "," and at:
            self._end(i)

    def _end(self, i: int) -> None:
        span = self.objects[-1].get(self._key) if self._key is not None else None
        if span is not None and span[1] is None:
            while i > span[0] and self.text[i - 1] in _WS:
                i -= 1
            span[1] = i
        self._key = None


class JsonCalls:
    """Tool calls read out of JSON objects {"name": …, "arguments" (or "parameters"): {…}} as they stream."""

    def __init__(self, depth: int = 1, args: tuple[str, ...] = ("arguments", "parameters")):
        self.scan, self.args = JsonScanner(depth), args
        self.sent: list[int | None] = []  # per object: None until its name is known, then the argument chars sent
        self.count = 0  # calls named so far
        self._index: list[int] = []
        self._first = 0  # objects before it are complete and sent

    def feed(self, text: str) -> list[ToolCallDelta]:
        """Scan the next piece; the pieces of calls it completes or extends."""
        self.scan.feed(text)
        out, objects = [], self.scan.objects
        self.sent += [None] * (len(objects) - len(self.sent))
        self._index += [-1] * (len(objects) - len(self._index))
        for k in range(self._first, len(objects)):
            closed, name = k < self.scan.closed, None
            if self.sent[k] is None:
                got = self.scan.value(objects[k], "name")
                name = json.loads(got[0]) if got and got[1] else None
                if not isinstance(name, str):
                    self._first += closed and k == self._first
                    continue
                self.sent[k], self._index[k], self.count = 0, self.count, self.count + 1
            args = self._arguments(objects[k], closed)
            if name is not None or len(args) > self.sent[k]:
                out.append(ToolCallDelta(self._index[k], name, args[self.sent[k]:]))
                self.sent[k] = len(args)
            self._first += closed and k == self._first
        return out

    def _arguments(self, obj: dict, closed: bool) -> str:
        got = next((v for k in self.args if (v := self.scan.value(obj, k)) is not None), None)
        if got is None:
            return "{}" if closed else ""
        raw, done = got
        if raw.startswith('"'):  # arguments written as a JSON string: its text, once whole
            return json.loads(raw) if done else ""
        return raw


class _Named(ToolParser):
    """tool_choice names a function: the grammar made the whole output its arguments."""

    def __init__(self, name: str):
        self.name: str | None = name

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if not text and not (final and self.name):
            return "", []
        name, self.name = self.name, None
        return "", [ToolCallDelta(0, name, text)]


class _Required(ToolParser):
    """tool_choice required: the grammar made the output a JSON array of {"name", "parameters"}."""

    def __init__(self):
        self.calls = JsonCalls(2, ("parameters",))

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        return "", self.calls.feed(text)


class ChoiceParser:
    """One choice's text split into reasoning, content and tool calls, as OpenAI's delta fields."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True):
        self.reasoning, self.tools, self.parallel = reasoning, tools, parallel
        self.calls: list[dict] = []  # the whole calls so far

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta of the next piece of text: reasoning_content, content and tool_calls, where there are any."""
        d: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning:
                d["reasoning_content"] = reasoning
        if self.tools is not None:
            text, pieces = self.tools.feed(text, final)
            calls = [self._call(p) for p in pieces if self.parallel or p.index == 0]
            if calls:
                d["tool_calls"] = calls
        if text:
            d["content"] = text
        return d

    def _call(self, p: ToolCallDelta) -> dict[str, Any]:
        if p.name is None:
            self.calls[p.index]["function"]["arguments"] += p.arguments
            return {"index": p.index, "function": {"arguments": p.arguments}}
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": p.name, "arguments": p.arguments}}
        self.calls.append(call)
        return {"index": p.index, **call, "function": dict(call["function"])}


def tool_grammar(req: Any, current: StructuredOutput | None) -> StructuredOutput | None:
    """The grammar that enforces tool_choice required or a named function (vLLM's schemas), else `current`."""
    choice, tools = req.tool_choice, req.tools or []
    if choice in (None, "none", "auto"):
        return current
    if not tools:
        raise bad_request("tool_choice required or a named function needs tools", "tool_choice")
    if current is not None:
        raise bad_request("tool_choice required or a named function cannot be combined with another output "
                          "constraint (response_format, guided_*)", "tool_choice")
    empty = {"type": "object", "properties": {}}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters or empty},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | ({} if req.parallel_tool_calls
                                                                                else {"maxItems": 1})
        return StructuredOutput("json", json.dumps(schema), "tools")
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among tools "
                          f"({', '.join(names)})", "tool_choice.function.name")
    i = names.index(choice.function.name)
    return StructuredOutput("json", json.dumps(tools[i].function.parameters or empty), f"tools[{i}].function.parameters")


def choice_parsers(st: Any, req: Any, prompt: str) -> Callable[[], ChoiceParser] | None:
    """What builds each choice's ChoiceParser for this request; None when the text is all content."""
    server, plugins, tok = st.config.server, st.engine.plugins, st.engine.tokenizer
    tools = req.template_tools()
    choice = req.tool_choice or ("auto" if tools else "none")
    reason = None if server.reasoning_parser == "none" else plugins.get("reasoning_parser", server.reasoning_parser)
    calls: Callable[[], ToolParser] | None = None
    if tools and choice == "auto":
        if server.tool_parser == "none":
            raise bad_request("tool_choice auto (the default with tools) needs a tool parser: start the server "
                              "with server.tool_parser set (e.g. hermes, llama3_json)", "tool_choice")
        calls = functools.partial(plugins.get("tool_parser", server.tool_parser).factory, tok, tools)
    elif tools and choice != "none":  # enforced by the grammar: there is no text to reason in
        calls, reason = _Required if choice == "required" else functools.partial(_Named, choice.function.name), None
    if reason is None and calls is None:
        return None
    return lambda: ChoiceParser(reason.factory(tok, prompt) if reason else None, calls() if calls else None,
                                req.parallel_tool_calls)


def check(engine: Any, server: Any) -> None:
    """A PluginError at start-up when server.tool_parser or server.reasoning_parser names no registered parser."""
    for kind, name in (("tool_parser", server.tool_parser), ("reasoning_parser", server.reasoning_parser)):
        if name != "none":
            engine.plugins.get(kind, name)
