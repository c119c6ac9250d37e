"""The "xgrammar" grammar engine (optional: `pip install xgrammar`), the same constraints on xgrammar's matcher."""

from __future__ import annotations

import json
from typing import Any

import xgrammar

from llmserve.errors import InvalidRequestError
from llmserve.interfaces import GrammarEngine, GrammarMatcher, Tokenizer
from llmserve.json_schema import close_objects
from llmserve.request import StructuredOutput
from llmserve_grammar.llg import OBJECT_SCHEMA


class XGrammarMatcher(xgrammar.GrammarMatcher):
    """xgrammar's matcher under the names GrammarMatcher gives them (is_terminated is already one)."""

    fill_bitmask = xgrammar.GrammarMatcher.fill_next_token_bitmask
    accept = xgrammar.GrammarMatcher.accept_token


GrammarMatcher.register(XGrammarMatcher)


class XGrammarEngine(GrammarEngine):
    """Compiles constraints with xgrammar's GrammarCompiler over one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, whitespace_flexible: bool = False,
                 open_objects: bool = False):
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        info = xgrammar.TokenizerInfo(tokenizer.vocab_bytes(), vocab_size=vocab_size, stop_token_ids=stop)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.whitespace_flexible, self.open_objects = whitespace_flexible, open_objects

    def compile(self, spec: StructuredOutput) -> Any:
        """xgrammar's compiled grammar (its own compiler caches too)."""
        c = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                # compact separators, as llguidance writes JSON when whitespace is not flexible
                # strict_mode (xgrammar's default) closes every object that says nothing of others, even one of no
                # named properties; closed here as llguidance's are, so the two engines agree
                schema = spec.value if spec.kind == "json" else OBJECT_SCHEMA
                if not self.open_objects:
                    schema = json.dumps(close_objects(json.loads(schema)))
                return c.compile_json_schema(schema, any_whitespace=self.whitespace_flexible, strict_mode=False,
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
