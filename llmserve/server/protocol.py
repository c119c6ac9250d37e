"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models, and their SamplingParams.

The models check types, strictly as JSON has them ("1" is not a number, "yes" is not true);
SamplingParams.validate checks ranges; the rules that tie fields together are in `sampling()`.
Every failure is a 400 whose `param` is the field's path (`messages[2].content`). OpenAI fields
that are accepted and change nothing are in IGNORED_FIELDS; known fields that would change the output
and are not implemented are in UNSUPPORTED_FIELDS (a 400 naming them); any other unknown field is
ignored with a debug log, as vLLM ignores them. docs/openai-compatibility.md lists every field.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import models_json_schema

from llmserve.errors import InvalidRequestError
from llmserve.request import SamplingParams, StructuredOutput, apply_generation_defaults
from llmserve.server.errors import bad_request
from llmserve.server.strict import check_strict
from llmserve.server.tools import EMPTY, tool_grammar

log = logging.getLogger("llmserve.server.protocol")

# OpenAI and vLLM fields that are accepted and have no effect on the output here (documented)
IGNORED_FIELDS = {"user", "store", "metadata", "service_tier", "prediction", "reasoning_effort",
                  "safety_identifier", "prompt_cache_key", "request_id", "guided_decoding_backend",
                  "kv_transfer_params", "mm_processor_kwargs", "media_io_kwargs"}
# fields that would change the output and are not implemented → the values accepted (their no-op ones);
# any other value is a 400 naming the field, so no client is silently given something else (null: absent)
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "early_stopping": (False,), "prompt_embeds": (),
    "logits_processors": ([],), "vllm_xargs": ({},), "return_token_ids": (False,), "structural_tag": (),
    "spaces_between_special_tokens": (True,), "audio": (), "modalities": (["text"],), "web_search_options": (),
    "verbosity": ("medium",),
    "echo": (False,), "prompt_logprobs": (),  # chat only: completions implement them
}

# the sampling fields a model's generation_config.json gives defaults for (max_tokens: the routes')
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# JSON has one number type: 16.0 is the integer 16 (strict mode alone would refuse it)
Int = Annotated[int, BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None  # the schema is always enforced; strict true also refuses open objects (OpenAI's rules)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def sampling_defaults(model_defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a request that leaves them out gets: the model's defaults, else the API's."""
    return _defaulted({k: _Request.model_fields[k].default for k in _MODEL_DEFAULTS}, set(), model_defaults)


def _defaulted(values: dict[str, Any], given: set[str], model_defaults: dict[str, Any]) -> dict[str, Any]:
    """Each sampling field a model may default: its value where the client gave it, else the model's default, else
    its value (the API's default)."""
    return values | apply_generation_defaults(model_defaults, {k: values[k] for k in given if k in values},
                                                       _MODEL_DEFAULTS)


def _json_text(schema: Any) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)


