"""Per-step token masks: grammars (structured output, enforced tool calls), allowed_token_ids and bad words.

Constraints is the one owner of every sequence's matcher. Before each forward the engine asks it
for the batch's bitmask (one int32 row per constrained sampling row, bit t % 32 of word t // 32
set = token t allowed); the backend's sampler applies it with one tensor operation, so a batch
without constraints pays nothing. After sampling, accept() advances the sequence's matcher.
Grammars are compiled by the registered grammar engine, built on first use and cached per spec.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmserve.batch import SchedulerOutput
from llmserve.errors import InvalidRequestError
from llmserve.interfaces import GrammarEngine, GrammarMatcher
from llmserve.request import Request, SamplingParams, StructuredOutput

_COMPILED_CACHE = 256  # grammars kept per engine; a schema is compiled once, not per request


def _is_constrained(sp: SamplingParams) -> bool:
    return sp.structured is not None or sp.allowed_token_ids is not None or bool(sp.bad_words_token_ids)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool [rows, vocab_size] allowed-token matrix of an int32 bitmask (for samplers)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _set_bits(words: torch.Tensor, ids: list[int], value: bool) -> None:
    """Set (or clear) the bits of token ids in one int32 bitmask row, in place."""
    if not ids:
        return
    t = torch.tensor(ids, dtype=torch.long)
    bits = torch.zeros(words.shape[0] * 32, dtype=torch.bool)
    bits[t] = True
    packed = (bits.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    if value:
        words |= packed
    else:
        words &= ~packed


class Constraints:
    """Compiles constraints, owns each constrained sequence's matcher, and makes the batch's bitmask."""

    def __init__(self, engine: GrammarEngine | None, unavailable: str, vocab_size: int):
        self._engine = engine  # None: no grammar can be compiled, for the reason in `unavailable`
        self._unavailable = unavailable
        # lru_cache is thread-safe: the server compiles in worker threads, the engine thread too
        self._compile = functools.lru_cache(maxsize=_COMPILED_CACHE)(self._compile_uncached)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._matchers: dict[str, GrammarMatcher] = {}
        self._allowed: dict[str, torch.Tensor] = {}  # allowed_token_ids as a bitmask row
        self._bad: dict[str, _BadWords] = {}  # bad_words, indexed
        self._constrained: set[str] = set()  # sequences with any constraint: empty → a step pays nothing
        self._broken: dict[str, tuple[str, str]] = {}  # sequences whose constraints cannot go on → (why, param)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of spec (cached); InvalidRequestError naming spec.param when it is bad."""
        return self._compile(spec)

    def _compile_uncached(self, spec: StructuredOutput) -> Any:
        if self._engine is None:
            raise InvalidRequestError(f"structured output is not available: {self._unavailable}", param=spec.param)
        return self._engine.compile(spec)

    def check(self, sp: SamplingParams) -> None:
        """Compile the grammar and check the token ids now, so a bad one is a 400 before anything is queued."""
        if sp.allowed_token_ids is not None:
            bad = [t for t in sp.allowed_token_ids if not 0 <= t < self.vocab_size]
            if not sp.allowed_token_ids or bad:
                raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of token ids below "
                                          f"{self.vocab_size}" + (f", got {bad[:5]}" if bad else ""),
                                          param="allowed_token_ids")
        if sp.structured is not None:
            self.compile(sp.structured)

    # --- per sequence ---------------------------------------------------------------------------

    def add(self, r: Request) -> None:
        """Start the sequence's matcher (its grammar was checked when the request was made)."""
        sp = r.sampling
        if _is_constrained(sp):
            self._constrained.add(r.request_id)
        if sp.structured is not None:
            self._matchers[r.request_id] = self._engine.matcher(self.compile(sp.structured))
        if sp.allowed_token_ids is not None:
            row = torch.zeros(self.words, dtype=torch.int32)
            _set_bits(row, sp.allowed_token_ids, True)
            self._allowed[r.request_id] = row
        if sp.bad_words_token_ids:
            self._bad[r.request_id] = _BadWords(sp.bad_words_token_ids)

    def accept(self, r: Request, token_id: int) -> bool | None:
        """Advance the sequence's matcher: None when it has none, else whether the grammar is complete.

        Raises InvalidRequestError when the request's constraints could not go on (its grammar failed,
        or they exclude every token), ValueError when the token breaks the grammar (a backend that
        ignored the mask).
        """
        if self._broken and r.request_id in self._broken:
            raise InvalidRequestError(*self._broken[r.request_id])
        m = self._matchers.get(r.request_id) if self._matchers else None
        if m is None:
            return None
        try:
            allowed = m.accept(token_id)
        except ValueError as e:  # the grammar reached the engine's limits: the request's own error
            raise InvalidRequestError(f"the grammar engine failed on this request's grammar: {e}",
                                      param=r.sampling.structured.param) from None
        if not allowed:
            raise ValueError(f"token {token_id} is not allowed by the request's grammar")
        return m.is_terminated()

    def drop(self, request_id: str) -> None:
        """Forget an ended sequence."""
        if request_id in self._constrained:
            self._constrained.discard(request_id)
            self._matchers.pop(request_id, None)
            self._allowed.pop(request_id, None)
            self._bad.pop(request_id, None)
            self._broken.pop(request_id, None)

    # --- per step ---------------------------------------------------------------------------------

    def fill(self, batch: SchedulerOutput, seqs: dict[str, Request]) -> None:
        """Set batch.token_bitmask / bitmask_rows for the sampling rows that carry a constraint."""
        if not self._constrained:
            return
        rows = [i for i, sr in enumerate(batch.requests) if sr.do_sample and sr.request_id in self._constrained]
        if not rows:
            return
        mask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        for k, i in enumerate(rows):
            sr = batch.requests[i]
            sp = sr.sampling
            m = self._matchers.get(sr.request_id)
            if m is not None:
                try:
                    m.fill_bitmask(mask, k)
                except ValueError as e:  # this grammar cannot go on: its sequence fails at accept()
                    self._broken[sr.request_id] = (f"the grammar engine failed on this request's grammar: {e}",
                                                   sp.structured.param)
            allowed = self._allowed.get(sr.request_id)
            if allowed is not None:
                mask[k] &= allowed
            bad = self._bad.get(sr.request_id)
            if bad is not None:
                _set_bits(mask[k], bad.banned(seqs[sr.request_id]), False)
            if sr.request_id not in self._broken and not bool(mask[k].any()):
                # the grammar, allowed_token_ids and bad_words leave nothing to sample
                # named: the narrowing applied last (a grammar alone always allows a token)
                param = ("bad_words" if sp.bad_words_token_ids else
                         "allowed_token_ids" if allowed is not None else sp.structured.param)
                self._broken[sr.request_id] = ("no token is allowed here: the request's grammar, allowed_token_ids "
                                               "and bad_words exclude every token", param)
        batch.token_bitmask, batch.bitmask_rows = mask, rows



class _BadWords:
    """A request's bad words by the tokens before their last: a step looks up the output's tail once per length of
    those, not once per word (1024 words a row of every step cost what the model did)."""

    def __init__(self, words: list[list[int]]):
        self.always = sorted({w[-1] for w in words if len(w) == 1})
        self.after: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for w in words:
            if len(w) > 1:
                self.after.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])

    def banned(self, r: Request) -> list[int]:
        """The last token of each bad word whose other tokens the output ends with (vLLM's rule)."""
        out, got = r.token_ids[r.num_prompt_tokens:], list(self.always)
        for n, table in self.after.items():
            if len(out) >= n:
                got += table.get(tuple(out[-n:]), ())
        return got
