"""A deterministic backend with no model: the next token is a pure function of the tokens so far.

Outputs therefore do not depend on batching, chunking or preemption, which makes it the
reference for scheduler and server tests. An optional simulated cost per step and per token
makes it useful for scheduler experiments.
"""

from __future__ import annotations

import time
from typing import Any

from llmserve.batch import Forwards, ModelOutput, SchedulerOutput
from llmserve.interfaces import ModelBackend
from llmserve.pooling import pooled_rows
from llmserve.request import Logprob

_MASK = (1 << 64) - 1


def next_token(token_ids: list[int], end: int, vocab_size: int, eos_token_id: int | None) -> int:
    """The token that follows token_ids[:end]: a hash of the last four tokens and the length."""
    h = 0xCBF29CE484222325 ^ end
    for t in token_ids[max(0, end - 4) : end]:
        h = ((h ^ (t + 1)) * 0x100000001B3) & _MASK
    h ^= h >> 29
    tok = h % vocab_size
    return tok


def hidden_state(token_ids: list[int], pos: int, size: int, context: int = 0) -> list[float]:
    """A stand-in final hidden state at `pos`: values in [-0.5, 0.5) hashed from the four tokens up to it, the position
    and `context` (a hash of the whole prompt, for a bidirectional model whose every state sees every token)."""
    h = 0xCBF29CE484222325 ^ pos ^ context
    for t in token_ids[max(0, pos - 3) : pos + 1]:
        h = ((h ^ (t + 1)) * 0x100000001B3) & _MASK
    out = []
    for d in range(size):
        x = ((h ^ (d * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 31
        out.append((x >> 11) / 2**53 - 0.5)
    return out


class FakeBackend(ModelBackend):
    """Deterministic, dependency-free stand-in for a model."""

    default_tokenizer = "byte"  # its default vocabulary (257) is the byte-level one

    def __init__(
        self,
        vocab_size: int = 257,
        max_model_len: int = 4096,
        eos_token_id: int | list[int] | None = 256,
        num_blocks: int = 2048,
        step_cost_s: float = 0.0,
        token_cost_s: float = 0.0,
        generation_defaults: dict[str, Any] | None = None,
        max_decode_forwards: int = 1,
        max_decode_forward_rows: int | None = None,
        hidden_size: int = 64,
        pooling: str | None = "last",
        generates: bool = True,
        causal: bool = True,
    ):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_id = ids[0] if ids else None
        self.eos_token_ids = frozenset(ids) - {None}
        self.generation_defaults = generation_defaults or {}
        self.generation_defaults_source = "backend.options.generation_defaults" if generation_defaults else None
        self.forwards = Forwards(max_decode_forwards, max_decode_forward_rows)
        self.hidden_size, self.pooling, self.generates, self.causal = hidden_size, pooling, generates, causal
        self._num_blocks = num_blocks
        self.step_cost_s = step_cost_s
        self.token_cost_s = token_cost_s
        self.steps = 0
        self.fail_next: Exception | None = None  # tests inject a backend failure here

    def num_kv_blocks(self, block_size: int) -> int:
        return self._num_blocks

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._num_blocks = num_blocks

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        self.steps += 1
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        cost = self.step_cost_s + self.token_cost_s * batch.num_tokens
        if cost > 0:
            time.sleep(cost)
        V, eos = self.vocab_size, self.eos_token_id
        sampled: list[int | None] = []
        logprobs: list[Logprob | None] | None = None
        allowed = {}  # batch row → its allowed token ids, where a constraint limits them
        if batch.token_bitmask is not None:
            from llmserve.constraints import unpack_bitmask  # (it imports torch: not on `llmserve --help`'s path)

            rows = unpack_bitmask(batch.token_bitmask, V)
            allowed = {i: rows[k].nonzero().flatten().tolist() for k, i in enumerate(batch.bitmask_rows)}
        for i, r in enumerate(batch.requests):
            if not r.do_sample:
                sampled.append(None)
                continue
            sp = r.sampling
            tok = self._next(r.token_ids, r.num_output_tokens, sp)
            ok = allowed.get(i)
            if ok and tok not in ok:  # constrained: the allowed token the hash picks, still deterministic
                tok = ok[next_token(r.token_ids, len(r.token_ids) + 1, len(ok), None)]
            sampled.append(tok)
            if sp.logprobs is not None:
                if logprobs is None:
                    logprobs = [None] * len(batch.requests)
                # a fixed, valid distribution: the chosen token gets log(0.5), the rest share the remainder
                top = [(tok, -0.6931471805599453)] + [((tok + k) % V, -0.6931471805599453 - k) for k in range(1, sp.logprobs)]
                logprobs[i] = Logprob(tok, -0.6931471805599453, 1, top[: max(sp.logprobs, 0)])
        prompt_logprobs = None
        if any(r.sampling.prompt_logprobs is not None for r in batch.requests):
            prompt_logprobs = []
            for r in batch.requests:
                if r.sampling.prompt_logprobs is None:
                    prompt_logprobs.append(None)
                    continue
                entries: list[Logprob | None] = []
                for pos in range(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens):
                    if pos + 1 < r.num_prompt_tokens:
                        entries.append(Logprob(r.token_ids[pos + 1], -1.0, 1, []))
                    else:
                        entries.append(None)
                prompt_logprobs.append(entries)
        pooled = [self._pooled(r) for r in batch.requests] if any(r.pooling for r in batch.requests) else None
        more = self._later_forwards(batch, sampled, logprobs)
        if more is not None and self.on_forward is not None:
            # handed on before execute returns, all but the last (left to the engine's replay, as a real call's
            # last forwards often are: they end as the call returns)
            for j, toks in enumerate([sampled, *more][:-1]):
                self.on_forward(j, toks)
        return ModelOutput(sampled, logprobs, prompt_logprobs, more, pooled)

    def _pooled(self, r) -> list[float] | None:
        """The sum of the chunk's pooled rows' stand-in states (None: not pooling, or no such row this chunk)."""
        if r.pooling is None:
            return None
        s, total = r.num_computed_tokens, r.num_prompt_tokens
        rows = pooled_rows(r.pooling, s, r.num_new_tokens, total)
        if not rows:
            return None
        prompt = r.token_ids[:total]
        context = 0 if self.causal else hash(tuple(prompt)) & _MASK
        acc = [0.0] * self.hidden_size
        for row in rows:
            acc = [a + b for a, b in zip(acc, hidden_state(prompt, s + row, self.hidden_size, context))]
        return acc

    def _next(self, token_ids: list[int], num_output_tokens: int, sp) -> int:
        """The token after token_ids (an end-of-sequence token moves on while ignore_eos or min_tokens holds it)."""
        tok = next_token(token_ids, len(token_ids), self.vocab_size, self.eos_token_id)
        while tok in self.eos_token_ids and (sp.ignore_eos or num_output_tokens < sp.min_tokens):
            tok = (tok + 1) % self.vocab_size
        return tok

    def _later_forwards(self, batch: SchedulerOutput, first: list[int | None], logprobs) -> list[list[int]] | None:
        """Forwards 2..num_steps of a batch of decodes without constraints or logprobs, each on the tokens of the one
        before (as a backend that feeds its tokens back); None where it runs one."""
        steps = self.forwards.cap(batch.num_steps, len(batch.requests))
        if steps <= 1 or batch.token_bitmask is not None or logprobs is not None or any(
                r.num_new_tokens != 1 or not r.do_sample or r.sampling.prompt_logprobs is not None
                for r in batch.requests):
            return None
        seqs = [r.token_ids + [tok] for r, tok in zip(batch.requests, first)]
        more = []
        for j in range(1, steps):
            toks = [self._next(s, r.num_output_tokens + j, r.sampling) for s, r in zip(seqs, batch.requests)]
            for s, tok in zip(seqs, toks):
                s.append(tok)
            more.append(toks)
        return more

    def describe(self) -> dict[str, Any]:
        return {"backend": "fake", "vocab_size": self.vocab_size, "max_model_len": self.max_model_len,
                "hidden_size": self.hidden_size, "pooling": self.pooling,
                "step_cost_s": self.step_cost_s, "token_cost_s": self.token_cost_s}