class _Request(_Model):
    """The fields both endpoints share: types and defaults only."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: Int = 1
    best_of: Int | None = None
    stop: str | list[str] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: Int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: Int = 0
    priority: Int = 0
    # vLLM's field: prefix-cache blocks are shared only between requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # constraints: one grammar (response_format, structured_outputs or guided_*), and token masks
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = None  # keep the prompt's last k tokens (-1: as many as fit)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body: Any) -> Any:
        # clients send null for "not set"; it means the default, as in OpenAI's API
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    def _structured(self) -> StructuredOutput | None:
        """The one grammar the body asks for (a 400 naming the fields when it asks for several)."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  "response_format.json_schema")
            param = "response_format.json_schema.schema"
            if rf.json_schema.strict:
                check_strict(rf.json_schema.schema_, f"response_format {rf.json_schema.name!r}", param)
            found.append(StructuredOutput("json", _json_text(rf.json_schema.schema_), param))
        so = self.structured_outputs
        for field_, kind, value in (
                ("structured_outputs.json", "json", so and so.json_), ("structured_outputs.regex", "regex", so and so.regex),
                ("structured_outputs.choice", "choice", so and so.choice),
                ("structured_outputs.grammar", "grammar", so and so.grammar),
                ("structured_outputs.json_object", "json_object", so and so.json_object),
                ("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar)):
            if value is None or (kind == "json_object" and value is False):
                continue
            if kind == "choice" and not value:
                raise bad_request(f"{field_} must list at least one string", field_)
            text = "" if kind == "json_object" else _json_text(value) if kind in ("json", "choice") else value
            found.append(StructuredOutput(kind, text, field_))
        if len(found) > 1:
            raise bad_request("only one structured output constraint may be given, got "
                              + ", ".join(f.param for f in found), found[1].param)
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def truncated(self, ids: list[int], max_model_len: int, max_tokens: int | None) -> list[int]:
        """The prompt after truncate_prompt_tokens: its last k ids (-1: as many as leave room for max_tokens)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k > max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({k}) exceeds the context length ({max_model_len})",
                              "truncate_prompt_tokens")
        if k == -1 and (max_tokens or 1) >= max_model_len:
            raise bad_request(f"max_tokens ({max_tokens}) leaves no room for a prompt in the context length "
                              f"({max_model_len})", "max_tokens")
        return ids[-(max_model_len - (max_tokens or 1) if k == -1 else k):]

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                  renamed: dict[str, str] | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams, range-checked here once; `renamed` maps their field names to this body's;
        `defaults` (the model's generation_config) fills the sampling fields the client left out."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of other than n is not supported (got best_of={self.best_of}, n={self.n})",
                              "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options may only be set when stream is true", "stream_options")
        if self.truncate_prompt_tokens not in (None, -1) and self.truncate_prompt_tokens < 1:
            raise bad_request("truncate_prompt_tokens must be -1 or a positive integer", "truncate_prompt_tokens")
        # the model's defaults (its generation_config.json) stand in for the sampling fields the client left out
        d = _defaulted({k: getattr(self, k) for k in _MODEL_DEFAULTS}, self.model_fields_set, defaults or {})
        try:
            bias = {int(k): b for k, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=d["temperature"], top_p=d["top_p"],
            top_k=0 if d["top_k"] == -1 else d["top_k"], min_p=d["min_p"],
            repetition_penalty=d["repetition_penalty"], presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=bias or None, seed=self.seed,
            stop=[s for s in stop if s], stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=self.n,
            skip_special_tokens=self.skip_special_tokens, structured=self._structured(),
            allowed_token_ids=self.allowed_token_ids)
        try:
            sp.validate()
        except InvalidRequestError as e:
            raise bad_request(str(e), (renamed or {}).get(e.param, e.param)) from None
        return sp


# what a route plugin's generation body builds on (its sampling fields, their checks and defaults)
GenerationRequest = _Request


class CompletionRequest(_Request):
    """A /v1/completions body; prompts are strings or token-id lists."""

    # tried in this order; pydantic's default "smart" union tries every member (4x the cost on 1k ids)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]
    max_tokens: Int = 16
    echo: bool = False
    logprobs: Int | None = None
    suffix: str | None = None
    prompt_logprobs: Int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) open a text prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: score the prompt, generate nothing (the engine still takes one step)."""
        return self.max_tokens == 0

    def sampling(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of this body, after the rules that tie its fields together."""
        if not self.prompt:
            raise bad_request("prompt must not be an empty list", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
        if self.suffix:
            raise bad_request("suffix is not supported (no fill-in-the-middle model)", "suffix")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come with the whole answer only
            raise bad_request("prompt_logprobs are not available when streaming", "prompt_logprobs")
        echoed = self.logprobs if self.echo else None  # the prompt's logprobs come back with the echoed prompt
        return self._sampling(self.max_tokens or 1, self.logprobs,
                              self.prompt_logprobs if self.prompt_logprobs is not None else echoed, defaults=defaults)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's field)


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Model):
    name: str


class ToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Request):
    """A /v1/chat/completions body."""

    messages: list[Message]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None  # None: auto with tools, else none
    parallel_tool_calls: bool = True
    functions: Any = None  # the legacy function-calling fields are refused
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused: only the server's template renders
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's: the template already writes the special tokens

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates and tool parsers take them: OpenAI's shape."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: text parts joined, a null content empty, tool fields
        kept, and call arguments as objects (as vLLM hands them: Qwen2.5's and Llama 3's templates want that)."""
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
            d = {"role": m.role, "content": content} | m.model_dump(
                include={"name", "tool_call_id", "tool_calls", "reasoning_content"}, exclude_none=True)
            for c in d.get("tool_calls", ()):
                c["function"]["arguments"] = _json_object(c["function"]["arguments"])
            out.append(d)
        return out

    def sampling(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The SamplingParams of this body, after the rules that tie its fields together."""
        if not self.messages:
            raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                raise bad_request(f"messages[{i}].content is required for role {m.role!r}", f"messages[{i}].content")
            if m.role == "tool" and m.tool_call_id is None:
                raise bad_request(f"messages[{i}].tool_call_id is required for role 'tool'", f"messages[{i}].tool_call_id")
        for i, t in enumerate(self.tools or ()):
            if t.function.strict:
                check_strict(t.function.parameters or EMPTY, f"function {t.function.name!r}",
                             f"tools[{i}].function.parameters", "invalid_function_parameters")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} (legacy function calling) is not supported: send tools and tool_choice",
                                  name)
        if self.chat_template is not None:
            raise bad_request("chat_template in a request is not accepted (vLLM's default too): start the server "
                              "with --chat-template FILE", "chat_template")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false", "continue_final_message")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        given = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        sp = self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                            renamed={"max_tokens": given, "logprobs": "top_logprobs"}, defaults=defaults)
        sp.structured = tool_grammar(self, sp.structured)
        return sp


class TokenizeRequest(_Model):
    """A /tokenize body with a prompt (vLLM's shape; TokenizeChatRequest is the one with messages)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatRequest):
    """A /tokenize body with chat messages: rendered as /v1/chat/completions renders them."""

    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Int]


def _json_object(text: str) -> Any:
    """text parsed, when it is a JSON object; else text as it is."""
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
        return text
    return v if isinstance(v, dict) else text


# the names a path is made of; pydantic's loc also holds union-member tags ("list[int]") and "[key]"
_FIELDS = set().union(*(m.model_fields for m in (CompletionRequest, ChatRequest, Message, TextPart, StreamOptions,
                                                  ResponseFormat, JsonSchemaFormat, StructuredOutputs, ToolCall,
                                                  FunctionCall, Tool, FunctionDef, ToolChoice, TokenizeRequest,
                                                  TokenizeChatRequest, DetokenizeRequest)),
                      {"json", "schema"})


def parse(model: type[_Request], raw: bytes, endpoint: str,
          defaults: dict[str, Any] | None = None) -> tuple[Any, SamplingParams]:
    """Decode and validate a request body into the model and its SamplingParams, or a 400 naming the field."""
    req = validate(model, raw, endpoint)
    return req, req.sampling(defaults)


def validate(model: type[_Model], raw: bytes, endpoint: str) -> Any:
    """Decode and type-check a body, or a 400 naming the first bad or unsupported field."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise _bad_body(e, _FIELDS | _names(model)) from None
    for k, v in req.model_extra.items():
        if k in UNSUPPORTED_FIELDS and v not in UNSUPPORTED_FIELDS[k]:
            raise bad_request(f"{k} is not supported by this server (got {json.dumps(v)[:80]}); "
                              "see docs/openai-compatibility.md", k)
    extra = [k for k in req.model_extra if k not in IGNORED_FIELDS and k not in UNSUPPORTED_FIELDS]
    if extra:
        log.debug("%s: ignoring unknown field(s) %s", endpoint, ", ".join(sorted(extra)))
    return req


@functools.cache
def _names(model: type[BaseModel]) -> frozenset[str]:
    """The field names and aliases of model and of every model its fields hold, at any depth (a route plugin's
    body model too): the parts an error's path is made of."""
    names: set[str] = set()
    seen: set[type] = set()
    todo: list[Any] = [model]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            if t in seen:
                continue
            seen.add(t)
            for name, f in t.model_fields.items():
                names.update(n for n in (name, f.alias) if n)
                todo.append(f.annotation)
        else:
            todo.extend(typing.get_args(t))
    return frozenset(names)


def _bad_body(e: ValidationError, fields: set[str]):
    """The 400 for pydantic's errors under the first bad field; `param` is its path, less union-member tags."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return bad_request("the request body must be a JSON object")
    # a union reports one error per member type: say each, and name the path they share as `param`
    shared, parts = None, []
    for x in errors:
        if x["loc"][:1] != first["loc"][:1]:
            continue
        loc = [p for p in x["loc"] if isinstance(p, int) or p in fields]
        shared = loc if shared is None else [a for a, b in itertools.takewhile(lambda ab: ab[0] == ab[1],
                                                                               zip(shared, loc))]
        got = "" if isinstance(x["input"], (dict, list)) else f", got {json.dumps(x['input'])[:80]}"
        parts.append(f"{_path(loc)}: {x['msg']}{got}")
    return bad_request("; or ".join(dict.fromkeys(parts)), _path(shared))


def _path(loc: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


@functools.cache  # the models do not change while the server runs
def openapi() -> dict[str, Any]:
    """The OpenAPI document of the two generation endpoints, from the request models."""
    refs, schemas = models_json_schema([(CompletionRequest, "validation"), (ChatRequest, "validation")],
                                       ref_template="#/components/schemas/{model}")

    def post(model: type[_Request], summary: str) -> dict[str, Any]:
        error = {"description": "OpenAI's error body: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": "the completion, or server-sent events when stream is true"},
                          "400": error, "404": error, "429": error, "503": error}}}

    return {"openapi": "3.1.0", "info": {"title": "llmserve", "version": "1"},
            "paths": {"/v1/completions": post(CompletionRequest, "Create a completion"),
                      "/v1/chat/completions": post(ChatRequest, "Create a chat completion")},
            "components": {"schemas": schemas.get("$defs", {})}}


def plugin_openapi(model: type[BaseModel], summary: str, answer: str) -> dict[str, Any]:
    """What a route plugin passes as register(..., openapi=) for a POST whose JSON body is `model`: its path item
    (`answer` describes the 200) and the component schemas it refers to."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    error = {"description": "OpenAI's error body: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
    return {"path": {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
        "responses": {"200": {"description": answer}, "400": error, "404": error, "429": error, "503": error}}},
        "schemas": {**defs, model.__name__: schema}}
