"""The torch backend plugin: GPT-2 and Qwen2-family models on a paged KV cache.

torch and transformers are imported inside the factory, so `llmserve --help` stays fast.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _make_torch_backend(config):
    """Factory: build the TorchBackend for an EngineConfig (imports torch only now)."""
    from llmserve_torch.backend import TorchBackend

    return TorchBackend(config)


@hookimpl
def register_backends(register):
    """Register the `torch` backend."""
    register("torch", _make_torch_backend)
