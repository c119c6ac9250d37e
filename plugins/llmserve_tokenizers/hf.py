"""The "hf" tokenizer: transformers' AutoTokenizer from a local directory (or a hub id when online), or, for a
directory holding one (a GGUF's cache), its snapshot (snapshot.py), read without transformers."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmserve.config import check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import Tokenizer
from llmserve_tokenizers import chat, snapshot

log = logging.getLogger("llmserve.tokenizers")


# tokenizer classes that are the tokenizers library's tokenizer.json itself, with nothing model-specific
_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _loader(directory: str | None):
    """AutoTokenizer, or, for a directory whose tokenizer_config.json names the generic fast class (a GGUF's cached
    tokenizer), that class: the same tokenizer, without the ~2 s AutoTokenizer spends importing its model registry."""
    if directory is not None:
        try:
            with open(os.path.join(directory, "tokenizer_config.json")) as f:
                named = json.load(f).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            named = None
        if named in _GENERIC:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


class HFTokenizer(Tokenizer):
    """Wraps a transformers tokenizer; the chat template is the checkpoint's own."""

    def __init__(self, tok: Any, name: str, chat_template: str | None = None) -> None:
        self._tok = tok
        self.name = name
        self.eos_token_id = tok.eos_token_id
        self.vocab_size = len(tok)
        self._special = set(tok.all_special_ids)
        if chat_template is not None:
            tok.chat_template = chat_template
        self.chat_template = chat.joined(getattr(tok, "chat_template", None))
        self._own_args = _renderer_args(tok)

    @classmethod
    def from_config(cls, config) -> Tokenizer:
        """Load config.model.tokenizer (or config.model.model); a ConfigError says how to fix a failure."""
        check_options(config.tokenizer.options, {}, f"{config.source}: tokenizer.options (hf)")
        name = config.model.tokenizer or config.model.model
        if name == "embedded":
            raise ConfigError(f"{config.source}: tokenizer: the embedded model has no HF tokenizer; "
                              "use tokenizer.name 'byte' or 'auto'")
        return cls.load(name, revision=config.model.revision, trust_remote_code=config.model.trust_remote_code,
                        chat_template=None if config.model.chat_template is None else _template(config))

    @classmethod
    def load(cls, name: str, revision: str | None = None, trust_remote_code: bool = False,
             chat_template: str | None = None) -> Tokenizer:
        """Load from a local directory, or from the hub cache / the hub for an id; chat_template replaces its own.

        A directory holding a snapshot (a GGUF's cache) is read without transformers; loading one of llmserve's
        directories with transformers writes its snapshot, for the next start."""
        local = os.path.isdir(name)
        if local and snapshot.path(name).is_file():
            try:
                return snapshot.SnapshotTokenizer.load(name, chat_template=chat_template)
            except Exception as e:  # any damage: transformers still reads the tokenizer files beside it
                log.warning("tokenizer snapshot %s not used (%s: %s); loading with transformers and rewriting it",
                            snapshot.path(name), type(e).__name__, e)
        AutoTokenizer = _loader(name if local else None)  # noqa: N806 (a class)
        try:
            # try the local files first: without internet a hub lookup only fails slowly
            tok = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code,
                                                local_files_only=True)
        except Exception as first:
            if local or os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
                hint = "" if local else " (HF_HUB_OFFLINE is set: pass a local directory holding tokenizer files)"
                raise ConfigError(f"cannot load the tokenizer from {name!r}: {type(first).__name__}: "
                                  f"{str(first).splitlines()[0] if str(first) else ''}{hint}") from None
            try:
                tok = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
            except Exception as e:
                raise ConfigError(
                    f"cannot load the tokenizer {name!r}: it is not a local directory and the hub could not "
                    f"provide it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Without "
                    "internet access, pass a local directory holding tokenizer files (model.tokenizer or model.model)"
                ) from None
        if local and snapshot.writable(name):
            _save_snapshot(tok, name)  # before chat_template replaces the checkpoint's own
        return cls(tok, name, chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes for OpenAI's logprobs `bytes` field (snapshot.shown_bytes)."""
        return snapshot.shown_bytes(self._tok.decode([token_id], skip_special_tokens=False),
                                    lambda: self._own_bytes[token_id])

    def vocab_bytes(self) -> list[bytes]:
        """Each id's bytes: byte-level BPE pieces mapped back to bytes, SentencePiece's "▁" and <0xNN> undone."""
        return _vocab_bytes(self._tok)

    @functools.cached_property
    def _own_bytes(self) -> list[bytes]:
        return self.vocab_bytes()  # built once, on the first token that holds part of a character

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """Render with the checkpoint's chat template (or model.chat_template); a 400 when there is none or it fails."""
        return chat.apply(self.name, self.chat_template, self._own_args, kwargs, lambda: self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs))

    @property
    def all_special_ids(self) -> set[int]:
        return self._special


