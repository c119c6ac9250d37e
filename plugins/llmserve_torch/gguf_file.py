"""A llama.cpp GGUF file read with the `gguf` package: its metadata as a transformers config, its tensors
dequantized under Hugging Face names, with llama.cpp's converter transforms undone."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from llmserve.errors import ConfigError
from llmserve_torch.arch import FREQ_FACTORS, ArchConfig, arch_from_hf
from llmserve_torch.gguf_quant import repack
from llmserve_torch.gguf_reader import GGUFFile
from llmserve_torch.quant import QuantWeight

log = logging.getLogger("llmserve.torch")

# the ggml types we dequantize (gguf.quants does the work; each one has a test)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# stored in the cache as they are; the rest become float32, which holds every dequantized value exactly
_EXACT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}

# GGUF general.architecture → tensor names of the HF checkpoint (the block part comes after the layer prefix)
_DECODER_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DECODER_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_NAMES = {
    "llama": (_DECODER_TOP, _DECODER_BLOCK, "model.layers"),
    "qwen2": (_DECODER_TOP, _DECODER_BLOCK, "model.layers"),
    "qwen3": (_DECODER_TOP, _DECODER_BLOCK, "model.layers"),
    "gpt2": (_GPT2_TOP, _GPT2_BLOCK, "transformer.h"),
}
SUPPORTED_ARCHS = tuple(_NAMES)
# GPT-2's Conv1D keeps [in, out]; llama.cpp stores every matrix as [out, in]
_GPT2_TRANSPOSED = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
_MISSING = object()
_ROPE_FREQS = "rope_freqs.weight"


def resolve_gguf(model: str) -> Path:
    """model.model as a GGUF file: the path itself, or the one .gguf in a directory."""
    p = Path(model).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(f"model.model: {model!r} holds {len(found)} .gguf files "
                              f"({', '.join(f.name for f in found)}); pass the one to serve")
        return found[0]
    if not p.is_file():
        raise ConfigError(f"model.model: no such GGUF file {model!r}")
    return p


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's rotary halves)."""
    # the converter did reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values as float32 [rows, cols] (gguf.quants; the reader's shapes are reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(tensor.data, tensor.tensor_type)


