"""Llama-style decoders (Llama, Mistral, Qwen2/Qwen2.5, Qwen3): RoPE, RMSNorm, SwiGLU, grouped-query attention.

The family the fused C decode stack (fused_stack.py) and the decoder ops (fused.py) are written for; other families
with these layers (models/gemma.py) subclass its family and model and change what differs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve.errors import ConfigError
from llmserve_torch.arch import FREQ_FACTORS, ArchConfig, config_dtype, first_int, rope_from_hf
from llmserve_torch.fused import TorchOps, decoder_ops
from llmserve_torch.models.common import LinearMaker, lm_head
from llmserve_torch.models.family import GGUFNames, GGUFView, ModelFamily, register_family
from llmserve_torch.models.rope import rope_tables
from llmserve_torch.quant import QuantWeight
from llmserve_torch.quant_embedding import QuantEmbedding, embedding_rows

_ROPE_FREQS = "rope_freqs.weight"
# GGUF (llama.cpp) tensor names → the HF checkpoint's (a layer's part comes after model.layers.N.)
GGUF_NAMES = GGUFNames(
    top={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    block={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
           "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
           "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    prefix="model.layers", dropped=(_ROPE_FREQS,))  # (rope_freqs goes into the config: gguf_config)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's rotary halves)."""
    # the converter did reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class DecoderFamily(ModelFamily):
    """Llama-style decoders: one model, the QKV bias and q/k norms switched by the checkpoint."""

    name = "decoder"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    gguf_archs = ("llama", "qwen2", "qwen3")

    def activation(self, cfg: Any) -> str:
        """The MLP's activation the config names; one the model does not compute is refused."""
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"model {cfg.model_type}: hidden_act {act!r} is not supported (supported: silu)")
        return act

    def arch(self, cfg: Any) -> ArchConfig:
        """Sizes, GQA heads, head_dim (from the config where it gives one), RoPE, the QKV bias (Qwen2's, or
        attention_bias), Qwen3's q/k norms."""
        mt = cfg.model_type
        act = self.activation(cfg)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return ArchConfig(
            family=self.name, model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
            norm_eps=cfg.rms_norm_eps, rope=rope_from_hf(cfg),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)), qk_norm=mt == "qwen3",
            activation=act, eos_token_id=first_int(cfg.eos_token_id), torch_dtype=config_dtype(cfg),
        )

    def hf_shapes(self, a: ArchConfig) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and shapes (nn.Linear: [out, in])."""
        h, i, q, kv, d = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size, a.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h)}
        for n in range(a.num_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if a.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if a.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        shapes["model.norm.weight"] = (h,)
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, h)
        return shapes

    def linear_weights(self, a: ArchConfig) -> dict[str, bool]:
        """The 2-D weights that feed linears (the LM head included), each with whether it is stored [in, out]."""
        names = [f"model.layers.{n}.{part}.weight" for n in range(a.num_layers) for part in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        return dict.fromkeys(names + [self.head_weight(a)], False)

    def quantized_tables(self, a: ArchConfig) -> set[str]:
        """The embedding table: DecoderModel keeps a quantized file's packed (make.embedding)."""
        return {"model.embed_tokens.weight"}

    def head_weight(self, a: ArchConfig) -> str:
        """The LM head's weight: the embedding table when tied."""
        return "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"

    def normalize_name(self, name: str) -> str | None:
        """Checkpoint names are used as they are; rotary caches saved by old exporters are dropped."""
        if "rotary_emb.inv_freq" in name:
            return None
        return name

    def build(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: str) -> DecoderModel:
        """A DecoderModel with the decoder ops the device runs (fused C kernels on CPU, Triton on CUDA)."""
        return DecoderModel(arch, sd, make, max_len, decoder_ops(make.device, make.dtype, ops))

    def fused_stack(self, arch: ArchConfig) -> str | None:
        """The fused C stack runs these layers, except Qwen3's per-head q/k norms."""
        return "it runs Llama-style layers without per-head q/k norms" if arch.qk_norm else None

    def gguf_config(self, ckpt: GGUFView) -> tuple[str, dict[str, Any]]:
        """Sizes, heads, head_dim, RoPE base, norm epsilon and tied head from the metadata; a llama file's rope_freqs
        as explicit per-frequency divisors. RoPE scaling by metadata and partial rotary embeddings are refused."""
        a = ckpt.arch_name
        k = lambda name, *default: ckpt.meta(f"{a}.{name}", *default)  # noqa: E731
        if _ROPE_FREQS in ckpt.tensors and a != "llama":
            # llama.cpp reads rope_freqs for its llama architecture only
            raise ConfigError(f"{ckpt.path}: per-frequency RoPE scaling (rope_freqs) in a {a!r} GGUF is "
                              "not supported (llama.cpp applies it to 'llama' files only)")
        scaling = k("rope.scaling.type", "none")
        if scaling != "none":
            raise ConfigError(f"{ckpt.path}: GGUF RoPE scaling {scaling!r} is not supported by the torch backend")
        hidden, heads = k("embedding_length"), k("attention.head_count")
        head_dim = k("attention.key_length", hidden // heads)
        if k("rope.dimension_count", head_dim) != head_dim:
            raise ConfigError(f"{ckpt.path}: partial rotary embeddings (rope.dimension_count "
                              f"{k('rope.dimension_count')} < head_dim {head_dim}) are not supported")
        extra = {"attention_bias": "blk.0.attn_q.bias" in ckpt.tensors} if a == "llama" else {}
        theta = float(k("rope.freq_base", 10000.0))
        if _ROPE_FREQS in ckpt.tensors:
            extra["rope_parameters"] = {"rope_type": FREQ_FACTORS, "rope_theta": theta,
                                        "freq_factors": _freq_factors(ckpt, head_dim)}
        return a, dict(
            hidden_size=hidden, intermediate_size=k("feed_forward_length"), num_hidden_layers=k("block_count"),
            num_attention_heads=heads, num_key_value_heads=k("attention.head_count_kv", heads), head_dim=head_dim,
            max_position_embeddings=k("context_length"), rms_norm_eps=k("attention.layer_norm_rms_epsilon"),
            rope_theta=theta, hidden_act="silu", tie_word_embeddings="output.weight" not in ckpt.tensors, **extra)

    def gguf_names(self, arch_name: str) -> GGUFNames:
        """Every Llama-style architecture names its tensors alike."""
        return GGUF_NAMES

    def gguf_convert(self, ckpt: GGUFView, gguf_name: str, w: Any) -> Any:
        """A llama file's Q and K rows un-permuted: per query head for Q, per KV head for K (as transformers' GGUF
        loader does; convert_hf_to_gguf permutes K with n_head = n_head_kv)."""
        part = gguf_name.split(".")[-2]
        if ckpt.arch_name != "llama" or part not in ("attn_q", "attn_k"):
            return w
        heads = ckpt.meta("llama.attention.head_count")
        n = heads if part == "attn_q" else ckpt.meta("llama.attention.head_count_kv", heads)
        if isinstance(w, QuantWeight):
            return w.map_rows(lambda a: unpermute_rows(a, n).contiguous())
        return unpermute_rows(w, n)


def _freq_factors(ckpt: GGUFView, head_dim: int) -> list[float]:
    """rope_freqs: the divisor of each rotary pair's base frequency (how llama.cpp's converter writes Llama 3.1's
    llama3 scaling; the llama3 parameters themselves are not in the file)."""
    factors = ckpt.values(_ROPE_FREQS).astype(np.float32).reshape(-1)
    if factors.size != head_dim // 2 or not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ConfigError(f"{ckpt.path}: rope_freqs holds {factors.size} values; expected head_dim/2 = "
                          f"{head_dim // 2} finite positive ones")
    return [float(f) for f in factors]  # float32 → float64 → JSON round-trips exactly


