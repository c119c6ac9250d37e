"""The bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) as pydantic models, and
their translation into the server's own chat request: the chat template, the sampling defaults, the tool and
reasoning parsers, structured output and stop sequences are then /v1/chat/completions' own.

Types are checked strictly, as JSON has them; a block this server cannot read (an image, a document, a server tool's
result) or a field that would change the answer and is not implemented is a 400 naming it; the fields that change
nothing here are listed in docs/openai-compatibility.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError

from llmserve.request import SamplingParams
from llmserve.server.errors import ApiError, bad_request
from llmserve.server.protocol import ChatRequest, Int


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    """An assistant's earlier reasoning, passed back (its signature is not checked: nothing here signs)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(_Body):
    """Any other block type (image, document, search_result, a server tool's blocks): refused by name."""

    type: str


def _kind(block: Any) -> str:
    """The tag a block is validated under: its type where this server reads it, else "other" (refused by name)."""
    t = block.get("type") if isinstance(block, dict) else None
    return f"{t} block" if t in ("text", "thinking", "redacted_thinking", "tool_use", "tool_result") else "other"


# the tags are not field names, so a path to a bad field reads messages[0].content[1].input, not ….tool_use.input
ResultPart = Annotated[Annotated[TextBlock, Tag("text block")] | Annotated[OtherBlock, Tag("other")],
                       Discriminator(lambda b: "text block" if isinstance(b, dict) and b.get("type") == "text"
                                     else "other")]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False


Block = Annotated[Annotated[TextBlock, Tag("text block")] | Annotated[ThinkingBlock, Tag("thinking block")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking block")]
                  | Annotated[ToolUseBlock, Tag("tool_use block")]
                  | Annotated[ToolResultBlock, Tag("tool_result block")] | Annotated[OtherBlock, Tag("other")],
                  Discriminator(_kind)]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[Block], Field(union_mode="left_to_right")]


class ToolDef(_Body):
    """A client tool: name, description, input_schema (Anthropic-defined and server tools are refused)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    type: str | None = None  # "custom" or absent; anything else names an Anthropic-defined tool
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None  # how hard Claude thinks: nothing here to turn


# what each refused block type is, for its 400
_REFUSED = {"image": "image blocks are not supported: this server's model reads text only",
            "document": "document blocks are not supported: send the document's text in a text block"}


def _refuse(block: OtherBlock, param: str):
    why = _REFUSED.get(block.type, f"content blocks of type {block.type!r} are not supported by this server")
    return bad_request(f"{param}: {why}", param)


def _text(parts: list, param: str) -> str:
    """Text blocks' text, joined by blank lines (each block its own paragraph, as the model would see them)."""
    for i, p in enumerate(parts):
        if isinstance(p, OtherBlock):
            raise _refuse(p, f"{param}[{i}]")
    return "\n\n".join(p.text for p in parts)


