"""Default tokenizers: "byte" (offline byte-level), "hf" (transformers AutoTokenizer) and "auto".

"auto" picks "byte" for the embedded default model and the fake backend, "hf" otherwise.
Heavy imports (tiktoken, transformers) happen inside the factories.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _byte_factory(config):
    from llmserve_tokenizers.byte import ByteTokenizer

    return ByteTokenizer.from_config(config)


def _hf_factory(config):
    from llmserve_tokenizers.hf import HFTokenizer

    return HFTokenizer.from_config(config)


def uses_byte_tokenizer(config) -> bool:
    """True when "auto" resolves to the byte-level tokenizer (embedded model or fake backend)."""
    return config.model.model == "embedded" or config.backend.name == "fake"


def _auto_factory(config):
    return _byte_factory(config) if uses_byte_tokenizer(config) else _hf_factory(config)


@hookimpl
def register_tokenizers(register):
    """Register the byte, hf and auto tokenizers."""
    register("byte", _byte_factory)
    register("hf", _hf_factory)
    register("auto", _auto_factory)
