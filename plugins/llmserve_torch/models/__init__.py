"""Model families of the torch backend."""

from __future__ import annotations

from llmserve_torch.arch import ArchConfig
from llmserve_torch.models import gpt2, qwen2


def family(arch: ArchConfig):
    """The models module (hf_shapes, normalize_name, the model class) for the arch's family."""
    return gpt2 if arch.family == "gpt2" else qwen2
