"""The "llguidance" grammar engine: JSON schema, regex, choice and Lark grammars on llguidance's matcher."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import torch

from llmserve.errors import InvalidRequestError
from llmserve.interfaces import GrammarEngine, GrammarMatcher, Tokenizer
from llmserve.request import StructuredOutput

# a free-form JSON object (response_format json_object)
OBJECT_SCHEMA = '{"type": "object"}'


class _Vocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer: the token bytes, EOS, and an encoder."""

    bos_token_id = None

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokens = tokenizer.vocab_bytes()
        self.tokens += [b""] * (vocab_size - len(self.tokens))  # ids the model has and the tokenizer lacks
        self.eos_token_id = tokenizer.eos_token_id
        self.special_token_ids = sorted(tokenizer.all_special_ids)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


def to_grammar(spec: StructuredOutput, whitespace_flexible: bool) -> str:
    """llguidance's grammar text for a constraint (not yet validated)."""
    if spec.kind in ("json", "json_object"):
        try:
            schema = json.loads(spec.value if spec.kind == "json" else OBJECT_SCHEMA)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=spec.param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema is an object or a boolean", param=spec.param)
        # compact JSON by default: a small model given free whitespace may emit it forever
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": whitespace_flexible})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return "start: " + " | ".join(json.dumps(c) for c in choices)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise InvalidRequestError(f"unknown constraint kind {spec.kind!r}", param=spec.param)


class LLGuidanceMatcher(GrammarMatcher):
    """One sequence's llguidance matcher."""

    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher):
        self._m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (llguidance writes the words in place)."""
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token."""
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        """True once the grammar allows no further token."""
        return self._m.is_stopped()


class LLGuidanceEngine(GrammarEngine):
    """Compiles constraints to llguidance matchers over one tokenizer (built once: ~1 s for a 150k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, whitespace_flexible: bool = False):
        vocab = _Vocab(tokenizer, vocab_size)
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size)
        self.whitespace_flexible = whitespace_flexible
        # the step's masks are filled before the forward, while torch's threads wait: use as many
        self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A validated matcher at the grammar's start, kept as the prototype that matcher() copies."""
        try:
            grammar = to_grammar(spec, self.whitespace_flexible)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{spec.param}: {e}", param=spec.param) from None
        except ValueError as e:  # llguidance's own refusal of a schema it cannot read
            raise InvalidRequestError(f"{spec.param}: {e}", param=spec.param) from None
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"{spec.param}: {_short(m.get_error())}", param=spec.param)
        return m

    def matcher(self, compiled: llguidance.LLMatcher) -> GrammarMatcher:
        """A fresh copy of the prototype (no recompilation)."""
        return LLGuidanceMatcher(compiled.deep_copy())

    def fill_bitmasks(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> None:
        """All rows of the step in parallel on llguidance's threads (it releases the GIL)."""
        self._executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])


def _short(error: str) -> str:
    """llguidance's error without its internal trace lines."""
    lines = [ln for ln in error.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] if lines else "invalid grammar"

