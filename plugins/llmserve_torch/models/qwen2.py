"""Llama-style decoders (Qwen2/Qwen2.5, Llama, Mistral, Qwen3): RoPE, RMSNorm, SwiGLU, grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve_torch.arch import ArchConfig
from llmserve_torch.models.common import Linear, lm_head
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


def normalize_name(name: str) -> str | None:
    """Checkpoint names are used as they are; rotary caches saved by old exporters are dropped."""
    if "rotary_emb.inv_freq" in name:
        return None
    return name


class Qwen2Model:
    """Weights fused for fewer GEMMs (q|k|v and gate|up), run over a flattened batch."""

    def __init__(self, arch: ArchConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 max_len: int, pack: bool = False, batch_hint: int = 64):
        self.arch = arch
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return sd[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight").contiguous()
        self.layers = []
        for n in range(arch.num_layers):
            p = f"model.layers.{n}.self_attn."
            m = f"model.layers.{n}.mlp."
            qkv_b = (torch.cat([w(p + "q_proj.bias"), w(p + "k_proj.bias"), w(p + "v_proj.bias")]).contiguous()
                     if arch.qkv_bias else None)
            L = {
                "in_norm": w(f"model.layers.{n}.input_layernorm.weight").contiguous(),
                "qkv": Linear(torch.cat([w(p + "q_proj.weight"), w(p + "k_proj.weight"),
                                         w(p + "v_proj.weight")]).contiguous(), qkv_b, pack, batch_hint),
                "o": Linear(w(p + "o_proj.weight").contiguous(), None, pack, batch_hint),
                "post_norm": w(f"model.layers.{n}.post_attention_layernorm.weight").contiguous(),
                "gate_up": Linear(torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")]).contiguous(), None,
                                  pack, batch_hint),
                "down": Linear(w(m + "down_proj.weight").contiguous(), None, pack, batch_hint),
            }
            if arch.qk_norm:
                L["q_norm"] = w(p + "q_norm.weight").contiguous()
                L["k_norm"] = w(p + "k_norm.weight").contiguous()
            self.layers.append(L)
        self.norm = w("model.norm.weight").contiguous()
        head = self.embed if arch.tie_word_embeddings else w("lm_head.weight").contiguous()
        self.lm_head = Linear(head, None, pack, batch_hint)  # packed: a copy; embed stays for the lookup
        self.cos, self.sin = rope_tables(arch.rope, arch.head_dim, max_len, device)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF normalizes in float32 and casts back before scaling by the weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.arch.norm_eps)
        return weight * xf.to(x.dtype)

    def prepare_step(self, positions: torch.Tensor) -> dict:
        """Per-step tensors shared by every layer: cos/sin at each token's position, [T, 1, head_dim/2]."""
        cos = self.cos.index_select(0, positions).to(self.dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(self.dtype).unsqueeze(1)
        return {"cos": cos, "sin": sin}

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] → rotated copy (rotate-half convention)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, input_ids: torch.Tensor, step: dict, attention) -> torch.Tensor:
        """Hidden states of every flattened token before the final norm: [T, hidden]."""
        a = self.arch
        T = input_ids.shape[0]
        qs, kvs, d, inter = a.q_size, a.kv_size, a.head_dim, a.intermediate_size
        cos, sin = step["cos"], step["sin"]
        x = F.embedding(input_ids, self.embed)
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["in_norm"])
            qkv = L["qkv"](h)
            q = qkv[:, :qs].view(T, a.num_heads, d)
            k = qkv[:, qs:qs + kvs].view(T, a.num_kv_heads, d)
            v = qkv[:, qs + kvs:]
            if a.qk_norm:
                q = self._rms(q, L["q_norm"])
                k = self._rms(k, L["k_norm"])
            q = self._rope(q, cos, sin).view(T, qs)
            k = self._rope(k, cos, sin).view(T, kvs)
            o = attention.forward(li, q, k, v)
            x = x + L["o"](o)
            h = self._rms(x, L["post_norm"])
            gu = L["gate_up"](h)
            x = x + L["down"](F.silu(gu[:, :inter]) * gu[:, inter:])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows, as float32."""
        return lm_head(self._rms(hidden, self.norm), self.lm_head)
