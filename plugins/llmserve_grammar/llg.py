"""The "llguidance" grammar engine: JSON schema, regex, choice and Lark grammars on llguidance's matcher."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any

import llguidance
import torch

from llmserve.errors import InvalidRequestError
from llmserve.interfaces import GrammarEngine, GrammarMatcher, Tokenizer
from llmserve.json_schema import close_objects
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


def to_grammar(spec: StructuredOutput, whitespace_flexible: bool, open_objects: bool = False) -> str:
    """llguidance's grammar text for a constraint (not yet validated); objects closed unless open_objects."""
    if spec.kind in ("json", "json_object"):
        try:
            schema = json.loads(spec.value if spec.kind == "json" else OBJECT_SCHEMA)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=spec.param) from None
        except RecursionError:  # a schema sent as a string is parsed here, past the body parser's depth limit
            raise InvalidRequestError("the JSON schema is nested too deeply", param=spec.param) from None
        if schema is False or not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema is an object (or true); false allows no value", param=spec.param)
        schema = {} if schema is True else schema if open_objects else close_objects(schema)
        # compact JSON by default: a small model given free whitespace may emit it forever
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": whitespace_flexible})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # one lexer terminal, not parser alternatives: 50,000 choices would pass the parser's row limit
        return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in json.loads(spec.value))
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise InvalidRequestError(f"unknown constraint kind {spec.kind!r}", param=spec.param)


class LLGuidanceMatcher(GrammarMatcher):
    """One sequence's llguidance matcher."""

    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher):
        self._m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row]; ValueError when the grammar hits llguidance's limits."""
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)
        if self._m.is_error():
            raise ValueError(_short(self._m.get_error()))

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; ValueError when the grammar hits llguidance's limits on it."""
        if self._m.consume_token(token_id):
            return True
        if self._m.is_error():  # e.g. a recursive schema past the parser's item limit, on the first token it allowed
            raise ValueError(_short(self._m.get_error()))
        return False

    def is_terminated(self) -> bool:
        """True once the grammar allows no further token."""
        return self._m.is_stopped()


class LLGuidanceEngine(GrammarEngine):
    """Compiles constraints to llguidance matchers over one tokenizer (built once: ~1 s for a 150k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, whitespace_flexible: bool = False,
                 open_objects: bool = False):
        # built in a thread: it took 1.3 s of every start and only a constrained request needs it (compile() waits).
        # Not a daemon: a process that ended meanwhile would stop it inside llguidance's Rust code, where the
        # interpreter's exit (pthread_exit on retaking the GIL) unwinds through frames that cannot be unwound, a
        # segfault in one exit of two; the exit waits for it instead
        self._tokenizer = concurrent.futures.Future()
        threading.Thread(target=self._build, args=(tokenizer, vocab_size), name="llmserve-llguidance-vocab").start()
        self.whitespace_flexible, self.open_objects = whitespace_flexible, open_objects

    def _build(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        try:
            vocab = _Vocab(tokenizer, vocab_size)
            self._tokenizer.set_result(llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size))
        except BaseException as e:  # told to the first request that needs it
            self._tokenizer.set_exception(e)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (waits for the thread that builds it)."""
        return self._tokenizer.result()

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A validated matcher at the grammar's start, kept as the prototype that matcher() copies."""
        try:
            grammar = to_grammar(spec, self.whitespace_flexible, self.open_objects)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{spec.param}: {e}", param=spec.param) from None
        except ValueError as e:  # llguidance's own refusal of a schema it cannot read
            raise InvalidRequestError(f"{spec.param}: {e}", param=spec.param) from None
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"{spec.param}: {_short(m.get_error())}", param=spec.param)
        # the first mask on a copy: a grammar past llguidance's limits (a{1000000}) fails only here, and
        # one that matches nothing allows no token; either is the client's to fix, not a failure mid-stream
        first = torch.zeros((1, (self.tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
        try:  # twice: copies share the lexer, and one past its limits may fail only on the second mask
            for _ in range(2):
                probe = LLGuidanceMatcher(m.deep_copy())
                probe.fill_bitmask(first, 0)
            if not first.any():
                raise InvalidRequestError(f"{spec.param}: the grammar matches no text", param=spec.param)
            # and one token on: a schema that recurses without end passes both masks and fails on its first token
            word = int(first[0].nonzero()[0])
            bits = int(first[0, word]) & 0xFFFFFFFF
            probe.accept(32 * word + (bits & -bits).bit_length() - 1)
        except ValueError as e:
            raise InvalidRequestError(f"{spec.param}: {e}", param=spec.param) from None
        return m

    def matcher(self, compiled: llguidance.LLMatcher) -> GrammarMatcher:
        """A fresh copy of the prototype (no recompilation)."""
        return LLGuidanceMatcher(compiled.deep_copy())


def _short(error: str) -> str:
    """llguidance's error without its internal trace lines."""
    lines = [ln for ln in error.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] if lines else "invalid grammar"

