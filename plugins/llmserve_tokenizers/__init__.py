"""Default tokenizers: "byte" (offline byte-level), "printable" (its ids, printable text) and "hf" (transformers, or
the snapshot of it a GGUF's cache holds).

Tokenizer "auto" is the backend's choice (ModelBackend.default_tokenizer), not this plugin's.
Heavy imports (tiktoken, transformers) happen inside the factories.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _byte_factory(config):
    from llmserve_tokenizers.byte import ByteTokenizer

    return ByteTokenizer.from_config(config)


def _printable_factory(config):
    from llmserve_tokenizers.byte import PrintableByteTokenizer

    return PrintableByteTokenizer.from_config(config)


def _hf_factory(config):
    from llmserve_tokenizers.hf import HFTokenizer

    return HFTokenizer.from_config(config)


@hookimpl
def register_tokenizers(register):
    """Register the byte, printable and hf tokenizers."""
    register("byte", _byte_factory)
    register("printable", _printable_factory)
    register("hf", _hf_factory)
