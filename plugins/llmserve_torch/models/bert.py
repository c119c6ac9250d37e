"""BERT-style encoders as plain tensors: learned positions, post-LayerNorm layers, bidirectional attention.

An encoder serves embeddings only: each prompt is computed whole in one step (its attention sees every token of
it, so it cannot be split into chunks) and keeps no K/V; the final hidden states are the last layer's output (BERT
normalizes inside each layer). How they are pooled comes from the checkpoint's sentence-transformers
configuration (1_Pooling/config.json) where it has one, else BERT's [CLS] token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig, config_dtype
from llmserve_torch.models.common import LinearMaker
from llmserve_torch.models.family import ModelFamily, register_family
from llmserve_torch.models.gpt2 import ACTIVATIONS

# sentence-transformers' pooling flags (1_Pooling/config.json) → llmserve.pooling's kinds
_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


class BertFamily(ModelFamily):
    """BERT encoders: embeddings only, each prompt attended to whole (EncoderAttention), no K/V kept."""

    name = "bert"
    model_types = ("bert",)
    generates = False
    causal = False

    def arch(self, cfg: Any) -> ArchConfig:
        """A BERT config's numbers; position encodings other than learned absolute ones are refused."""
        kind = getattr(cfg, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise ConfigError(f"model bert: position_embedding_type {kind!r} is not supported (supported: absolute)")
        heads = cfg.num_attention_heads
        return ArchConfig(
            family=self.name, model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
            head_dim=cfg.hidden_size // heads, intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings, norm_eps=cfg.layer_norm_eps,
            tie_word_embeddings=False, qkv_bias=True, activation=cfg.hidden_act, torch_dtype=config_dtype(cfg),
            type_vocab_size=cfg.type_vocab_size, position_limit="BERT's learned positions",
        )

    def hf_shapes(self, a: ArchConfig) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and shapes (BertModel's, nn.Linear: [out, in])."""
        h, i = a.hidden_size, a.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (a.vocab_size, h),
            "embeddings.position_embeddings.weight": (a.max_position_embeddings, h),
            "embeddings.token_type_embeddings.weight": (a.type_vocab_size, h),
            "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,),
        }
        for n in range(a.num_layers):
            p = f"encoder.layer.{n}."
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense"):
                shapes.update({p + part + ".weight": (h, h), p + part + ".bias": (h,)})
            shapes.update({
                p + "attention.output.LayerNorm.weight": (h,), p + "attention.output.LayerNorm.bias": (h,),
                p + "intermediate.dense.weight": (i, h), p + "intermediate.dense.bias": (i,),
                p + "output.dense.weight": (h, i), p + "output.dense.bias": (h,),
                p + "output.LayerNorm.weight": (h,), p + "output.LayerNorm.bias": (h,),
            })
        return shapes

    def linear_weights(self, a: ArchConfig) -> dict[str, bool]:
        """The 2-D weights that feed linears, each with whether it is stored [in, out] (never, here)."""
        return {f"encoder.layer.{n}.{part}.weight": False for n in range(a.num_layers)
                for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                             "attention.output.dense", "intermediate.dense", "output.dense")}

    def normalize_name(self, name: str) -> str | None:
        """BertModel's names: a task model's `bert.` prefix stripped; its pooler and heads (unused) dropped."""
        if name.startswith("bert."):
            name = name[len("bert."):]
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            return None
        return name

    def build(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: str) -> BertModel:
        """A BertModel (LayerNorm and GELU run as torch ops)."""
        return BertModel(arch, sd, make)

    def default_pooling(self, source: str) -> str:
        """The checkpoint's sentence-transformers pooling, else [CLS]."""
        return default_pooling(source)

    def own_attention(self, arch: ArchConfig) -> EncoderAttention:
        """Bidirectional attention within each whole prompt."""
        return EncoderAttention(arch)


