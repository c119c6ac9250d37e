"""The default tool-call parsers: Hermes / Qwen2.5 tags (<tool_call>{…}</tool_call>) and Llama 3's JSON.

Both stream: a call's name goes out once it is whole, its arguments piece by piece (JsonCalls), and only a
possible start of a tag is held back. Text that turns out to hold no call is sent as content after all.
"""

from __future__ import annotations

from llmserve.interfaces import ToolCallDelta, ToolParser
from llmserve.server.jsoncalls import JsonCalls


def held(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag (they wait for the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    """Calls as <tool_call>{"name": …, "arguments": {…}}</tool_call> (Hermes 2 Pro, Qwen2.5, Qwen3); the text
    outside the tags is content, less the whitespace next to a tag."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buf, self.inside, self.strip = "", False, False
        self.calls, self.raw, self.base = JsonCalls(), "", 0  # the current tag's calls and text; calls before it

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while self.buf:
            if self.inside:
                i = self.buf.find(self.CLOSE)
                part = self.buf[:i if i >= 0 else len(self.buf) - (0 if final else held(self.buf, self.CLOSE))]
                pieces += [ToolCallDelta(p.index + self.base, p.name, p.arguments) for p in self.calls.feed(part)]
                self.raw, self.buf = self.raw + part, self.buf[len(part):]
                if i < 0:
                    if final and not self.calls.count:  # never became a call: its text is content
                        content.append(self.OPEN + self.raw)
                    break
                if not self.calls.count:
                    content.append(self.OPEN + self.raw + self.CLOSE)
                self.buf, self.inside, self.strip = self.buf[len(self.CLOSE):], False, True
                self.base += self.calls.count
                continue
            if self.strip:  # the whitespace after a call
                self.buf = self.buf.lstrip()
                self.strip = not self.buf
                continue
            i = self.buf.find(self.OPEN)
            if i >= 0:
                content.append(self.buf[:i].rstrip())
                self.buf, self.inside, self.calls, self.raw = self.buf[i + len(self.OPEN):], True, JsonCalls(), ""
                continue
            if final:
                content.append(self.buf)
                self.buf = ""
                break
            body = self.buf[:len(self.buf) - held(self.buf, self.OPEN)].rstrip()  # whitespace waits: a tag may follow
            content.append(body)
            self.buf = self.buf[len(body):]
            break
        return "".join(content), pieces


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2's JSON calls: an output that is {"name": …, "parameters": {…}} (several joined by ";"),
    maybe after <|python_tag|>; any other output is content."""

    TAG = "<|python_tag|>"

    def __init__(self):
        self.buf, self.mode, self.calls = "", "", JsonCalls()  # mode: "" until the first characters decide

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "text":
            return text, []
        self.buf += text  # the whole output: content after all if it holds no call
        if not self.mode:
            s = self.buf.lstrip()
            s = s[len(self.TAG):].lstrip() if s.startswith(self.TAG) else s
            if not final and (not s or self.TAG.startswith(s)):
                return "", []
            if not s.startswith("{"):
                self.mode = "text"
                return self.buf, []
            self.mode, text = "calls", s
        pieces = self.calls.feed(text)
        return (self.buf if final and not self.calls.count else ""), pieces
