"""The backend-owned paged K/V tensors and the budget that sizes them (tokens, bytes or a fraction of free memory)."""

from __future__ import annotations

import os
import re

import torch

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can take now: CUDA free memory, or MemAvailable on Linux."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_bytes(value: str | int | float, key: str = "value") -> int:
    """'512MiB', '2G', 1048576 → bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    s = str(value).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for u, mult in units.items():
        if s.endswith(u):
            try:
                return int(float(s[: -len(u)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ConfigError(f"{key}: expected bytes such as '512MiB' or a fraction such as 0.2, got {value!r}") from None


def budget_bytes(value: str | float | int, device: torch.device, reserve: int = 0) -> int:
    """kv_cache_memory → bytes: a number in (0, 1] is a fraction of free memory (less `reserve`, what the forward
    passes will take), else bytes ('512MiB')."""
    key = "backend.kv_cache_memory"
    frac = None
    if isinstance(value, float) and not isinstance(value, bool):
        frac = value if value <= 1.0 else None
        if frac is None:
            return int(value)
    elif isinstance(value, str):
        try:
            f = float(value)
            if f <= 1.0:
                frac = f
        except ValueError:
            pass
    if frac is not None:
        if not 0.0 < frac <= 1.0:
            raise ConfigError(f"{key}: a fraction of free memory must be in (0, 1], got {value!r}")
        return int(frac * max(free_memory_bytes(device) - reserve, 0))
    n = parse_bytes(value, key)
    if n <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return n


DEFAULT_TOKENS = 32768  # the default KV cache: room for this many tokens (as `llama-server -c 32768`), any machine


def parse_tokens(value: str | float | int) -> int | None:
    """'32768 tokens' → 32768; None for a size in bytes or a fraction of free memory."""
    m = re.fullmatch(r"\s*(\d+)\s*tokens?\s*", value) if isinstance(value, str) else None
    if m is None:
        return None
    if int(m[1]) < 1:
        raise ConfigError(f"backend.kv_cache_memory: room for at least one token, got {value!r}")
    return int(m[1])


def budget_blocks(value: str | float | int, block_size: int, per_block: int, device: torch.device,
                  reserve: int = 0) -> int:
    """kv_cache_memory → KV blocks: 'N tokens' is room for N tokens whatever they take (a fixed context, as llama.cpp
    sizes its cache); bytes or a fraction of free memory hold as many blocks of per_block bytes as fit."""
    tokens = parse_tokens(value)
    if tokens is not None:
        return -(-tokens // block_size)
    return budget_bytes(value, device, reserve) // per_block


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class KVCache:
    """K and V as [layers, blocks, block_size, kv_heads, head_dim]; a slot is block * block_size + offset."""

    def __init__(self, arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 scratch: bool = False):
        self.num_blocks = num_blocks  # what the allocator hands out
        self.block_size = block_size
        # scratch: one more block that no request owns, where the padding rows of a CUDA-graph batch write
        self.scratch_slot = num_blocks * block_size if scratch else None
        shape = (arch.num_layers, num_blocks + scratch, block_size, arch.num_kv_heads, arch.head_dim)
        # empty, not zeros: only slots written this run are ever read, and untouched pages stay unbacked
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        flat = (arch.num_layers, (num_blocks + scratch) * block_size, arch.num_kv_heads * arch.head_dim)
        self.k_flat = self.k.view(flat)
        self.v_flat = self.v.view(flat)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V ([T, kv_heads*head_dim]) at their slots."""
        self.k_flat[layer].index_copy_(0, slots, k)
        self.v_flat[layer].index_copy_(0, slots, v)