class DecoderModel:
    """Weights fused for fewer GEMMs (q|k|v and gate|up), run over a flattened batch."""

    def __init__(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: TorchOps):
        self.arch = arch
        self.dtype = make.dtype
        self.ops = ops  # the elementwise steps: fused C kernels on CPU, or torch
        # a quantized file's table stays packed (its rows dequantized as they are looked up); then, where tied, it is
        # the LM head's weight too. (A Deferred one is read now: the head may be the same weight.)
        embed_w = make.read(sd["model.embed_tokens.weight"])
        self.embed = make.embedding(embed_w, shared=arch.tie_word_embeddings)
        self.layers = []
        for n in range(arch.num_layers):
            p = f"model.layers.{n}.self_attn."
            m = f"model.layers.{n}.mlp."
            qkv_b = torch.cat([sd[p + "q_proj.bias"], sd[p + "k_proj.bias"], sd[p + "v_proj.bias"]]) \
                if arch.qkv_bias else None
            # each layer's weights leave sd once made: a quantized file's unpacked values (a byte a weight) are
            # freed layer by layer instead of all living until the model is built
            take = sd.pop
            L = {
                "in_norm": make.tensor(sd[f"model.layers.{n}.input_layernorm.weight"]),
                "qkv": make(make.cat([take(p + "q_proj.weight"), take(p + "k_proj.weight"),
                                      take(p + "v_proj.weight")]), qkv_b),
                "o": make(take(p + "o_proj.weight")),
                "post_norm": make.tensor(sd[f"model.layers.{n}.post_attention_layernorm.weight"]),
                "gate_up": make(make.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])),
                "down": make(take(m + "down_proj.weight")),
            }
            if arch.qk_norm:
                L["q_norm"] = make.tensor(sd[p + "q_norm.weight"])
                L["k_norm"] = make.tensor(sd[p + "k_norm.weight"])
            self.layers.append(L)
        self.norm = make.tensor(sd["model.norm.weight"])
        if arch.tie_word_embeddings and isinstance(self.embed, QuantEmbedding):
            self.lm_head = self.embed.linear
        else:
            head = embed_w if arch.tie_word_embeddings else sd[FAMILY.head_weight(arch)]
            # tied and float: the lookup table itself (packing makes its own copy); quantized: a copy in its kind
            self.lm_head = make(self.embed if arch.tie_word_embeddings and isinstance(head, torch.Tensor) else head)
        self.cos, self.sin = rope_tables(arch.rope, arch.head_dim, max_len, make.device)

    def linears(self) -> list:
        """Every linear of the model, the LM head last."""
        return [L[k] for L in self.layers for k in ("qkv", "o", "gate_up", "down")] + [self.lm_head]

    def prepare_step(self, positions: torch.Tensor) -> dict:
        """Per-step tensors shared by every layer: cos/sin at each token's position, [T, head_dim/2]."""
        cos, sin = self.ops.tables(self.cos.index_select(0, positions), self.sin.index_select(0, positions), self.dtype)
        return {"cos": cos, "sin": sin}

    def forward(self, input_ids: torch.Tensor, step: dict, attention) -> torch.Tensor:
        """Hidden states of every flattened token before the final norm: [T, hidden]."""
        a, ops, eps = self.arch, self.ops, self.arch.norm_eps
        qs, kvs, d, inter = a.q_size, a.kv_size, a.head_dim, a.intermediate_size
        cos, sin = step["cos"], step["sin"]
        x = self.embed_tokens(input_ids)
        act = self.gate_up_act
        layers = self.layers
        h = ops.add_rms(x, None, layers[0]["in_norm"], eps)
        for li, L in enumerate(layers):
            qkv = L["qkv"](h)
            if a.qk_norm:  # Qwen3 normalizes each head of q and k before the rotation
                T = qkv.shape[0]
                q = ops.add_rms(qkv[:, :qs].reshape(T * a.num_heads, d), None, L["q_norm"], eps)
                k = ops.add_rms(qkv[:, qs:qs + kvs].reshape(T * a.num_kv_heads, d), None, L["k_norm"], eps)
                qkv = torch.cat([q.view(T, qs), k.view(T, kvs), qkv[:, qs + kvs:]], dim=1)
            ops.rope(qkv, a.num_heads + a.num_kv_heads, d, cos, sin)  # q heads then k heads, in place
            o = attention.forward(li, qkv[:, :qs], qkv[:, qs:qs + kvs], qkv[:, qs + kvs:])
            h = ops.add_rms(x, L["o"](o), L["post_norm"], eps)  # x += attention output; h = norm(x)
            down = L["down"](act(L["gate_up"](h), inter))
            if li + 1 < len(layers):
                h = ops.add_rms(x, down, layers[li + 1]["in_norm"], eps)
            else:
                x += down
        return x

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of the step's tokens: [T, hidden] (a family that scales them overrides this)."""
        return embedding_rows(self.embed, input_ids)

    def gate_up_act(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        """The MLP's activation on gate|up rows: SiLU(gate)·up (a family with another overrides this)."""
        return self.ops.silu_mul(gu, inter)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm on the selected rows: the states the LM head reads, and embeddings pool."""
        return self.ops.add_rms(hidden, None, self.norm, self.arch.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows, as float32."""
        return lm_head(self.final_hidden(hidden), self.lm_head)


FAMILY = register_family(DecoderFamily())
