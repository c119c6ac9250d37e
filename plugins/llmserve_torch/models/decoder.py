"""Llama-style decoders (Qwen2/Qwen2.5, Llama, Mistral, Qwen3): RoPE, RMSNorm, SwiGLU, grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve_torch.arch import ArchConfig
from llmserve_torch.fused import TorchOps
from llmserve_torch.models.common import LinearMaker, lm_head
from llmserve_torch.models.rope import rope_tables


def hf_shapes(a: ArchConfig) -> dict[str, tuple[int, ...]]:
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
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
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


def linear_weights(a: ArchConfig) -> dict[str, bool]:
    """The 2-D weights that feed linears (the LM head included), each with whether it is stored [in, out]."""
    names = [f"model.layers.{n}.{part}.weight" for n in range(a.num_layers) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return dict.fromkeys(names + [head_weight(a)], False)


def head_weight(a: ArchConfig) -> str:
    """The LM head's weight: the embedding table when tied."""
    return "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"


def normalize_name(name: str) -> str | None:
    """Checkpoint names are used as they are; rotary caches saved by old exporters are dropped."""
    if "rotary_emb.inv_freq" in name:
        return None
    return name


class Qwen2Model:
    """Weights fused for fewer GEMMs (q|k|v and gate|up), run over a flattened batch."""

    def __init__(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: TorchOps):
        self.arch = arch
        self.dtype = make.dtype
        self.ops = ops  # the elementwise steps: fused C kernels on CPU, or torch
        self.embed = make.tensor(sd["model.embed_tokens.weight"])  # float for the lookup, even when quantized
        self.layers = []
        for n in range(arch.num_layers):
            p = f"model.layers.{n}.self_attn."
            m = f"model.layers.{n}.mlp."
            qkv_b = torch.cat([sd[p + "q_proj.bias"], sd[p + "k_proj.bias"], sd[p + "v_proj.bias"]]) \
                if arch.qkv_bias else None
            L = {
                "in_norm": make.tensor(sd[f"model.layers.{n}.input_layernorm.weight"]),
                "qkv": make(make.cat([sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]]),
                            qkv_b),
                "o": make(sd[p + "o_proj.weight"]),
                "post_norm": make.tensor(sd[f"model.layers.{n}.post_attention_layernorm.weight"]),
                "gate_up": make(make.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])),
                "down": make(sd[m + "down_proj.weight"]),
            }
            if arch.qk_norm:
                L["q_norm"] = make.tensor(sd[p + "q_norm.weight"])
                L["k_norm"] = make.tensor(sd[p + "k_norm.weight"])
            self.layers.append(L)
        self.norm = make.tensor(sd["model.norm.weight"])
        head = sd[head_weight(arch)]
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
        x = F.embedding(input_ids, self.embed)
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
            down = L["down"](ops.silu_mul(L["gate_up"](h), inter))
            if li + 1 < len(layers):
                h = ops.add_rms(x, down, layers[li + 1]["in_norm"], eps)
            else:
                x += down
        return x

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm on the selected rows: the states the LM head reads, and embeddings pool."""
        return self.ops.add_rms(hidden, None, self.norm, self.arch.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows, as float32."""
        return lm_head(self.final_hidden(hidden), self.lm_head)