class GGUFCheckpoint:
    """An open GGUF file: checked for a supported architecture and tensor types as it opens."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = GGUFFile(path)
        except (OSError, ValueError) as e:  # a truncated or foreign file
            raise ConfigError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.file.tensors}
        self.arch_name = self.meta("general.architecture")
        if self.arch_name not in _NAMES:
            raise ConfigError(f"{path}: GGUF architecture {self.arch_name!r} is not supported by the torch backend "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.meta("split.count", 1) > 1:
            raise ConfigError(f"{path}: a split GGUF (part of {self.meta('split.count')}) is not supported; "
                              "merge it first: llama-gguf-split --merge <first part> <out>.gguf")
        bad = sorted({t.tensor_type.name for t in self.tensors.values()} - set(SUPPORTED_TYPES))
        if bad:
            names = [t.name for t in self.tensors.values() if t.tensor_type.name in bad]
            raise ConfigError(f"{path}: GGUF tensor type(s) {', '.join(bad)} are not supported "
                              f"(e.g. {names[0]}); supported: {', '.join(SUPPORTED_TYPES)}")
        if _ROPE_FREQS in self.tensors and self.arch_name != "llama":
            # llama.cpp reads rope_freqs for its llama architecture only
            raise ConfigError(f"{path}: per-frequency RoPE scaling (rope_freqs) in a {self.arch_name!r} GGUF is "
                              "not supported (llama.cpp applies it to 'llama' files only)")

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (strings decoded, arrays as lists); a ConfigError names a missing required key."""
        value = self.file.meta(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ConfigError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        return value

    def type_counts(self) -> Counter:
        """How many tensors of each ggml type the file holds."""
        return Counter(t.tensor_type.name for t in self.tensors.values())

    def _dtype_name(self) -> str:
        """The checkpoint dtype `model.dtype: auto` means: the matrices' float type, float32 for quantized ones."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) > 1}
        return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")

    def hf_fields(self) -> tuple[str, dict[str, Any]]:
        """The model type and transformers config fields the metadata describes (no transformers import needed)."""
        a = self.arch_name
        k = lambda name, *default: self.meta(f"{a}.{name}", *default)  # noqa: E731
        if "token_embd.weight" not in self.tensors:
            raise ConfigError(f"{self.path}: GGUF has no token_embd.weight tensor")
        # the embedding's rows, not the tokenizer's length: files may pad the vocabulary
        common = dict(vocab_size=int(self.tensors["token_embd.weight"].shape[-1]),
                      bos_token_id=self.meta("tokenizer.ggml.bos_token_id", None),
                      eos_token_id=self.meta("tokenizer.ggml.eos_token_id", None), torch_dtype=self._dtype_name())
        if a == "gpt2":
            return "gpt2", dict(
                n_embd=k("embedding_length"), n_layer=k("block_count"), n_head=k("attention.head_count"),
                n_positions=k("context_length"), n_inner=k("feed_forward_length"),
                layer_norm_epsilon=k("attention.layer_norm_epsilon"), activation_function="gelu_new", **common)
        scaling = k("rope.scaling.type", "none")
        if scaling != "none":
            raise ConfigError(f"{self.path}: GGUF RoPE scaling {scaling!r} is not supported by the torch backend")
        hidden, heads = k("embedding_length"), k("attention.head_count")
        head_dim = k("attention.key_length", hidden // heads)
        if k("rope.dimension_count", head_dim) != head_dim:
            raise ConfigError(f"{self.path}: partial rotary embeddings (rope.dimension_count "
                              f"{k('rope.dimension_count')} < head_dim {head_dim}) are not supported")
        extra = {"attention_bias": "blk.0.attn_q.bias" in self.tensors} if a == "llama" else {}
        theta = float(k("rope.freq_base", 10000.0))
        if _ROPE_FREQS in self.tensors:
            extra["rope_parameters"] = {"rope_type": FREQ_FACTORS, "rope_theta": theta,
                                        "freq_factors": self._freq_factors(head_dim)}
        return a, dict(
            hidden_size=hidden, intermediate_size=k("feed_forward_length"), num_hidden_layers=k("block_count"),
            num_attention_heads=heads, num_key_value_heads=k("attention.head_count_kv", heads), head_dim=head_dim,
            max_position_embeddings=k("context_length"), rms_norm_eps=k("attention.layer_norm_rms_epsilon"),
            rope_theta=theta, hidden_act="silu",
            tie_word_embeddings="output.weight" not in self.tensors, **extra, **common)

    def hf_config(self):
        """The transformers config the metadata describes (saved as the dense cache's config.json)."""
        from transformers import AutoConfig

        model_type, fields = self.hf_fields()
        return AutoConfig.for_model(model_type, **fields)

    def _freq_factors(self, head_dim: int) -> list[float]:
        """rope_freqs: the divisor of each rotary pair's base frequency (how llama.cpp's converter writes Llama 3.1's
        llama3 scaling; the llama3 parameters themselves are not in the file)."""
        factors = dequantize(self.tensors[_ROPE_FREQS]).astype(np.float32).reshape(-1)
        if factors.size != head_dim // 2 or not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ConfigError(f"{self.path}: rope_freqs holds {factors.size} values; expected head_dim/2 = "
                              f"{head_dim // 2} finite positive ones")
        return [float(f) for f in factors]  # float32 → float64 → JSON round-trips exactly

    def arch(self) -> ArchConfig:
        """The ArchConfig of the model (the same translation a config.json goes through, without transformers:
        importing it costs seconds at every start)."""
        model_type, fields = self.hf_fields()
        return arch_from_hf(SimpleNamespace(model_type=model_type, **fields))

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor; None for one the model does not load (GPT-2's tied head, rope_freqs)."""
        top, block, prefix = _NAMES[self.arch_name]
        base, _, kind = gguf_name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m[2] in block:
            return f"{prefix}.{m[1]}.{block[m[2]]}.{kind}"
        if base in top:
            return f"{top[base]}.{kind}"
        if (self.arch_name == "gpt2" and base == "output") or gguf_name == _ROPE_FREQS:
            return None  # rope_freqs went into the config (hf_config)
        raise ConfigError(f"{self.path}: GGUF tensor {gguf_name!r} has no place in the torch backend's "
                          f"{self.arch_name} model")

    def _convert(self, gguf_name: str, w):
        """Undo what llama.cpp's converter did to a tensor beyond renaming it (numpy arrays and QuantWeights)."""
        part = gguf_name.split(".")[-2]
        if self.arch_name == "llama" and part in ("attn_q", "attn_k"):
            heads = self.meta("llama.attention.head_count")
            # K rows are permuted per KV head (convert_hf_to_gguf: n_head = n_head_kv for K)
            n = heads if part == "attn_q" else self.meta("llama.attention.head_count_kv", heads)
            if isinstance(w, QuantWeight):
                return w.map_rows(lambda a: unpermute_rows(a, n).contiguous())
            return unpermute_rows(w, n)
        # GPT-2 wants Conv1D's [in, out]; a QuantWeight stays [out, in], as it always is
        if self.arch_name == "gpt2" and part in _GPT2_TRANSPOSED and not isinstance(w, QuantWeight) and w.ndim == 2:
            return w.T
        return w

    def state_dict(self, quantized: bool = False) -> dict[str, torch.Tensor | QuantWeight]:
        """Every tensor under its HF name: dequantized (float32, or F16/BF16 as stored), or with quantized=True
        each quantized one repacked for the CPU kernels (gguf_quant) without a float copy; logs progress."""
        sd: dict[str, torch.Tensor | QuantWeight] = {}
        todo = [(n, t) for n, t in self.tensors.items() if self.hf_name(n) is not None]
        for name, t in _progress(todo, f"{'repacking' if quantized else 'dequantizing'} {self.path.name}"):
            packed = repack(t) if quantized else None
            if packed is not None:
                sd[self.hf_name(name)] = self._convert(name, packed)
                continue
            w = self._convert(name, dequantize(t))
            w = np.ascontiguousarray(w) if w.flags.writeable else w.copy()  # torch wants a writable buffer
            sd[self.hf_name(name)] = torch.from_numpy(w).to(_EXACT_DTYPES.get(t.tensor_type.name, torch.float32))
        if self.arch_name == "gpt2" and "output.weight" in self.tensors:
            # our GPT-2 ties its head to wte, as HF's GPT-2 does; a quantized copy only differs by rounding
            head = torch.from_numpy(dequantize(self.tensors["output.weight"]).copy())
            wte = sd["transformer.wte.weight"]
            if not torch.equal(head, wte.dequantize() if isinstance(wte, QuantWeight) else wte.float()):
                log.warning("%s: output.weight differs from token_embd.weight (quantized apart); the GPT-2 head "
                            "uses token_embd", self.path.name)
        return sd


def _progress(items: list[tuple[str, Any]], desc: str):
    """Yield the (name, tensor) items with a tqdm bar on a terminal, else a log line every few seconds."""
    total = sum(int(t.n_bytes) for _, t in items) or 1
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False) as bar:
            for item in items:
                yield item
                bar.update(int(item[1].n_bytes))
        return
    t0 = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += int(item[1].n_bytes)
        now = time.perf_counter()
        if now - last >= 5.0:
            log.info("%s: %.0f%% of %.0f MB (%.0fs)", desc, 100 * done / total, total / 1e6, now - t0)
            last = now
