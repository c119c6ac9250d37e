"""Tiny GGUF files for the tests, written the way llama.cpp's convert_hf_to_gguf writes them.

The tensor names come from gguf-py's own name table (not from the code under test), llama Q/K are
permuted as the converter permutes them, GPT-2's Conv1D weights are transposed, and 2-D weights
are quantized to the asked type: with gguf.quants where it can, else with the small reference
K-quantizers below (gguf-py only dequantizes Q4_K, Q5_K and Q6_K).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

# control tokens first (ids 0..7, so the tiny models' eos ids 2, 5 and 7 are all special), the 256
# byte-level symbols, then a few merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"] + [f"<|reserved_{i}|>" for i in range(4, 8)]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "l d", "Ġ t"]
BYTES = list(bytes_to_unicode().values())
TOKENS = SPECIALS + BYTES + ["".join(m.split()) for m in MERGES]
VOCAB = len(TOKENS)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gpt2": gguf.MODEL_ARCH.GPT2}


def make_decoder(model_type: str, hidden: int = 64, seed: int = 0, tie: bool = False):
    """A tiny random llama / qwen2 / qwen3 (HF) with grouped-query attention and random biases where it has them."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden if hidden < 256 else hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=512, rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF zeroes biases and sets norms to one: make both count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # sharp attention, so a wrong Q/K layout changes tokens, not just logits
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_model) -> dict[str, np.ndarray]:
    """The HF state dict as convert_hf_to_gguf lays it out: GGUF names, llama Q/K permuted, GPT-2 transposed."""
    cfg = hf_model.config
    names = gguf.get_tensor_name_map(_ARCH[cfg.model_type], cfg.num_hidden_layers)
    out = {}
    for hf_name, t in hf_model.state_dict().items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if cfg.model_type != "gpt2" and hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, kind = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{kind}"
        w = t.detach().float().numpy().copy()
        if cfg.model_type == "llama" and ".attn_q." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and ".attn_k." in name:
            w = _permute(w, cfg.num_key_value_heads)
        elif cfg.model_type == "gpt2" and w.ndim == 2 and name.split(".")[-2] in (
                "attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            w = np.ascontiguousarray(w.T)
        out[name] = w
    return out


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """w [rows, cols] in the GGUF encoding of qtype (uint8 blocks, or float16 / float32 arrays)."""
    if qtype in _REFERENCE:
        return _REFERENCE[qtype](w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """gguf-py's dequantization of quantize()'s output."""
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])


def write_gguf(path: Path, hf_model, qtype: str = "F32", tensors: dict[str, np.ndarray] | None = None,
               arch: str | None = None, extra_kv: dict[str, int | float] | None = None) -> Path:
    """Write hf_model (or the given GGUF-named tensors) as a GGUF with metadata and a tiny BPE tokenizer.

    A tensor given as (uint8 blocks, type name) is written as it is, in that type; extra_kv adds metadata
    (ints as uint32, floats as float32).
    """
    cfg = hf_model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, v in (extra_kv or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(key, v)
    for name, t in (tensors if tensors is not None else gguf_tensors(hf_model)).items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=gguf.GGMLQuantizationType[t[1]])
        elif t.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms and biases in float32
            w.add_tensor(name, t.astype(np.float32))
        else:
            q = quantize(t, qtype)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[qtype] if q.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- reference K-quantizers: round-to-nearest, packed as gguf-py's dequantizers unpack --------------------

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes holding eight 6-bit scales and eight 6-bit mins."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _affine_k(w: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Per 256-block d, dmin (float16 bytes), packed scales and the q values of x ≈ d*sc*q - dmin*mn."""
    x = w.reshape(-1, 8, 32).astype(np.float32)
    nmax = 2 ** bits - 1
    mins = np.maximum(0.0, -x.min(axis=2))
    scales = (x.max(axis=2) + mins) / nmax
    d = _f16(scales.max(axis=1) / 63)
    dmin = _f16(mins.max(axis=1) / 63)
    safe = lambda v: np.where(v == 0, 1.0, v.astype(np.float32))  # noqa: E731
    sc = np.clip(np.rint(scales / safe(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint((x + offset[..., None]) / safe(step)[..., None]), 0, nmax).astype(np.uint8)
    return d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scale_min(sc, mn), q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2c and 2c+1 share 32 bytes: low nibble, high nibble."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K: 256-value blocks of eight 32-value sub-blocks, 4-bit q with 6-bit scales and mins."""
    d, dmin, scales, q = _affine_k(w, 4)
    return np.concatenate([d, dmin, scales, _low_nibbles(q)], axis=1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K: as Q4_K with a fifth bit per value, sub-block j's in bit j of 32 shared bytes."""
    d, dmin, scales, q = _affine_k(w, 5)
    high = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([d, dmin, scales, qh, _low_nibbles(q)], axis=1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: 256-value blocks of sixteen 16-value sub-blocks, 6-bit q - 32 with int8 scales."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scales = np.abs(x).max(axis=2) / 31
    d = _f16(scales.max(axis=1) / 127)
    df = np.where(d == 0, 1.0, d.astype(np.float32))
    sc = np.clip(np.rint(scales / df[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(x / np.where(step == 0, 1.0, step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # two halves of 128 values
    low = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1).reshape(w.shape[0], -1)


_REFERENCE = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
