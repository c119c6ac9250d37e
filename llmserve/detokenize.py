"""Incremental detokenization for streaming, with stop strings.

Text is produced by decoding a short sliding window of tokens and emitting only what became
stable: a window whose decoding ends in U+FFFD (a multi-byte character cut in half) waits for
the next token. Stop strings may span tokens, so the last (longest stop - 1) characters are held
back until they cannot start a stop string any more; nothing past a stop is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.interfaces import Tokenizer

_CONTEXT = 6  # prompt tokens decoded with the output so that leading spaces come out right


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas, honouring stop strings."""

    __slots__ = ("tok", "skip_special", "special", "ids", "prefix_offset", "read_offset", "text",
                 "emitted", "stops", "hold", "include_stop")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.special = tokenizer.all_special_ids if skip_special_tokens else set()
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all stable output text so far
        self.emitted = 0  # characters of self.text already handed out
        self.stops = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.include_stop = include_stop_str_in_output

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token; return (text to emit now, the stop string hit or None)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return "", None  # an incomplete UTF-8 sequence: wait for the rest
        start = len(self.text)
        self.text += full[len(prefix) :]
        # the next window starts after what was read, unless that would leave only skipped special
        # tokens in front: SentencePiece-style decoders drop the leading space of a window's first
        # real token, so " user" after a special token would come out as "user"
        special = self.special
        if not special or any(t not in special for t in self.ids[self.read_offset :]):
            self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.stops:
            # only a stop that ends in the new text can be new; search from where it could begin
            lo = max(0, start - self.hold)
            hits = [(j, s) for s in self.stops if (j := self.text.find(s, lo)) != -1]
            if hits:
                j, s = min(hits, key=lambda h: h[0])  # the earliest; at a tie, the first listed
                end = j + len(s) if self.include_stop else j
                out = self.text[self.emitted : end]
                self.text = self.text[:end]
                self.emitted = len(self.text)
                return out, s
        safe = max(len(self.text) - self.hold, self.emitted)  # hold is 0 without stop strings
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, None

    def flush(self) -> str:
        """At the end of generation: the held-back text (and any undecodable tail, as decoded)."""
        if self.read_offset < len(self.ids):
            prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
            full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
