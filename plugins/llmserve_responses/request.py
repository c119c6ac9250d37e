"""A POST /v1/responses body: its fields, checked, and the chat request it is served as.

The body is turned into a /v1/chat/completions body (ChatRequest) once: instructions as the first system message,
input items as messages (function_call items as an assistant's tool_calls, function_call_output items as tool
messages), function tools, tool_choice, text.format as response_format. The chat machinery then renders, samples,
constrains and parses it; a 400 it raises is renamed to this body's fields.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from llmserve.request import SamplingParams
from llmserve.server.errors import ApiError, bad_request
from llmserve.server.protocol import ChatRequest, Int, validate
from llmserve_responses.items import new_id

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
# OpenAI's limits on metadata
_META_KEYS, _META_KEY_LEN, _META_VALUE_LEN = 16, 64, 512
# include values whose outputs never occur here (hosted tools, images, encrypted reasoning): accepted, nothing added
_INCLUDE_REFUSED = {"message.output_text.logprobs": "logprobs are not available on /v1/responses here; use "
                                                    "/v1/chat/completions with logprobs"}


class _Model(BaseModel):
    # the chat bodies' rules: JSON's types strictly, unknown fields kept (and ignored)
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class Part(_Model):
    """A content part of a message item: input_text, output_text or refusal (others are refused)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class Item(_Model):
    """An input item: a message, a function_call, a function_call_output or a reasoning item."""

    type: str = "message"  # OpenAI's "easy" message items leave it out
    id: str | None = None
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None


