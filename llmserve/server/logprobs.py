"""Logprobs in OpenAI's two shapes: the legacy completions object and chat's `content` list."""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmserve.request import Logprob

_FLOOR = -9999.0  # JSON has no -inf; vLLM and OpenAI clients accept a large negative number


def _lp(x: float) -> float:
    return _FLOOR if not math.isfinite(x) or x < _FLOOR else x


class TokenText:
    """Token id → the text and bytes OpenAI reports for it (cached); as_ids or no tokenizer: "token_id:N"."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tok = tokenizer
        self.as_ids = as_ids or tokenizer is None
        self._text: dict[int, str] = {}

    def text(self, tid: int) -> str:
        if tid not in self._text:
            self._text[tid] = f"token_id:{tid}" if self.as_ids else self.tok.decode([tid], skip_special_tokens=False)
        return self._text[tid]

    def bytes(self, tid: int) -> list[int]:
        tb = None if self.as_ids else getattr(self.tok, "token_bytes", None)
        raw = tb(tid) if tb is not None else self.text(tid).encode("utf-8")
        return list(raw)


class CompletionLogprobs:
    """Accumulates {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for one choice."""

    def __init__(self, tt: TokenText, top_n: int, offset: int = 0):
        self.tt = tt
        self.top_n = top_n
        self.offset = offset  # characters of text before the next token
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, lp: Logprob | None) -> None:
        """One token; lp None for the first prompt token (nothing precedes it)."""
        s = self.tt.text(token_id)
        self.tokens.append(s)
        self.text_offset.append(self.offset)
        self.offset += len(s)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(_lp(lp.logprob))
        top: dict[str, float] = {}
        for tid, v in lp.top[: self.top_n]:
            top.setdefault(self.tt.text(tid), _lp(v))
        top.setdefault(s, _lp(lp.logprob))  # the chosen token is always listed (logprobs 0 too), as OpenAI does
        self.top_logprobs.append(top)

    def add_many(self, token_ids: Sequence[int], lps: Sequence[Logprob | None] | None) -> None:
        for i, t in enumerate(token_ids):
            self.add(t, lps[i] if lps is not None and i < len(lps) else None)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict:
        """The entries added since the last take (for a streamed chunk)."""
        d = self.to_dict()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return d


def chat_logprobs(tt: TokenText, token_ids: Sequence[int], lps: Sequence[Logprob] | None, top_n: int) -> list[dict]:
    """Chat's logprobs.content entries: token, logprob, bytes and top_logprobs for each token."""
    out = []
    for i, t in enumerate(token_ids):
        lp = lps[i] if lps is not None and i < len(lps) else None
        top = lp.top[:top_n] if lp is not None and top_n > 0 else ()
        out.append({"token": tt.text(t), "logprob": _lp(lp.logprob) if lp else _FLOOR, "bytes": tt.bytes(t),
                    "top_logprobs": [{"token": tt.text(tid), "logprob": _lp(v), "bytes": tt.bytes(tid)}
                                     for tid, v in top]})
    return out


def prompt_logprobs(tt: TokenText, lps: Sequence[Logprob | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank, decoded_token}}
    for the token itself, then the top N."""
    def entry(v: float, rank: int, tid: int) -> dict:
        return {"logprob": _lp(v), "rank": rank, "decoded_token": tt.text(tid)}

    out: list[dict | None] = []
    for lp in lps:
        d = None if lp is None else {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}
        for r, (tid, v) in enumerate(lp.top if lp is not None else ()):
            d.setdefault(str(tid), entry(v, r + 1, tid))
        out.append(d)
    return out
