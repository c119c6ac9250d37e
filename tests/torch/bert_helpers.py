"""A tiny BERT checkpoint for the encoder tests: random weights (transformers' BertModel) and a WordPiece tokenizer
built offline from a small vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

# WordPiece pieces: whole words and single letters (every lowercase word tokenizes), BERT's special tokens first
_WORDS = ("the cat dog sat on mat a an is was hello world paris france capital of what weather today "
          "embeddings are vectors ##s ##ing ##ed").split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789",
         *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"), *".,!?'"]


def save_tiny_bert(path: Path, seed: int = 0, pooling: str | None = None, max_positions: int = 128):
    """A random BertModel (2 layers, hidden 32) and its tokenizer saved in `path`; with `pooling` (cls | mean |
    last) a sentence-transformers pooling config as well. Returns the HF model (eval mode)."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=max_positions)
    model = transformers.BertModel(cfg, add_pooling_layer=True).eval()
    model.save_pretrained(path)
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(path)
    if pooling is not None:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, **{f: kind == pooling for f, kind in flags.items()}}))
    return model


def hf_embedding(model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states of one input pooled as asked and L2-normalized: the reference vector."""
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = {"cls": h[0], "mean": h.mean(0), "last": h[-1]}[pooling]
    return torch.nn.functional.normalize(v, dim=0)
