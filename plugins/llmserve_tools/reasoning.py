"""The think reasoning parser: <think>…</think> at the start of the output (or opened by the prompt) is
reasoning (DeepSeek-R1, Qwen3, QwQ); the rest is content."""

from __future__ import annotations

from llmserve.interfaces import ReasoningParser
from llmserve_tools.parsers import held


class ThinkParser(ReasoningParser):
    """Moves <think>…</think> into reasoning_content; content starts after it, less the whitespace that follows."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, prompt: str = ""):
        self.buf = ""
        # a template that opens the block itself (DeepSeek-R1) leaves the output inside it
        self.state = "reasoning" if prompt.rstrip().endswith(self.OPEN) else "start"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = ""
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(self.OPEN):
                self.buf, self.state = s[len(self.OPEN):], "reasoning"
            elif not final and self.OPEN.startswith(s):  # nothing yet, or maybe the tag's beginning
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(self.CLOSE)
            if i < 0:
                n = len(self.buf) - (0 if final else held(self.buf, self.CLOSE))
                reasoning, self.buf = self.buf[:n], self.buf[n:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(self.CLOSE):], "after"
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return reasoning, ""
            self.state = "content"
        content, self.buf = self.buf, ""
        return reasoning, content
