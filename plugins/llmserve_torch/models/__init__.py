"""Model families of the torch backend."""

from __future__ import annotations

from llmserve_torch.arch import ArchConfig
from llmserve_torch.models import bert, decoder, gpt2


def family(arch: ArchConfig):
    """The models module (hf_shapes, normalize_name, the model class) for the arch's family."""
    return {"gpt2": gpt2, "bert": bert}.get(arch.family, decoder)