def default_pooling(model_dir: str | Path) -> str:
    """The pooling the checkpoint was trained for: its sentence-transformers pooling module's, else [CLS]."""
    d = Path(model_dir)
    try:
        modules = json.loads((d / "modules.json").read_text())
        path = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        cfg = json.loads((d / path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "cls"
    return next((kind for flag, kind in _ST_POOLING.items() if cfg.get(flag)), "cls")


class EncoderAttention:
    """Bidirectional attention within each sequence of the step (every prompt is in the step whole); no K/V kept."""

    name = "encoder"

    def __init__(self, arch: ArchConfig):
        self.arch = arch
        self.meta = None

    def begin_step(self, meta) -> None:
        """Remember where each sequence's rows are."""
        if any(q != c for q, c in zip(meta.q_lens, meta.ctx_lens)):
            raise RuntimeError("an encoder computes each prompt in one step (a chunk that continues one was given)")
        self.meta = meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v [T, heads*head_dim] → [T, heads*head_dim], each sequence attending to all of itself."""
        a, out = self.arch, torch.empty_like(q)
        H, D = a.num_heads, a.head_dim
        for s, n in zip(self.meta.q_starts, self.meta.q_lens):
            qs, ks, vs = (t[s:s + n].reshape(n, H, D).transpose(0, 1) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out[s:s + n] = o.transpose(0, 1).reshape(n, H * D)
        return out


class BertModel:
    """Holds the weights laid out for F.linear and runs the flattened forward of whole prompts."""

    ops = None  # LayerNorm and GELU run as torch ops

    def __init__(self, arch: ArchConfig, sd: dict, make: LinearMaker):
        self.arch = arch
        self.act = ACTIVATIONS.get(arch.activation)
        if self.act is None:
            raise ValueError(f"BERT activation {arch.activation!r} is not supported (supported: "
                             f"{', '.join(ACTIVATIONS)})")

        def lin(name: str):
            return make(sd[name + ".weight"], sd[name + ".bias"])

        e = "embeddings."
        self.wte = make.tensor(sd[e + "word_embeddings.weight"])
        self.wpe = make.tensor(sd[e + "position_embeddings.weight"])
        self.type0 = make.tensor(sd[e + "token_type_embeddings.weight"][0])  # every token is of segment 0
        self.emb_ln = (make.tensor(sd[e + "LayerNorm.weight"]), make.tensor(sd[e + "LayerNorm.bias"]))
        self.layers = []
        for n in range(arch.num_layers):
            p = f"encoder.layer.{n}."
            qkv = make.cat([sd[p + f"attention.self.{x}.weight"] for x in ("query", "key", "value")])
            qkv_b = torch.cat([sd[p + f"attention.self.{x}.bias"] for x in ("query", "key", "value")])
            self.layers.append({
                "qkv": make(qkv, qkv_b), "o": lin(p + "attention.output.dense"),
                "ln1": (make.tensor(sd[p + "attention.output.LayerNorm.weight"]),
                        make.tensor(sd[p + "attention.output.LayerNorm.bias"])),
                "fc": lin(p + "intermediate.dense"), "proj": lin(p + "output.dense"),
                "ln2": (make.tensor(sd[p + "output.LayerNorm.weight"]), make.tensor(sd[p + "output.LayerNorm.bias"])),
            })

    def linears(self) -> list:
        """Every linear of the model."""
        return [L[k] for L in self.layers for k in ("qkv", "o", "fc", "proj")]

    def prepare_step(self, positions: torch.Tensor) -> dict:
        """Per-step tensors shared by every layer (here: the position embeddings)."""
        return {"pos_emb": F.embedding(positions, self.wpe)}

    def forward(self, input_ids: torch.Tensor, step: dict, attention) -> torch.Tensor:
        """The last layer's hidden states of every flattened token: [T, hidden]."""
        h, eps = self.arch.hidden_size, self.arch.norm_eps
        x = F.embedding(input_ids, self.wte) + step["pos_emb"] + self.type0
        x = F.layer_norm(x, (h,), *self.emb_ln, eps)
        for li, L in enumerate(self.layers):
            qkv = L["qkv"](x)
            o = attention.forward(li, qkv[:, :h], qkv[:, h:2 * h], qkv[:, 2 * h:])
            x = F.layer_norm(x + L["o"](o), (h,), *L["ln1"], eps)
            x = F.layer_norm(x + L["proj"](self.act(L["fc"](x))), (h,), *L["ln2"], eps)
        return x

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The states embeddings pool: the last layer's, as they are (each layer ends normalized)."""
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head: it samples nothing."""
        raise RuntimeError("an encoder model has no LM head: it serves embeddings only")


FAMILY = register_family(BertFamily())
