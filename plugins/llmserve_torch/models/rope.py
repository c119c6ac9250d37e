"""RoPE frequencies for each supported rope type, computed once at load.

Each follows transformers' ROPE_INIT_FUNCTIONS in the same float32 operations and order, so the
frequencies are bit-identical to the ones an HF model rotates with, not merely close. The one exception,
freq_factors, has no transformers counterpart: it is a GGUF's rope_freqs tensor, applied as llama.cpp applies it.
"""

from __future__ import annotations

import math

import torch

from llmserve_torch.arch import Rope


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """1 / theta^(2i/d) for each rotary pair i: [head_dim/2], float32 (unscaled RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def linear_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """Positions divided by factor, which is the same as every frequency divided by it."""
    return default_inv_freq(rope.theta, head_dim) / rope.factor


def llama3_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, the band between blended smoothly."""
    inv_freq = default_inv_freq(rope.theta, head_dim)
    context = rope.original_max_positions
    long_wavelen = context / rope.low_freq_factor  # beyond it: fully scaled
    short_wavelen = context / rope.high_freq_factor  # below it: unscaled
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / rope.factor, inv_freq)
    # 0 at the long edge of the band, 1 at the short edge
    smooth = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = ~(wavelen < short_wavelen) * ~(wavelen > long_wavelen)
    return torch.where(in_band, blended, scaled)


def dynamic_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """Dynamic NTK at a sequence length of max_position_embeddings, the only one we run it at (see context_bound).

    There the stretched base is theta up to rounding, and it is computed as transformers does so the rounding agrees.
    """
    seq_len = context = rope.original_max_positions
    theta = rope.theta * ((rope.factor * seq_len / context) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    return default_inv_freq(theta, head_dim)


def freq_factors_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """A converted GGUF's rope_freqs: each base frequency divided by its own factor, in float32, as llama.cpp does."""
    return default_inv_freq(rope.theta, head_dim) / torch.tensor(rope.freq_factors, dtype=torch.float32)


_INV_FREQ = {"linear": linear_inv_freq, "llama3": llama3_inv_freq, "dynamic": dynamic_inv_freq,
             "freq_factors": freq_factors_inv_freq}


def inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """The rotation per position of each rotary pair for this rope type: [head_dim/2], float32, on the CPU."""
    scaled = _INV_FREQ.get(rope.type)
    return scaled(rope, head_dim) if scaled else default_inv_freq(rope.theta, head_dim)


def rope_tables(rope: Rope, head_dim: int, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of every position for the non-interleaved (rotate-half) RoPE: [max_len, head_dim/2], float32."""
    # the frequencies come from the CPU on every device, as an HF model's buffer does before .to(device)
    freq = inv_freq(rope, head_dim).to(device)
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freq)
    return freqs.cos(), freqs.sin()
