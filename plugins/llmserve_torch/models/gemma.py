"""Gemma (v1, GemmaForCausalLM): a Llama-style decoder with three differences, each applied here.

- RMSNorm scales by (1 + w): the norm weights are stored as 1 + w at load, in float32 as transformers adds them, so
  the decoder's RMSNorm runs unchanged;
- the token embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype as transformers rounds it
  (the tied LM head reads the unscaled table);
- the MLP is GeGLU: gelu_pytorch_tanh(gate)·up.

The fused C decode stack runs SiLU·up only, so a Gemma model runs the Python path (the decoder ops still fuse its
RMSNorm and RoPE on CPU). llama.cpp's converter stores the norm weights as 1 + w; a GGUF's are taken back to w.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig
from llmserve_torch.fused import decoder_ops
from llmserve_torch.models.common import LinearMaker
from llmserve_torch.models.decoder import DecoderFamily, DecoderModel
from llmserve_torch.models.family import GGUFView, register_family
from llmserve_torch.quant_embedding import embedding_rows

# transformers' names for the tanh approximation of GELU, and the exact one
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class GemmaFamily(DecoderFamily):
    """Gemma's checkpoints: the decoder's names and shapes, its own activation, norm and embedding scale."""

    name = "gemma"
    model_types = ("gemma",)
    gguf_archs = ("gemma",)

    def activation(self, cfg: Any) -> str:
        """hidden_activation where a transformers 4 config sets it, else hidden_act: a GELU."""
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU:
            raise ConfigError(f"model gemma: hidden_act {act!r} is not supported (supported: {', '.join(_GELU)})")
        return act

    def arch(self, cfg: Any) -> ArchConfig:
        """The decoder's numbers (head_dim from the config); bidirectional attention is refused."""
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ConfigError("model gemma: use_bidirectional_attention is not supported (the torch backend's "
                              "decoders are causal)")
        return super().arch(cfg)

    def build(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: str) -> GemmaModel:
        """A GemmaModel with the decoder ops the device runs."""
        return GemmaModel(arch, sd, make, max_len, decoder_ops(make.device, make.dtype, ops))

    def fused_stack(self, arch: ArchConfig) -> str | None:
        """The C stack computes SiLU·up and copies embedding rows unscaled."""
        return "it runs SiLU·up MLPs, not Gemma's GeGLU (nor its scaled embeddings)"

    def gguf_config(self, ckpt: GGUFView) -> tuple[str, dict[str, Any]]:
        """The decoder's fields (head_dim is attention.key_length), with Gemma's activation."""
        _, fields = super().gguf_config(ckpt)
        return "gemma", {**fields, "hidden_act": "gelu_pytorch_tanh"}

    def gguf_convert(self, ckpt: GGUFView, gguf_name: str, w: Any) -> Any:
        """convert_hf_to_gguf's Gemma stores every norm weight as 1 + w: subtract it (exact in float32 for 1 + w in
        [0.5, 2], so the 1 + w the model adds back is the file's value)."""
        if gguf_name.endswith("_norm.weight"):
            return w - 1
        return w


class GemmaModel(DecoderModel):
    """DecoderModel with Gemma's (1 + w) norms, scaled embeddings and GeGLU MLP."""

    def __init__(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops):
        # (1 + w) in float32 as GemmaRMSNorm computes it; the decoder's RMSNorm then multiplies by it
        sd = {k: 1.0 + v.float() if k.endswith("norm.weight") else v for k, v in sd.items()}
        super().__init__(arch, sd, make, max_len, ops)
        # transformers multiplies by sqrt(hidden_size) rounded to the weights' dtype
        self.embed_scale = torch.tensor(arch.hidden_size ** 0.5, dtype=torch.float32).to(make.dtype).to(make.device)
        self.approximate = _GELU[arch.activation]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows times sqrt(hidden_size)."""
        return embedding_rows(self.embed, input_ids) * self.embed_scale

    def gate_up_act(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        """GeGLU: gelu(gate)·up."""
        return F.gelu(gu[:, :inter], approximate=self.approximate) * gu[:, inter:]


FAMILY = register_family(GemmaFamily())
