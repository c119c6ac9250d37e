"""Sampling parameters, the engine's per-request state and the outputs it returns."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import InvalidRequestError

# integer fields above this are refused (the sampler's tensors hold int64; nothing needs more than int32)
INT_MAX = 2**31 - 1
# lists a sequence's every token is checked against: bounded, so that one request cannot slow every step
# (300k stop strings made a concurrent stream 20x slower; OpenAI takes 4 stop strings, vLLM any number)
MAX_STOPS = 256  # stop strings, and stop_token_ids
MAX_BAD_WORDS = 1024


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    PREFILL = "prefill"  # prompt being computed, possibly over several steps (chunked)
    DECODE = "decode"  # generating one token per step
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller (client went away)
    ERROR = "error"  # FAILED: the message says why


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow; `param` is the request field it came from (named in errors)."""

    kind: str  # json (a JSON schema, serialized) | json_object | regex | choice (a JSON list) | grammar (Lark)
    value: str = ""
    param: str = "response_format"


@dataclass(slots=True)
class SamplingParams:
    """What to generate and how; field names follow the OpenAI API and vLLM's extensions."""

    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # same for prompt tokens (echo)
    n: int = 1
    skip_special_tokens: bool = True
    detokenize: bool = True
    # constraints, applied as one token mask per step (llmserve/constraints.py)
    structured: StructuredOutput | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # token sequences that may not be completed

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_tokens", "top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, int) and v > INT_MAX:
                bad(name, f"{name} must be at most {INT_MAX}, got {v}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", f"seed must be a 64-bit integer, got {self.seed}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            bad("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {v}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            bad("n", f"n must be between 1 and 128, got {self.n}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= 20):
                bad(name, f"{name} must be between 0 and 20, got {v}")
        for name in ("stop", "stop_token_ids"):
            if len(getattr(self, name)) > MAX_STOPS:
                bad(name, f"{name} may hold at most {MAX_STOPS} entries, got {len(getattr(self, name))}")
        wrong = next((t for t in self.stop_token_ids if t < 0 or t > INT_MAX), None)
        if wrong is not None:
            bad("stop_token_ids", f"stop_token_ids must be non-negative token ids, got {wrong}")
        if self.bad_words_token_ids is not None and len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            bad("bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if not -100.0 <= b <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {b} for token {tok}")


def apply_generation_defaults(defaults: dict[str, Any], given: dict[str, Any], fields: Iterable[str],
                              room: int | None = None) -> dict[str, Any]:
    """Each of `fields`: the caller's value where given, else the model's default (a max_tokens at most `room`,
    the context the prompt leaves), else left out: the one place a model's generation defaults are applied."""
    out: dict[str, Any] = {}
    for k in fields:
        if k in given:
            out[k] = given[k]
        elif k in defaults:
            out[k] = min(defaults[k], room) if k == "max_tokens" and room is not None else defaults[k]
    return out


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request: the prompt's final hidden states pooled into one vector instead of a sampled token."""

    kind: str | None = None  # last | mean | cls (llmserve.pooling.POOLING_TYPES); None: the model's own
    normalize: bool = True  # L2-normalize the vector (after cutting it to `dimensions`)
    dimensions: int | None = None  # keep the vector's first dimensions (Matryoshka models); None: all of it


_seq_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    """The engine's state of one sequence; the scheduler and allocator read it, only the engine writes tokens."""

    request_id: str  # unique per sequence: the caller's id, or "<id>#<i>" for the i-th of n
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    group_id: str = ""  # the id the caller knows; several sequences share it when n > 1
    index: int = 0  # which of the caller's n completions this is
    # every token so far: prompt then output; the backend reads token_ids[num_computed_tokens:]
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    error_param: str | None = None  # the field whose value made it fail (a client error: the server answers 400)
    unavailable: bool = False  # it failed because the backend could not be reached (the server answers 503)
    max_total_tokens: int = 0  # prompt + output may not exceed this (max_tokens and context length)
    # prefix-cache blocks are shared only between requests of the same salt (vLLM's cache_salt)
    cache_salt: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # an embedding sequence (its kind resolved to the model's): it ends after its prefill with a pooled vector
    pooling: PoolingParams | None = None
    pooled: list[float] | None = None  # the pooled rows of the prefill chunks computed so far (llmserve/pooling.py)
    # prefill the whole prompt in one step: a bidirectional encoder's attention cannot be split into chunks
    whole_prompt: bool = False
    arrival_seq: int = field(default_factory=lambda: next(_seq_counter))  # FCFS tie-breaker
    # timing, for metrics (perf_counter seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    # outputs not yet handed to the caller
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    detok: object | None = None  # IncrementalDetokenizer when text is wanted

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prefill may skip cached prefix blocks: not where every prompt position's output is wanted
        (prompt logprobs, mean or CLS pooling, an encoder's attention)."""
        if self.sampling.prompt_logprobs is not None:
            return False
        return self.pooling is None or (self.pooling.kind == "last" and not self.whole_prompt)

    @property
    def extends_prefix_cache(self) -> bool:
        """Whether its full blocks join the prefix cache: an embedding's do not (see docs/embeddings.md)."""
        return self.pooling is None


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token and the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int = 1  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one of the caller's sequences (a delta, not the whole text)."""

    request_id: str  # the caller's id (shared by the n completions of one request)
    index: int  # which completion, 0..n-1
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None  # set when the request's own values made it fail: a client error naming them
    unavailable: bool = False  # it failed because the backend could not be reached: 503, worth a retry
    logprobs: list[Logprob] | None = None  # one per new token when asked for
    prompt_logprobs: list[Logprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, in total
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: list[float] | None = None  # an embedding sequence's pooled vector, in its finished output

    def extend(self, later: RequestOutput) -> None:
        """Join a later delta of the same sequence onto this one (its tokens, text and logprobs after these; its
        state, which is the newer)."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        for f in ("finished", "finish_reason", "stop_reason", "error", "error_param", "unavailable", "num_prompt_tokens",
                  "num_output_tokens", "num_cached_tokens", "embedding"):
            setattr(self, f, getattr(later, f))
