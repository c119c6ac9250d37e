"""A byte-level tokenizer that needs no download: ids 0..255 are bytes, 256 is <|endoftext|>.

Built with tiktoken from a mergeable-ranks table holding only the 256 single bytes, so every
string round-trips exactly and the vocabulary (257) matches the embedded model and the fake
backend.

Chat template (documented in docs/server.md): each message becomes ``<role>: <content>\\n``
(text parts of a list content are joined with no separator); with ``add_generation_prompt``
the prompt ends in ``assistant:`` so the model continues as the assistant.

PrintableByteTokenizer ("printable", the embedded model's) has the same ids, but each byte decodes to
one printable character, so the random model's output never sends control bytes to a terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmserve.config import check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import Tokenizer

EOS_TEXT = "<|endoftext|>"
EOS_ID = 256
VOCAB_SIZE = 257


def _message_text(content: Any) -> str:
    """The text of a message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_simple_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> str:
    """Render messages as ``role: content`` lines, ending in ``assistant:`` when asked to, or in the last
    message's text (no newline) to continue it."""
    lines = [f"{m.get('role', 'user')}: {_message_text(m.get('content'))}\n" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    text = "".join(lines)
    return text[:-1] if continue_final_message and lines else text


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer over tiktoken: 256 byte tokens plus <|endoftext|> as EOS."""

    eos_token_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            name="llmserve-byte",
            # split on whitespace runs so BPE pieces stay short; with no merges every piece
            # becomes its bytes anyway
            pat_str=r"\S+|\s+",
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={EOS_TEXT: EOS_ID},
        )

    @classmethod
    def from_config(cls, config) -> ByteTokenizer:
        """Build from an EngineConfig (tokenizer.options must be empty)."""
        check_options(config.tokenizer.options, {}, f"{config.source}: tokenizer.options (byte)")
        if config.model.chat_template is not None:
            raise ConfigError(f"{config.source}: model.chat_template: the byte tokenizer has its own fixed template")
        return cls()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes of text; a literal "<|endoftext|>" in user text stays plain bytes (no injected EOS)."""
        return self._enc.encode_ordinary(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """UTF-8 text of the bytes (U+FFFD where a character is cut); EOS dropped unless asked for."""
        ids = [t for t in token_ids if not (skip_special_tokens and t == EOS_ID)]
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (for OpenAI's logprobs `bytes` field)."""
        return self._enc.decode_single_token_bytes(token_id)

    def vocab_bytes(self) -> list[bytes]:
        """The 256 bytes, then the EOS text."""
        return [bytes([i]) for i in range(256)] + [EOS_TEXT.encode()]

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """Render with the simple ``role: content`` template of the module docstring (it shows no tools)."""
        return render_simple_chat(messages, add_generation_prompt, continue_final_message)


def printable_table() -> list[str]:
    """Each byte's character: printable ASCII, space, tab, newline and printable Latin-1 as themselves; every
    other byte (controls, DEL, C1, NBSP, soft hyphen) a printable stand-in from U+0100 on, as GPT-2's BPE does."""
    keep = set(range(0x20, 0x7F)) | {0x09, 0x0A} | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    stand_in = iter(range(0x100, 0x200))
    return [chr(b) if b in keep else chr(next(stand_in)) for b in range(256)]


class PrintableByteTokenizer(ByteTokenizer):
    """The byte ids, each decoding to one printable character (printable_table); text encodes back character by
    character, and a character outside the table as its UTF-8 bytes (which then decode to their own characters)."""

    def __init__(self) -> None:  # no tiktoken: a character per id is a table lookup
        self._chars = printable_table()
        self._ids = {c: i for i, c in enumerate(self._chars)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per character of the table; the UTF-8 bytes of any other character."""
        ids: list[int] = []
        for c in text:
            i = self._ids.get(c)
            if i is None:
                ids.extend(c.encode("utf-8"))
            else:
                ids.append(i)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """One printable character per byte id; EOS dropped unless asked for."""
        return "".join(self._chars[t] if t != EOS_ID else ("" if skip_special_tokens else EOS_TEXT)
                       for t in token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of the token's character (what the text carries)."""
        return EOS_TEXT.encode() if token_id == EOS_ID else self._chars[token_id].encode()

    def vocab_bytes(self) -> list[bytes]:
        """Each id's character as UTF-8, then the EOS text: what a grammar sees in the output."""
        return [c.encode() for c in self._chars] + [EOS_TEXT.encode()]
