"""Request validation for /v1/completions and /v1/chat/completions.

Plain functions over the decoded JSON (no schema library): every bad value is a 400 whose
`param` names the field. OpenAI fields we accept but that change nothing are listed in
IGNORED_FIELDS; any other unknown field is ignored with a debug log, as vLLM does, so clients
that send extras keep working. docs/openai-compatibility.md lists every field.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from llmserve.request import SamplingParams
from llmserve.server.errors import bad_request

log = logging.getLogger("llmserve.server.protocol")

_MISSING = object()

# OpenAI fields that are accepted and have no effect here (documented)
IGNORED_FIELDS = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "prediction",
                  "reasoning_effort", "verbosity", "modalities", "audio", "web_search_options",
                  "safety_identifier", "prompt_cache_key", "tool_choice"}

_SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "stream_options",
                    "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                    # vLLM's extensions
                    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
                    "priority", "include_stop_str_in_output", "skip_special_tokens", "best_of"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "prompt_logprobs"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                  "functions", "function_call", "response_format", "add_generation_prompt"}


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body into a JSON object, or a 400 saying what is wrong with it."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


class Fields:
    """Typed access to a request's fields; each getter raises a 400 naming the field."""

    def __init__(self, body: dict[str, Any], known: set[str], endpoint: str):
        self.body = body
        extra = [k for k in body if k not in known and k not in IGNORED_FIELDS]
        if extra:
            log.debug("%s: ignoring unknown field(s) %s", endpoint, ", ".join(sorted(extra)))

    def raw(self, name: str, default: Any = None) -> Any:
        v = self.body.get(name, _MISSING)
        return default if v is _MISSING or v is None else v

    def int(self, name: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
        v = self.raw(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"{name} must be an integer, got {json.dumps(v)}", name)
        _range(name, v, lo, hi)
        return v

    def float(self, name: str, default: Any = None, lo: float | None = None, hi: float | None = None) -> Any:
        v = self.raw(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad_request(f"{name} must be a number, got {json.dumps(v)}", name)
        _range(name, v, lo, hi)
        return float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.raw(name, _MISSING)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be true or false, got {json.dumps(v)}", name)
        return v


def _range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo or hi is not None and v > hi:
        if lo is not None and hi is not None:
            raise bad_request(f"{name} must be between {lo} and {hi}, got {v}", name)
        if lo is not None:
            raise bad_request(f"{name} must be at least {lo}, got {v}", name)
        raise bad_request(f"{name} must be at most {hi}, got {v}", name)


@dataclass(slots=True)
class CommonParams:
    """What both endpoints share: the model, sampling parameters, streaming and scheduling."""

    model: str | None
    sampling: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    priority: int


def _stop(f: Fields) -> list[str]:
    v = f.raw("stop", [])
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad_request("stop must be a string or a list of strings", "stop")


def _stop_token_ids(f: Fields) -> list[int]:
    v = f.raw("stop_token_ids", [])
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise bad_request("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    return list(v)


def _logit_bias(f: Fields) -> dict[int, float] | None:
    v = f.raw("logit_bias", None)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("logit_bias must be an object mapping token ids to a bias in [-100, 100]", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if tok < 0:
            raise bad_request(f"logit_bias keys must be non-negative token ids, got {k!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {k}",
                              "logit_bias")
        out[tok] = float(b)
    return out or None


def parse_common(f: Fields, max_tokens: int | None, max_tokens_given: bool) -> CommonParams:
    """The sampling fields; `max_tokens` is resolved by the caller (the two endpoints differ)."""
    model = f.raw("model", None)
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    n = f.int("n", 1, 1, 128)
    best_of = f.int("best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of other than n is not supported (got best_of={best_of}, n={n})", "best_of")
    stream = f.bool("stream", False)
    so = f.raw("stream_options", None)
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request("stream_options may only be set when stream is true", "stream_options")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise bad_request("stream_options.include_usage must be true or false", "stream_options.include_usage")
        include_usage = iu
    top_k = f.int("top_k", 0, -1)
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=f.float("temperature", 1.0, 0.0, 2.0),
        top_p=f.float("top_p", 1.0, 0.0, 1.0),
        top_k=0 if top_k == -1 else top_k,
        min_p=f.float("min_p", 0.0, 0.0, 1.0),
        repetition_penalty=f.float("repetition_penalty", 1.0),
        presence_penalty=f.float("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.float("frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(f),
        seed=f.int("seed", None),
        stop=_stop(f),
        stop_token_ids=_stop_token_ids(f),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        ignore_eos=f.bool("ignore_eos", False),
        min_tokens=f.int("min_tokens", 0, 0),
        n=n,
        skip_special_tokens=f.bool("skip_special_tokens", True),
    )
    if sp.top_p == 0.0:
        raise bad_request("top_p must be greater than 0", "top_p")
    if sp.repetition_penalty <= 0:
        raise bad_request("repetition_penalty must be greater than 0", "repetition_penalty")
    return CommonParams(model=model, sampling=sp, max_tokens_given=max_tokens_given, stream=stream,
                        include_usage=include_usage, priority=f.int("priority", 0))


@dataclass(slots=True)
class CompletionRequest:
    """A validated /v1/completions request; prompts are strings or token-id lists."""

    common: CommonParams
    prompts: list[str | list[int]]
    echo: bool
    logprobs: int | None


def _prompts(v: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if v is _MISSING or v is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        if not v:
            raise bad_request("prompt must not be an empty list", "prompt")
        if is_ids(v):
            return [list(v)]
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(is_ids(x) for x in v):
            return [list(x) for x in v]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", "prompt")


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body."""
    f = Fields(body, COMPLETION_FIELDS, "/v1/completions")
    prompts = _prompts(body.get("prompt", _MISSING))
    echo = f.bool("echo", False)
    max_tokens = f.int("max_tokens", 16, 0)
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
    suffix = f.raw("suffix", None)
    if suffix:
        raise bad_request("suffix is not supported (no fill-in-the-middle model)", "suffix")
    logprobs = f.int("logprobs", None, 0, 5)
    common = parse_common(f, max_tokens, "max_tokens" in body and body["max_tokens"] is not None)
    sp = common.sampling
    sp.logprobs = logprobs
    if echo and logprobs is not None:
        sp.prompt_logprobs = logprobs
    plp = f.int("prompt_logprobs", None, 0, 20)
    if plp is not None:
        sp.prompt_logprobs = plp
    return CompletionRequest(common, prompts, echo, logprobs)


@dataclass(slots=True)
class ChatRequest:
    """A validated /v1/chat/completions request."""

    common: CommonParams
    messages: list[dict[str, Any]]
    logprobs: bool
    top_logprobs: int
    add_generation_prompt: bool = True


_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {role!r}",
                              f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise bad_request(f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                                      f"{where}.content")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None:
            if role != "assistant":
                raise bad_request(f"{where}.content is required for role {role!r}", f"{where}.content")
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    f = Fields(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = _messages(body.get("messages"))
    for name in ("tools", "functions"):
        if f.raw(name, None):
            raise bad_request(f"{name} (function calling) is not supported by this server", name)
    rf = f.raw("response_format", None)
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format")
    mct = f.int("max_completion_tokens", None, 1)
    mt = f.int("max_tokens", None, 1)
    max_tokens = mct if mct is not None else mt
    common = parse_common(f, max_tokens, max_tokens is not None)
    logprobs = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, 0, 20)
    if top is not None and top > 0 and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if logprobs:
        common.sampling.logprobs = top or 0
    return ChatRequest(common, messages, logprobs, top or 0, f.bool("add_generation_prompt", True))
