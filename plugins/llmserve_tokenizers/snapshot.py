"""A tokenizer snapshot: the tokenizers-library pipeline exactly as transformers runs it, plus what our Tokenizer
needs that transformers would compute, in one JSON file; loading it imports neither transformers nor its model
registry (about a second of every start of a GGUF model, whose cache directory holds one)."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import os
import tempfile
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmserve.interfaces import Tokenizer
from llmserve_tokenizers import chat

FILE = "llmserve-tokenizer.json"
VERSION = 1  # bump when the record changes: a snapshot of another version is rewritten by the next load
# the GGUF cache's marker (llmserve_torch.gguf_cache.MARKER): a directory of ours, where a snapshot may be written
GGUF_CACHE_MARKER = "llmserve-gguf.json"
# transformers' clean_up_tokenization (for WordPiece-style tokenizers whose config asks for it)
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def path(directory: str | os.PathLike) -> Path:
    """Where directory's snapshot is (or would be)."""
    return Path(directory) / FILE


def writable(directory: str | os.PathLike) -> bool:
    """Whether a snapshot belongs in directory: one already there, or the directory is llmserve's GGUF cache (a
    user's own checkpoint directory is never written into)."""
    d = Path(directory)
    return (d / FILE).exists() or (d / GGUF_CACHE_MARKER).is_file()


def save(directory: str | os.PathLike, record: dict[str, Any], backend: str, vocab: Sequence[bytes]) -> None:
    """Write the snapshot atomically (a temporary file renamed over it): record's fields, the pipeline's JSON and every
    id's bytes (packed: lengths and data, so a later start reads 150k tokens' bytes without decoding one by one)."""
    lengths = array("I", map(len, vocab))
    data = {"version": VERSION, **record,
            "vocab_bytes": {"lengths": base64.b64encode(lengths.tobytes()).decode(),
                            "data": base64.b64encode(b"".join(vocab)).decode()},
            "backend": backend}
    target = path(directory)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        os.chmod(tmp, 0o644)  # as the cache's other files (mkstemp makes it private)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def transformers_version() -> str | None:
    """The installed transformers' version (from its metadata: no import), None without it."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


_LONG = 16_384  # characters: a text the server tokenizes in a worker thread (llmserve.server.routes.BIG_TEXT)


def shown_bytes(text: str, own: Callable[[], bytes]) -> bytes:
    """A token's bytes for OpenAI's logprobs `bytes` field: its text's UTF-8, or its own bytes (`own()`) where it holds
    part of a character, which decoded alone shows as U+FFFD: joined, a choice's `bytes` are then its text's."""
    return own() if "\ufffd" in text else text.encode()


class SnapshotTokenizer(Tokenizer):
    """The "hf" tokenizer read from a snapshot: tokenizers and jinja2 only, the same ids, text and prompts."""

    def __init__(self, core: Any, record: dict[str, Any], name: str, chat_template: str | None = None) -> None:
        self._core = core
        self.name = name
        self.eos_token_id = record["eos_token_id"]
        self.vocab_size = record["vocab_size"]
        self._special = set(record["all_special_ids"])
        self._clean_up = record["clean_up_tokenization_spaces"]
        self._special_tokens_map = record["special_tokens_map"]
        self._own_args = frozenset(record["renderer_args"])
        self._template = record["chat_template"] if chat_template is None else chat_template
        self.chat_template = chat.joined(self._template)
        self._lengths, self._data = record["vocab_bytes"]

    @classmethod
    def load(cls, directory: str | os.PathLike, name: str | None = None,
             chat_template: str | None = None) -> SnapshotTokenizer:
        """Read directory's snapshot; ValueError (or the tokenizers library's error) when it is missing parts or not
        one of this version, or another transformers wrote it: the caller loads with transformers, and rewrites it."""
        from tokenizers import Tokenizer as Core

        with open(path(directory), encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} snapshot")
        installed = transformers_version()
        if installed is not None and data.get("transformers") != installed:  # its pipeline may differ now
            raise ValueError(f"written with transformers {data.get('transformers')}, {installed} is installed")
        try:
            packed = data["vocab_bytes"]
            lengths = array("I")
            lengths.frombytes(base64.b64decode(packed["lengths"], validate=True))
            blob = base64.b64decode(packed["data"], validate=True)
            record = {k: data[k] for k in ("eos_token_id", "vocab_size", "all_special_ids",
                                           "clean_up_tokenization_spaces", "split_special_tokens",
                                           "special_tokens_map", "chat_template", "renderer_args")}
            backend = data["backend"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a part is missing or malformed ({type(e).__name__}: {e})") from None
        if len(lengths) != record["vocab_size"] or sum(lengths) != len(blob):
            raise ValueError("its vocabulary bytes do not match its vocabulary size")
        core = Core.from_str(backend)
        # transformers encodes with no truncation or padding and its split_special_tokens setting
        core.no_truncation()
        core.no_padding()
        core.encode_special_tokens = bool(record["split_special_tokens"])
        return cls(core, {**record, "vocab_bytes": (lengths, blob)}, name or str(directory), chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text."""
        if len(text) >= _LONG:  # the same ids; encode holds the GIL throughout (a 4 MB prompt: 2 s), encode_batch not
            return self._core.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._core.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        text = self._core.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for a, b in _CLEAN_UP:
                text = text.replace(a, b)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes for OpenAI's logprobs `bytes` field (shown_bytes)."""
        at = self._starts
        return shown_bytes(self.decode([token_id], skip_special_tokens=False),
                           lambda: self._data[at[token_id]:at[token_id + 1]])

    def vocab_bytes(self) -> list[bytes]:
        """Each id's bytes, as the snapshot's writer computed them (HFTokenizer.vocab_bytes)."""
        at = self._starts
        return [self._data[at[i]:at[i + 1]] for i in range(len(at) - 1)]

    @functools.cached_property
    def _starts(self) -> list[int]:
        """Where each id's bytes start in the blob, and where the last ends."""
        return list(itertools.accumulate(self._lengths, initial=0))

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """Render with the checkpoint's chat template (or model.chat_template); a 400 when there is none or it fails."""
        return chat.apply(self.name, self._template, self._own_args, kwargs, lambda: chat.render(
            self._template, messages, self._special_tokens_map, kwargs, tools=tools,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message))

    @property
    def all_special_ids(self) -> set[int]:
        return self._special
