"""A small, normalized description of a model architecture, the same for every family (each family's module in
models/ fills it in from an HF config), and the RoPE settings they share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmserve.errors import ConfigError

# RoPE types whose frequencies we compute exactly as transformers does (see rope_from_hf)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
# not a transformers type: the one a converted GGUF's config.json gets for llama.cpp's explicit per-frequency
# divisors (its rope_freqs tensor), stored as rope_parameters["freq_factors"]
FREQ_FACTORS = "freq_factors"


@dataclass(frozen=True, slots=True)
class Rope:
    """RoPE as the checkpoint configures it: the base, and how a scaled type stretches the frequencies."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, llama3, dynamic
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 0  # llama3: the pretraining context; dynamic: max_position_embeddings
    freq_factors: tuple[float, ...] = ()  # freq_factors: each base frequency's divisor, head_dim/2 of them


@dataclass(slots=True)
class ArchConfig:
    """The numbers a forward pass needs; the same for every family (unused fields keep defaults)."""

    family: str  # the registered model family's name (models/family.py): decoder, gpt2, bert, gemma, ...
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope: Rope = Rope()
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    activation: str = "gelu_new"
    eos_token_id: int | None = None
    torch_dtype: str | None = None  # what the checkpoint says it was saved in
    type_vocab_size: int = 0  # bert: rows of its token-type (segment) embedding
    # why the context may not pass max_position_embeddings (e.g. "GPT-2's learned positions"); "" where it may
    position_limit: str = ""

    @property
    def context_bound(self) -> str:
        """Why max_model_len may not exceed max_position_embeddings, or "" where it may."""
        if self.position_limit:
            return self.position_limit
        if self.rope.type == "dynamic":
            # past it transformers recomputes the frequencies from the longest position of each forward call,
            # so a token's rotation would depend on how the engine batched and chunked it
            return "the context where dynamic-NTK RoPE matches transformers"
        return ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def first_int(v: Any) -> int | None:
    """HF configs give eos_token_id as an int or a list; take the first."""
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def _rope_dict(cfg: Any) -> dict:
    """The RoPE settings dict: rope_parameters (transformers 5) or rope_scaling (transformers 4), else empty."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, name, None)
        if isinstance(params, dict) and params:
            return params
    return {}


def _rope_number(params: dict, key: str, rope_type: str, model_type: str) -> float:
    """A setting the rope type needs; a checkpoint without it is refused rather than guessed."""
    if params.get(key) is None:
        raise ConfigError(f"model {model_type}: RoPE type {rope_type!r} needs {key!r} in rope_parameters")
    return float(params[key])


def rope_from_hf(cfg: Any) -> Rope:
    """The RoPE settings of a transformers 4 or 5 config; a type we cannot compute exactly is refused."""
    params = _rope_dict(cfg)
    mt = cfg.model_type
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == FREQ_FACTORS:
        return _freq_factors_rope(params, cfg)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"model {mt}: RoPE type {rope_type!r} is not supported by the torch backend "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConfigError(f"model {mt}: partial_rotary_factor {params['partial_rotary_factor']} is not supported "
                          "(the torch backend rotates the whole head)")
    theta = float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    if rope_type == "default":
        return Rope(theta=theta)
    factor = _rope_number(params, "factor", rope_type, mt)
    if rope_type == "linear":
        return Rope(theta=theta, type=rope_type, factor=factor)
    if rope_type == "dynamic":
        # transformers scales dynamic NTK against max_position_embeddings, not an original length
        return Rope(theta=theta, type=rope_type, factor=factor,
                    original_max_positions=cfg.max_position_embeddings)
    # llama3: like transformers, a top-level original_max_position_embeddings wins over the dict's
    original = (getattr(cfg, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    return Rope(theta=theta, type=rope_type, factor=factor,
                low_freq_factor=_rope_number(params, "low_freq_factor", rope_type, mt),
                high_freq_factor=_rope_number(params, "high_freq_factor", rope_type, mt),
                original_max_positions=int(original))


def _freq_factors_rope(params: dict, cfg: Any) -> Rope:
    """Explicit per-frequency divisors (a converted GGUF's rope_freqs): one finite positive number per rotary pair."""
    factors = params.get("freq_factors")
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if (not isinstance(factors, (list, tuple)) or len(factors) != (head_dim or 0) // 2
            or not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors)):
        raise ConfigError(f"model {cfg.model_type}: RoPE type {FREQ_FACTORS!r} needs 'freq_factors' in "
                          f"rope_parameters: head_dim/2 = {(head_dim or 0) // 2} finite positive numbers")
    theta = float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    return Rope(theta=theta, type=FREQ_FACTORS, freq_factors=tuple(float(f) for f in factors))


def config_dtype(cfg: Any) -> str | None:
    """The dtype a config says the checkpoint was saved in (float32, bfloat16, ...), or None."""
    # read the instance dict: transformers 5 warns on the deprecated `torch_dtype` property,
    # while 4.x stores only `torch_dtype`
    dtype = vars(cfg).get("dtype") or vars(cfg).get("torch_dtype")
    return str(dtype).replace("torch.", "") if dtype is not None else None
