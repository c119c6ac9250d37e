"""GPT-2 as plain tensors: learned positions, LayerNorm, fused QKV, GELU MLP, tied LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve_torch.arch import ArchConfig
from llmserve_torch.models.common import LinearMaker, lm_head
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


def hf_shapes(a: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes (HF's Conv1D stores weights as [in, out])."""
    h, i = a.hidden_size, a.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (a.vocab_size, h), "wpe.weight": (a.max_position_embeddings, h)}
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


def linear_weights(a: ArchConfig) -> dict[str, bool]:
    """The 2-D weights that feed linears (the tied LM head included), each with whether it is stored [in, out]."""
    names = {f"h.{n}.{part}.weight": True for n in range(a.num_layers)
             for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    return names | {head_weight(a): False}


def head_weight(a: ArchConfig) -> str:
    """The LM head's weight: GPT-2 ties it to the token embedding."""
    return "wte.weight"


def normalize_name(name: str) -> str | None:
    """Strip the GPT2LMHeadModel prefix; None for tensors we do not use (masks, the tied head)."""
    if name.startswith("transformer."):
        name = name[len("transformer."):]
    if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias") or name == "lm_head.weight":
        return None
    return name


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
