"""The checks only an engine can make: token ids against its vocabulary, length against its context.

check_prompt is the engine's rule (Engine.add_request calls it); the server calls check_request,
which adds the API's rule that prompt + max_tokens must fit, before it submits anything, so a
bad prompt is a 400 with OpenAI's wording before a stream starts. Offline, the engine instead
stops a generation at the context length, as vLLM's offline engine does.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.errors import InvalidRequestError
from llmserve.request import SamplingParams


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                 param: str = "prompt", generates: bool = True) -> None:
    """Raise InvalidRequestError unless the ids are in the vocabulary and the prompt leaves room to generate (an
    input to embed, generates False, may fill the context)."""
    n = len(prompt_token_ids)
    if not n:
        raise InvalidRequestError(f"{param} is empty: it has no tokens", param=param)
    if not generates and n > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, {param} has {n} tokens. "
            "Please reduce the input (or set truncate_prompt_tokens).", param=param, code="context_length_exceeded")
    if generates and n >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {n} tokens, "
            "which leaves no room for the completion. Please reduce the length of the prompt.",
            param=param, code="context_length_exceeded")
    # after the length check, so an over-long prompt costs nothing here; set(map(type)) and min/max
    # run in C: a prompt that fits costs microseconds, not a Python loop
    if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = next(t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab_size)
        raise InvalidRequestError(f"token id {bad!r} in {param} is outside the vocabulary [0, {vocab_size})",
                                  param=param)
    for t in params.logit_bias or ():
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"logit_bias token {t} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  param: str = "prompt") -> None:
    """check_prompt, and the API's rule: prompt + max_tokens must fit the context (a 400, as OpenAI answers)."""
    check_prompt(prompt_token_ids, params, vocab_size, max_model_len, param)
    n = len(prompt_token_ids)
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
            "Please reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
