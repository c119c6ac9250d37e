"""The embedded default model: a tiny GPT-2 shape with seeded random weights, no download needed.

Its vocabulary matches the byte-level tokenizer (ids 0..255 are bytes, 256 is "<|endoftext|>").
The weights are random, so the text it writes is noise: point model.model at a real checkpoint
for real text.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmserve_torch.arch import ArchConfig

CONFIG_PATH = Path(__file__).with_name("embedded.json")
EOS_TOKEN_ID = 256


def config_dict() -> dict:
    """The embedded model's GPT-2 config (HF GPT2Config keys)."""
    return json.loads(CONFIG_PATH.read_text())


def arch() -> ArchConfig:
    """The embedded model as an ArchConfig (built without importing transformers)."""
    c = config_dict()
    n_embd, n_head = c["n_embd"], c["n_head"]
    return ArchConfig(
        family="gpt2", model_type="gpt2", vocab_size=c["vocab_size"], hidden_size=n_embd,
        num_layers=c["n_layer"], num_heads=n_head, num_kv_heads=n_head, head_dim=n_embd // n_head,
        intermediate_size=c["n_inner"], max_position_embeddings=c["n_positions"],
        norm_eps=c["layer_norm_epsilon"], activation=c["activation_function"], eos_token_id=c["eos_token_id"],
        torch_dtype="float32",
    )
