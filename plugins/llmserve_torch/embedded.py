"""The embedded default model: a tiny GPT-2 shape with seeded random weights, no download needed.

Its vocabulary matches the byte-level tokenizer (ids 0..255 are bytes, 256 is "<|endoftext|>").
The weights are random, so the text it writes is noise: point model.model at a real checkpoint
for real text.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from llmserve_torch.arch import ArchConfig
from llmserve_torch.models.family import arch_from_hf

CONFIG_PATH = Path(__file__).with_name("embedded.json")
EOS_TOKEN_ID = 256


def config_dict() -> dict:
    """The embedded model's GPT-2 config (HF GPT2Config keys)."""
    return json.loads(CONFIG_PATH.read_text())


def arch() -> ArchConfig:
    """The embedded model as an ArchConfig, through the GPT-2 family (without importing transformers)."""
    return arch_from_hf(SimpleNamespace(**config_dict(), torch_dtype="float32"))
