"""Default plugin: tool-call parsers (hermes, llama3_json, and auto, which picks by the chat template) and the
think reasoning parser. See docs/tool-calling.md."""

from __future__ import annotations

from llmserve.errors import InvalidRequestError
from llmserve.hookspecs import hookimpl
from llmserve_tools.parsers import HermesParser, Llama3JsonParser
from llmserve_tools.reasoning import ThinkParser

__all__ = ["HermesParser", "Llama3JsonParser", "ThinkParser"]


def auto(tokenizer, tools):
    """The parser whose format the chat template writes: <tool_call> tags (Hermes, Qwen) or Llama 3's JSON."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if HermesParser.OPEN in template:
        return HermesParser()
    if Llama3JsonParser.TAG in template or '"parameters"' in template:
        return Llama3JsonParser()
    raise InvalidRequestError("tool_choice auto (the default with tools) needs a tool parser, and this model's chat "
                              "template shows no tool-call format known to server.tool_parser auto: start the "
                              "server with server.tool_parser set (hermes, llama3_json)", param="tool_choice")


@hookimpl
def register_tool_parsers(register):
    """Register the hermes, llama3_json and auto tool-call parsers."""
    register("hermes", lambda tokenizer, tools: HermesParser())
    register("llama3_json", lambda tokenizer, tools: Llama3JsonParser())
    register("auto", auto)


@hookimpl
def register_reasoning_parsers(register):
    """Register the think reasoning parser (<think>…</think>)."""
    register("think", lambda tokenizer, prompt: ThinkParser(prompt))
