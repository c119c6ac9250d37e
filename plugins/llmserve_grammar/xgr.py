"""The "xgrammar" grammar engine (optional: `pip install xgrammar`), the same constraints on xgrammar's matcher."""

from __future__ import annotations

import json
from typing import Any

import xgrammar

from llmserve.errors import InvalidRequestError
from llmserve.interfaces import GrammarEngine, GrammarMatcher, Tokenizer
from llmserve.request import StructuredOutput
from llmserve_grammar.llg import OBJECT_SCHEMA


class XGrammarMatcher(xgrammar.GrammarMatcher):
    """xgrammar's matcher under the names GrammarMatcher gives them (is_terminated is already one)."""

    fill_bitmask = xgrammar.GrammarMatcher.fill_next_token_bitmask
    accept = xgrammar.GrammarMatcher.accept_token


GrammarMatcher.register(XGrammarMatcher)


class XGrammarEngine(GrammarEngine):
    """Compiles constraints with xgrammar's GrammarCompiler over one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, whitespace_flexible: bool = False):
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        info = xgrammar.TokenizerInfo(tokenizer.vocab_bytes(), vocab_size=vocab_size, stop_token_ids=stop)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.whitespace_flexible = whitespace_flexible

    def compile(self, spec: StructuredOutput) -> Any:
        """xgrammar's compiled grammar (its own compiler caches too)."""
        c = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                # compact separators, as llguidance writes JSON when whitespace is not flexible
                return c.compile_json_schema(spec.value if spec.kind == "json" else OBJECT_SCHEMA,
                                             any_whitespace=self.whitespace_flexible,
                                             separators=None if self.whitespace_flexible else (",", ":"))
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(spec.value)))
            if spec.kind == "grammar":
                return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError, xgrammar.InvalidJSONError) as e:
            raise InvalidRequestError(f"{spec.param}: {str(e).splitlines()[0][:500]}", param=spec.param) from None
        raise InvalidRequestError(f"{spec.param}: unknown constraint kind {spec.kind!r}", param=spec.param)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        return XGrammarMatcher(compiled)