def _renderer_args(tok: Any) -> frozenset[str]:
    """apply_chat_template's own arguments, which chat_template_kwargs may not set."""
    return frozenset(inspect.signature(tok.apply_chat_template).parameters)


def _vocab_bytes(tok: Any) -> list[bytes]:
    """Every id's bytes in one pass over the vocabulary (no decode call per id)."""
    core = tok.backend_tokenizer
    pieces = [core.id_to_token(i) or "" for i in range(len(tok))]  # an id the vocabulary skips has no bytes
    added = {i: t.content for i, t in core.get_added_tokens_decoder().items()}
    if core.decoder is not None and b"ByteLevel" in core.decoder.__getstate__():  # the decoder's JSON
        table = {ord(c): chr(b) for c, b in _byte_level_table().items()}  # each symbol → its byte, as Latin-1
        return [added[i].encode() if i in added else _latin1(p.translate(table)) for i, p in enumerate(pieces)]
    return [added[i].encode() if i in added else _sentencepiece_bytes(p) for i, p in enumerate(pieces)]


def _latin1(s: str) -> bytes:
    """A byte-level piece mapped to bytes; a character outside the table (not one of GPT-2's) as its UTF-8."""
    try:
        return s.encode("latin-1")
    except UnicodeEncodeError:
        return s.encode()


def write_snapshot(directory: str) -> None:
    """Load directory's tokenizer files with transformers, as HFTokenizer.load does, and write their snapshot beside
    them (a GGUF cache's first start: later starts then read the tokenizer without transformers)."""
    try:
        tok = _loader(directory).from_pretrained(directory, local_files_only=True)
    except Exception as e:  # the start that loads it says what is wrong, in its own words
        log.warning("could not load the tokenizer in %s to snapshot it (%s: %s)", directory, type(e).__name__, e)
        return
    _save_snapshot(tok, directory)


def _save_snapshot(tok: Any, directory: str) -> None:
    """Write directory's snapshot of tok (as transformers loaded it); a failure only costs later starts time."""
    try:
        clean_up = tok.clean_up_tokenization_spaces and not (
            type(tok.backend_tokenizer.model).__name__ == "BPE"  # transformers skips it for BPE: it removes spaces
            and not tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)
        record = {"eos_token_id": tok.eos_token_id, "vocab_size": len(tok),
                  "all_special_ids": sorted(tok.all_special_ids), "clean_up_tokenization_spaces": bool(clean_up),
                  "split_special_tokens": bool(tok.split_special_tokens), "special_tokens_map": tok.special_tokens_map,
                  "chat_template": getattr(tok, "chat_template", None), "renderer_args": sorted(_renderer_args(tok)),
                  "transformers": snapshot.transformers_version()}
        snapshot.save(directory, record, tok.backend_tokenizer.to_str(), _vocab_bytes(tok))
    except Exception as e:  # a read-only cache, a tokenizer without a tokenizers pipeline ...: never a failed start
        log.warning("could not write the tokenizer snapshot %s (%s: %s); later starts load with transformers",
                    snapshot.path(directory), type(e).__name__, e)
    else:
        log.info("wrote the tokenizer snapshot %s (later starts read it without transformers)",
                 snapshot.path(directory))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character table, inverted (character → byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _sentencepiece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes: <0xNN> is that byte, "▁" a space."""
    m = len(piece) == 6 and re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()


def _template(config) -> str:
    """model.chat_template: a file's text, or the template itself when it is Jinja (as vLLM takes --chat-template)."""
    t = config.model.chat_template
    if os.path.isfile(t):
        return Path(t).read_text()
    if "{{" in t or "{%" in t:
        return t
    raise ConfigError(f"{config.source}: model.chat_template: {t!r} is neither a file nor a Jinja template")