class FunctionTool(_Model):
    """A tool: a function the client runs (any other type is a hosted tool, refused)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Model):
    type: str
    name: str | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored: no model here reads it


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Model):
    """A POST /v1/responses body (OpenAI's fields; docs/openai-compatibility.md lists each)."""

    model: str | None = None
    input: Annotated[str | list[Item], Field(union_mode="left_to_right")]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    _chat: ChatRequest | None = PrivateAttr(default=None)  # what it is served as: set by sampling(), use()

    @property
    def chat(self) -> ChatRequest:
        """The chat request this body is served as."""
        assert self._chat is not None, "sampling() builds it"
        return self._chat

    def use(self, history: list[dict[str, Any]]) -> None:
        """Serve it after the earlier response's items (previous_response_id)."""
        self._chat = self.chat_request(history)

    @property
    def bad_words(self) -> None:
        """vLLM's field, which this API does not have (admit() asks every body)."""
        return None

    def renamed(self, err: ApiError) -> ApiError:
        """An error of the chat request this body is served as, in this body's names (admit() asks every body)."""
        return _renamed(err)

    def sampling(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of the chat request this body is served as (with no earlier response yet)."""
        self._check()
        self.use([])
        try:
            return self.chat.sampling(defaults)
        except ApiError as e:
            raise _renamed(e) from None

    def _check(self) -> None:
        """The rules of this API that the chat body does not have."""
        for name, why in (("background", "background responses are not supported: send the request and wait"),
                          ("conversation", "conversations are not supported: chain responses with "
                                           "previous_response_id"),
                          ("prompt", "stored prompt templates are not supported: send instructions and input")):
            if getattr(self, name):
                raise bad_request(why, name)
        if self.previous_response_id is not None and self.conversation is not None:
            raise bad_request("previous_response_id and conversation cannot both be given", "previous_response_id")
        if self.top_logprobs:
            raise bad_request("top_logprobs are not available on /v1/responses here; use /v1/chat/completions",
                              "top_logprobs")
        for i, inc in enumerate(self.include or ()):
            if inc in _INCLUDE_REFUSED:
                raise bad_request(_INCLUDE_REFUSED[inc], f"include[{i}]")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request("max_output_tokens must be at least 1", "max_output_tokens")
        meta = self.metadata or {}
        if len(meta) > _META_KEYS:
            raise bad_request(f"metadata may hold at most {_META_KEYS} keys, got {len(meta)}", "metadata")
        for k, v in meta.items():
            if len(k) > _META_KEY_LEN or len(v) > _META_VALUE_LEN:
                raise bad_request(f"metadata keys may be at most {_META_KEY_LEN} characters and values at most "
                                  f"{_META_VALUE_LEN}", f"metadata.{k[:_META_KEY_LEN]}")
        hosted = [(i, t.type) for i, t in enumerate(self.tools or ()) if t.type != "function"]
        if hosted:
            names = ", ".join(sorted({t for _, t in hosted}))
            raise bad_request(f"hosted tools cannot run on this server ({names}): only function tools, which the "
                              "client runs, are supported", f"tools[{hosted[0][0]}].type")
        for i, t in enumerate(self.tools or ()):
            if t.name is None:
                raise bad_request("a function tool needs a name", f"tools[{i}].name")
        tc = self.tool_choice
        if isinstance(tc, ToolChoiceFunction):
            if tc.type != "function":
                raise bad_request(f"tool_choice of type {tc.type!r} names a hosted tool, which cannot run on this "
                                  "server", "tool_choice.type")
            if tc.name is None:
                raise bad_request("tool_choice of type function needs a name", "tool_choice.name")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatRequest:
        """The chat body this request is served as; `history`: the earlier response's items (previous_response_id)."""
        body: dict[str, Any] = {"messages": _messages(self.instructions, history, self.input), "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.model is not None:
            body["model"] = self.model
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if getattr(self, ours) is not None:  # left out: the model's defaults, as chat requests get them
                body[theirs] = getattr(self, ours)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        tc = self.tool_choice
        if tc is not None:
            body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}
        try:
            return validate(ChatRequest, json.dumps(body).encode(), "/v1/responses")
        except ApiError as e:
            raise _renamed(e) from None

    @functools.cached_property
    def input_items(self) -> list[dict[str, Any]]:
        """The input as items, each with an id (a text input is one user message), as the store keeps them."""
        items = [Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out = []
        for it in items:
            d = it.model_dump(exclude_none=True)
            d.setdefault("type", "message")
            if "id" not in d:
                d["id"] = new_id(_ID_PREFIXES.get(it.type, "item"))
            if isinstance(d.get("content"), str):  # the text as the part its role writes
                d["content"] = [{"type": "output_text" if it.role == "assistant" else "input_text",
                                 "text": d["content"]}]
            out.append(d)
        return out

    def text_echo(self) -> dict[str, Any]:
        """The response's `text` field: the format asked for (text when none was)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"},
                "verbosity": (self.text.verbosity if self.text else None) or "medium"}


def _messages(instructions: str | None, history: list[dict[str, Any]], input_: str | list[Item]) -> list[dict]:
    """Chat messages of the instructions, the earlier items and the input; a 400 naming the input item it cannot
    take."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    items = [("", Item.model_validate(h)) for h in history]
    items += [("input", Item(role="user", content=input_))] if isinstance(input_, str) else [
        (f"input[{i}]", it) for i, it in enumerate(input_)]
    names: dict[str, str] = {}  # call_id → the function it called, for the tool message
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for param, it in items:
        if it.type == "message":
            role = {"developer": "system"}.get(it.role or "", it.role)
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"a message's role must be user, assistant, system or developer, got {it.role!r}",
                                  f"{param}.role")
            out.append({"role": role, "content": _text(it.content, f"{param}.content")})
            if role == "assistant" and reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif it.type == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(it, field) is None:
                    raise bad_request(f"a function_call item needs {field}", f"{param}.{field}")
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            names[it.call_id] = it.name
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif it.type == "function_call_output":
            if it.call_id is None or it.output is None:
                raise bad_request("a function_call_output item needs call_id and output",
                                  f"{param}.{'call_id' if it.call_id is None else 'output'}")
            msg = {"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, f"{param}.output")}
            if it.call_id in names:
                msg["name"] = names[it.call_id]
            out.append(msg)
        elif it.type == "reasoning":
            # its text (reasoning_text content, else the summary) goes with the assistant turn it led to
            parts = (it.content if isinstance(it.content, list) else None) or it.summary or []
            reasoning = "".join(p.text or "" for p in parts)
        else:
            raise bad_request(f"input items of type {it.type!r} are not supported here (message, function_call, "
                              "function_call_output and reasoning are)", f"{param}.type")
    return out


def _text(content: str | list[Part] | None, param: str) -> str:
    """A message's text: a string, or its text parts joined (refusals as their text)."""
    if content is None:
        raise bad_request("a message needs content", param)
    if isinstance(content, str):
        return content
    out = []
    for i, p in enumerate(content):
        if p.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and p.text is not None:
            out.append(p.text)
        elif p.type == "refusal" and p.refusal is not None:
            out.append(p.refusal)
        else:
            raise bad_request(f"content parts of type {p.type!r} are not supported (this server takes text: "
                              "input_text, output_text, refusal)", f"{param}[{i}]")
    return "".join(out)


# the chat body's names for a field → this body's (first match wins)
_RENAMES = [(re.compile(r"^messages\b.*"), "input"), (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema$"), "text.format.schema"),
            (re.compile(r"^response_format\.json_schema\b"), "text.format"),
            (re.compile(r"^response_format\b.*"), "text.format"),
            (re.compile(r"^tools(\[\d+\])\.function\."), r"tools\1."), (re.compile(r"^tool_choice\.function\."),
                                                                         "tool_choice.")]


def _renamed(e: ApiError) -> ApiError:
    """The chat request's error with `param` in this body's names."""
    if e.param:
        for pattern, repl in _RENAMES:
            if pattern.search(e.param):
                e.param = pattern.sub(repl, e.param, count=1)
                break
    e.message = e.message.replace("response_format", "text.format").replace("max_tokens", "max_output_tokens")
    return e
