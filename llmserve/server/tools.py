"""Tool calls and reasoning in chat answers: each choice's text split into reasoning, content and tool calls.

tool_choice auto reads calls with the tool parser plugin named by server.tool_parser; reasoning comes out through
server.reasoning_parser. tool_choice required or a named function is enforced by the grammar (`tool_grammar`), so
its JSON is read here directly, as it streams.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from typing import Any

from llmserve.interfaces import ReasoningParser, ToolCallDelta, ToolParser
from llmserve.json_schema import subschemas
from llmserve.request import StructuredOutput
from llmserve.server.errors import bad_request
from llmserve.server.jsoncalls import JsonCalls


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
    """tool_choice required: the grammar made the output a JSON array of {"name", "parameters"}, read as it streams
    (the calls whole before a max_tokens cut are kept, as is the cut one as far as it came)."""

    def __init__(self):
        self.calls = JsonCalls(depth=2, args=("parameters",))

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


# a function without parameters takes none: OpenAI's "empty parameter list"
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}


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
    if choice == "required":
        items, defs = [], {}
        for i, t in enumerate(tools):
            params, own = _nested(t.function.parameters or EMPTY, i)
            defs |= own
            items.append({"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | ({} if req.parallel_tool_calls
                                                                                else {"maxItems": 1})
        return StructuredOutput("json", json.dumps(schema | ({"$defs": defs} if defs else {})), "tools")
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among tools "
                          f"({', '.join(names)})", "tool_choice.function.name")
    i = names.index(choice.function.name)
    return StructuredOutput("json", json.dumps(tools[i].function.parameters or EMPTY), f"tools[{i}].function.parameters")


def _nested(params: dict, i: int) -> tuple[dict, dict]:
    """Tool i's parameters made to work below the root of tool_choice required's schema: a copy whose `$defs` and
    `definitions` go to the root under names of this tool's own (returned apart), its local `$ref`s pointed there.
    Nested pydantic models come as such refs (the openai SDK's pydantic_function_tool, openai-agents); left as they
    were, "#/$defs/Address" would point at the combined schema's root, where nothing is (vLLM hoists them too)."""
    params = json.loads(json.dumps(params))  # the request's own schema is answered back unchanged elsewhere
    prefix = {"$defs": f"t{i}_", "definitions": f"t{i}d_"}  # digits then "_" or "d_": no two tools' names meet
    whole = False  # a ref into the parameters themselves ("#", "#/properties/…"): they become a def as well

    def moved(ref: str) -> str:
        nonlocal whole
        if ref in ("#", "#/"):
            whole = True
            return f"#/$defs/t{i}"
        if not ref.startswith("#/"):
            return ref  # not local: the grammar engine says what it makes of it
        top, _, rest = ref[2:].partition("/")
        if top in prefix and rest:
            return f"#/$defs/{prefix[top]}{rest}"
        whole = True
        return f"#/$defs/t{i}/{ref[2:]}"

    for _, node in subschemas(params):
        if isinstance(node.get("$ref"), str):
            node["$ref"] = moved(node["$ref"])
    defs = {prefix[key] + name: sub for key in prefix if isinstance(params.get(key), dict)
            for name, sub in params.pop(key).items()}
    if whole:
        defs[f"t{i}"] = params
    return params, defs


def choice_parsers(st: Any, req: Any, sp: Any, prompt: str) -> Callable[[], ChoiceParser] | None:
    """What builds each choice's ChoiceParser for this request; None when the text is all content."""
    server, plugins, tok = st.config.server, st.model.plugins, st.model.tokenizer
    tools = req.template_tools()
    choice = req.tool_choice or ("auto" if tools else "none")
    reason = None if server.reasoning_parser == "none" else plugins.get("reasoning_parser", server.reasoning_parser)
    calls: Callable[[], ToolParser] | None = None
    if tools and choice == "auto":
        if server.tool_parser == "none":
            raise bad_request("tool_choice auto (the default with tools) needs a tool parser: start the server "
                              "with server.tool_parser set (e.g. hermes, llama3_json)", "tool_choice")
        calls = functools.partial(plugins.get("tool_parser", server.tool_parser).factory, tok, tools)
        sp.skip_special_tokens = False  # a call's tags may be special tokens (<|python_tag|>); vLLM does the same
    elif tools and choice != "none":  # enforced by the grammar: there is no text to reason in
        calls, reason = _Required if choice == "required" else functools.partial(_Named, choice.function.name), None
    if reason is None and calls is None:
        return None
    return lambda: ChoiceParser(reason.factory(tok, prompt) if reason else None, calls() if calls else None,
                                req.parallel_tool_calls)


def check(model: Any, server: Any) -> None:
    """A PluginError at start-up when server.tool_parser or server.reasoning_parser names no registered parser."""
    for kind, name in (("tool_parser", server.tool_parser), ("reasoning_parser", server.reasoning_parser)):
        if name != "none":
            model.plugins.get(kind, name)
