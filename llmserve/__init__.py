"""llmserve: a plugin-based LLM serving engine with an OpenAI-compatible API."""

from llmserve.hookspecs import hookimpl
from llmserve.request import FinishReason, RequestOutput, RequestStatus, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "FinishReason",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "hookimpl",
    "__version__",
]
