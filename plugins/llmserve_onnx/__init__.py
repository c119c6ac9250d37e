"""The onnx backend plugin: GPT-2 and Qwen2-family decoders exported to ONNX (cached), run by onnxruntime on CPU.

onnxruntime and onnx are an optional extra (`pip install llmserve[onnx]`), imported inside the factory.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _make_onnx_backend(config):
    """Factory: export the checkpoint once (or read its export from the cache) and open onnxruntime sessions."""
    from llmserve_onnx.backend import OnnxBackend

    return OnnxBackend(config)


@hookimpl
def register_backends(register):
    """Register the `onnx` backend."""
    register("onnx", _make_onnx_backend)
