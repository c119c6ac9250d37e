"""JsonCalls: tool calls read out of JSON text as it streams — a call's name once it is whole, then its arguments
piece by piece. tool_choice required's output is read with it, so are the default parsers' calls, and so may a
plugin's (docs/tool-calling.md)."""

from __future__ import annotations

import json

from llmserve.interfaces import ToolCallDelta

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
                    self._key, self._key_at = _loads(self.text[self._key_at:i + 1]), None
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
                name = _loads(got[0]) if got and got[1] else None
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
            text = _loads(raw) if done else ""
            return text if isinstance(text, str) else raw
        return raw


def _loads(text: str):
    """The JSON value of text; None when it is not JSON (a model may write anything)."""
    try:
        return json.loads(text)
    except ValueError:
        return None