class CountTokensRequest(_Body):
    """A /v1/messages/count_tokens body: what renders the prompt (messages, system, tools, tool_choice, thinking)."""

    model: str | None = None
    messages: list[MessageParam]
    system: Annotated[str | list[TextBlock], Field(union_mode="left_to_right")] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[Any] | None = None  # refused when it names any: no server-side MCP here
    container: Any = None  # refused: no code-execution container here

    def chat(self, **fields: Any) -> ChatRequest:
        """The chat request this body is (with the sampling `fields` given), or a 400 naming the field it cannot be."""
        if self.mcp_servers:
            raise bad_request("mcp_servers are not supported: this server connects to no MCP server; call the tools "
                              "from the client", "mcp_servers")
        if self.container is not None:
            raise bad_request("container is not supported: this server runs no code-execution container", "container")
        if not self.messages:
            raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
        body: dict[str, Any] = {"messages": self._messages(), **fields}
        if self.messages[-1].role == "assistant":  # a prefill: the answer continues the last assistant message
            body |= {"continue_final_message": True, "add_generation_prompt": False}
        if self.tools:
            body["tools"] = [self._tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body |= self._tool_choice()
        if self.thinking is not None:  # Qwen3-style templates read it; others ignore it
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as e:  # checked above as Anthropic's fields; a rule of the chat's own is said here
            first = e.errors(include_url=False)[0]
            raise bad_request(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system",
                        "content": self.system if isinstance(self.system, str) else _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            if not m.content and not isinstance(m.content, str):  # (an empty list would leave no message at all)
                raise bad_request(f"messages[{i}].content must hold at least one block", f"messages[{i}].content")
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "user":
                out += _user(m.content, f"messages[{i}].content")
            else:
                out.append(_assistant(m.content, f"messages[{i}].content", last=i == len(self.messages) - 1))
        return out

    def _tool(self, i: int, t: ToolDef) -> dict[str, Any]:
        if t.type not in (None, "custom"):
            raise bad_request(f"tools[{i}]: the Anthropic-defined or server tool type {t.type!r} is not supported; "
                              "send a custom tool (name, description, input_schema)", f"tools[{i}].type")
        if t.input_schema is None or t.input_schema.get("type") != "object":
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema of type object",
                              f"tools[{i}].input_schema")
        fn = {"name": t.name, "parameters": t.input_schema} | ({"description": t.description} if t.description else {})
        return {"type": "function", "function": fn}

    def _tool_choice(self) -> dict[str, Any]:
        tc = self.tool_choice
        if tc.type in ("any", "tool") and not self.tools:
            raise bad_request(f"tool_choice {tc.type} needs tools", "tool_choice")
        if tc.type == "tool" and tc.name is None:
            raise bad_request("tool_choice of type tool needs the tool's name", "tool_choice.name")
        names = [t.name for t in self.tools or ()]
        if tc.type == "tool" and tc.name not in names:  # here, or the chat's rule would name its own field
            raise bad_request(f"tool_choice names the tool {tc.name!r}, which is not among tools ({', '.join(names)})",
                              "tool_choice.name")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or {
            "type": "function", "function": {"name": tc.name}}
        return {"tool_choice": choice, "parallel_tool_calls": not tc.disable_parallel_tool_use}


def _user(blocks: list, param: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, its text as a user message, in their order."""
    out: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{param}[{j}]"
        if isinstance(b, ToolResultBlock):
            text = b.content if isinstance(b.content, str) else _text(b.content, f"{at}.content")
            # a template has no error flag: the model reads it in the result's text
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": "Error: " + text if b.is_error
                        else text})
        elif isinstance(b, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + b.text
            else:
                out.append({"role": "user", "content": b.text})
        elif isinstance(b, OtherBlock):
            raise _refuse(b, at)
        else:
            raise bad_request(f"{at}: a {b.type} block belongs in an assistant message", at)
    return out


def _assistant(blocks: list, param: str, last: bool) -> dict[str, Any]:
    """An assistant turn: its text, its reasoning (thinking blocks) and its tool calls as one chat message."""
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{param}[{j}]"
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            if last:
                raise bad_request(f"{at}: the last message is an assistant's tool_use; send its tool_result in a "
                                  "user message", at)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}})
        elif isinstance(b, OtherBlock):
            raise _refuse(b, at)
        elif isinstance(b, ToolResultBlock):
            raise bad_request(f"{at}: a tool_result block belongs in a user message", at)
        # redacted_thinking: nothing a local model can read
    msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(text)}
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


class MessagesRequest(CountTokensRequest):
    """A /v1/messages body: the prompt's fields, max_tokens (required), sampling, stop_sequences and stream."""

    max_tokens: Int
    stop_sequences: list[str] = []
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: for Anthropic's abuse checks, nothing here
    service_tier: str | None = None  # one tier here
    bad_words: ClassVar[None] = None  # what admit() reads of a generation body: none here
    _chat: ChatRequest | None = PrivateAttr(default=None)

    @property
    def chat_request(self) -> ChatRequest:
        """The chat request this body became in sampling()."""
        assert self._chat is not None, "sampling() builds it"
        return self._chat

    @staticmethod
    def renamed(err: ApiError) -> ApiError:
        """A grammar error of the chat request this body is served as, in this body's names (admit() asks)."""
        err.param = {"response_format.json_schema.schema": "output_config.format.schema"}.get(err.param, err.param)
        if err.param and err.param.startswith("tools[") and err.param.endswith("].function.parameters"):
            err.param = err.param.removesuffix(".function.parameters") + ".input_schema"
        return err

    def sampling(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of this body, through the chat request it is (the chat endpoint's rules and defaults)."""
        if self.max_tokens < 1:
            raise bad_request("max_tokens must be at least 1", "max_tokens")
        t = self.thinking
        if t is not None and t.type == "enabled":
            if t.budget_tokens is None:
                raise bad_request("thinking of type enabled needs budget_tokens", "thinking.budget_tokens")
            if not 1 <= t.budget_tokens < self.max_tokens:
                raise bad_request(f"thinking.budget_tokens ({t.budget_tokens}) must be at least 1 and less than "
                                  f"max_tokens ({self.max_tokens})", "thinking.budget_tokens")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k") if getattr(self, k) is not None}
        self._chat = self.chat(max_tokens=self.max_tokens, stop=self.stop_sequences, stream=self.stream, **given)
        return self._chat.sampling(defaults)
