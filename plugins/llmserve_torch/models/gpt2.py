"""GPT-2 as plain tensors: learned positions, LayerNorm, fused QKV, GELU MLP, tied LM head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig, config_dtype, first_int
from llmserve_torch.models.common import LinearMaker, lm_head
from llmserve_torch.models.family import GGUFNames, GGUFView, ModelFamily, register_family
from llmserve_torch.quant import QuantWeight

# the activations a checkpoint's config may name (BERT's too)
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
# GGUF (llama.cpp) tensor names → the checkpoint's (after the GPT2LMHeadModel prefix is stripped: normalize_name)
GGUF_NAMES = GGUFNames(
    top={"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f"},
    block={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
           "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    prefix="transformer.h", dropped=("output.weight",), tied_output=True)
# GPT-2's Conv1D keeps [in, out]; llama.cpp stores every matrix as [out, in]
_TRANSPOSED = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


class GPT2Family(ModelFamily):
    """GPT-2 (GPT2LMHeadModel): learned positions, so no context past them."""

    name = "gpt2"
    model_types = ("gpt2",)
    gguf_archs = ("gpt2",)

    def arch(self, cfg: Any) -> ArchConfig:
        """n_embd, n_head, n_layer, n_inner, n_positions; the scaled-attention variants are refused."""
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
            raise ConfigError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not "
                              "supported")
        n_embd, n_head = cfg.n_embd, cfg.n_head
        return ArchConfig(
            family=self.name, model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=n_embd,
            num_layers=cfg.n_layer, num_heads=n_head, num_kv_heads=n_head, head_dim=n_embd // n_head,
            intermediate_size=getattr(cfg, "n_inner", None) or 4 * n_embd, max_position_embeddings=cfg.n_positions,
            norm_eps=cfg.layer_norm_epsilon, tie_word_embeddings=True, qkv_bias=True,
            activation=cfg.activation_function, eos_token_id=first_int(cfg.eos_token_id),
            torch_dtype=config_dtype(cfg), position_limit="GPT-2's learned positions",
        )

    def hf_shapes(self, a: ArchConfig) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and shapes (HF's Conv1D stores weights as [in, out])."""
        h, i = a.hidden_size, a.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"wte.weight": (a.vocab_size, h),
                                              "wpe.weight": (a.max_position_embeddings, h)}
        for n in range(a.num_layers):
            p = f"h.{n}."
            shapes.update({
                p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
                p + "attn.c_attn.weight": (h, 3 * h), p + "attn.c_attn.bias": (3 * h,),
                p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                p + "mlp.c_fc.weight": (h, i), p + "mlp.c_fc.bias": (i,),
                p + "mlp.c_proj.weight": (i, h), p + "mlp.c_proj.bias": (h,),
            })
        shapes.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
        return shapes

    def linear_weights(self, a: ArchConfig) -> dict[str, bool]:
        """The 2-D weights that feed linears (the tied LM head included), each with whether it is stored [in, out]."""
        names = {f"h.{n}.{part}.weight": True for n in range(a.num_layers)
                 for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
        return names | {self.head_weight(a): False}

    def head_weight(self, a: ArchConfig) -> str:
        """The LM head's weight: GPT-2 ties it to the token embedding."""
        return "wte.weight"

    def normalize_name(self, name: str) -> str | None:
        """Strip the GPT2LMHeadModel prefix; None for tensors we do not use (masks, the tied head)."""
        if name.startswith("transformer."):
            name = name[len("transformer."):]
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias") or name == "lm_head.weight":
            return None
        return name

    def build(self, arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: str) -> GPT2Model:
        """A GPT2Model (LayerNorm and GELU run as torch ops, whatever `ops` says)."""
        return GPT2Model(arch, sd, make)

    def gguf_config(self, ckpt: GGUFView) -> tuple[str, dict[str, Any]]:
        """n_embd, n_layer, n_head, n_positions, n_inner and the LayerNorm epsilon from the metadata."""
        k = lambda name: ckpt.meta(f"gpt2.{name}")  # noqa: E731
        return "gpt2", dict(
            n_embd=k("embedding_length"), n_layer=k("block_count"), n_head=k("attention.head_count"),
            n_positions=k("context_length"), n_inner=k("feed_forward_length"),
            layer_norm_epsilon=k("attention.layer_norm_epsilon"), activation_function="gelu_new")

    def gguf_names(self, arch_name: str) -> GGUFNames:
        """GPT2LMHeadModel's names; the file's output.weight is not loaded (the head is tied to wte)."""
        return GGUF_NAMES

    def gguf_convert(self, ckpt: GGUFView, gguf_name: str, w: Any) -> Any:
        """Conv1D's [in, out] back for a float matrix (llama.cpp stores [out, in]; a QuantWeight stays so)."""
        if gguf_name.split(".")[-2] in _TRANSPOSED and not isinstance(w, QuantWeight) and w.ndim == 2:
            return w.T
        return w


class GPT2Model:
    """Holds the weights laid out for F.linear ([out, in], contiguous) and runs the flattened forward."""

    ops = None  # LayerNorm and GELU run as torch ops (the fused decoder ops are Llama-style)

    def __init__(self, arch: ArchConfig, sd: dict, make: LinearMaker):
        self.arch = arch
        self.act = ACTIVATIONS.get(arch.activation)
        if self.act is None:
            raise ValueError(f"GPT-2 activation {arch.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")

        def lin(name: str, gelu_tanh: bool = False):
            w = sd[name + ".weight"]
            # Conv1D stores [in, out]; a QuantWeight is always [out, in]
            return make(w if isinstance(w, QuantWeight) else w.t(), sd[name + ".bias"], gelu_tanh)

        tanh_gelu = arch.activation in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
        self.wte = make.tensor(sd["wte.weight"])
        self.wpe = make.tensor(sd["wpe.weight"])
        self.layers = []
        for n in range(arch.num_layers):
            p = f"h.{n}."
            self.layers.append({
                "ln1_w": make.tensor(sd[p + "ln_1.weight"]), "ln1_b": make.tensor(sd[p + "ln_1.bias"]),
                "qkv": lin(p + "attn.c_attn"), "o": lin(p + "attn.c_proj"),
                "ln2_w": make.tensor(sd[p + "ln_2.weight"]), "ln2_b": make.tensor(sd[p + "ln_2.bias"]),
                "fc": lin(p + "mlp.c_fc", tanh_gelu), "proj": lin(p + "mlp.c_proj"),
            })
        self.lnf_w = make.tensor(sd["ln_f.weight"])
        self.lnf_b = make.tensor(sd["ln_f.bias"])
        # tied to wte ([vocab, hidden]); a packed or quantized head is a second copy beside the lookup table
        head = sd["wte.weight"]
        self.lm_head = make(head if isinstance(head, QuantWeight) else self.wte)

    def linears(self) -> list:
        """Every linear of the model, the LM head last."""
        return [L[k] for L in self.layers for k in ("qkv", "o", "fc", "proj")] + [self.lm_head]

    def prepare_step(self, positions: torch.Tensor) -> dict:
        """Per-step tensors shared by every layer (here: the position embeddings)."""
        return {"pos_emb": F.embedding(positions, self.wpe)}

    def forward(self, input_ids: torch.Tensor, step: dict, attention) -> torch.Tensor:
        """Hidden states of every flattened token before the final norm: [T, hidden]."""
        a = self.arch
        h_size, eps = a.hidden_size, a.norm_eps
        x = F.embedding(input_ids, self.wte)
        x += step["pos_emb"]
        for li, L in enumerate(self.layers):
            h = F.layer_norm(x, (h_size,), L["ln1_w"], L["ln1_b"], eps)
            qkv = L["qkv"](h)
            q, k, v = qkv[:, :h_size], qkv[:, h_size:2 * h_size], qkv[:, 2 * h_size:]
            o = attention.forward(li, q, k, v)
            x += L["o"](o)
            h = F.layer_norm(x, (h_size,), L["ln2_w"], L["ln2_b"], eps)
            fc = L["fc"]
            x += L["proj"](fc(h) if fc.fused_gelu else self.act(fc(h)))
        return x

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm on the selected rows: the states the LM head reads, and embeddings pool."""
        return F.layer_norm(hidden, (self.arch.hidden_size,), self.lnf_w, self.lnf_b, self.arch.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows, as float32."""
        return lm_head(self.final_hidden(hidden), self.lm_head)


FAMILY = register_family(GPT2Family())
