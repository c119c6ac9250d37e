"""What one decode step reads and computes, for the limit `llmserve bench offline` prints (llmserve_bench/bound.py),
and what the model holds in memory, by part (/stats).

A step reads every linear's weight once (the LM head included) whatever the batch, and every
sequence's K and V once per layer. The embedding table is not counted: a lookup reads one row per
token; when the LM head is tied to it, the head's linear counts it. Norm weights and biases outside
the linears are a few KiB and are left out.

Only the `nbytes` and `params` of the model's linears (`model.linears()`) are used, so every linear
class (plain, oneDNN-packed, quantized: what a step at a few rows reads) is counted as it is stored.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from llmserve_torch.arch import ArchConfig
from llmserve_torch.kv_cache import bytes_per_block
from llmserve_torch.quant import QuantLinear


def footprint(model: Any, arch: ArchConfig, kv_dtype: torch.dtype) -> dict[str, int]:
    """weight_bytes and matmul_params of a decode step (per token), and K+V bytes per token of context."""
    lin = model.linears()
    return {
        "weight_bytes": sum(x.nbytes for x in lin),
        "matmul_params": sum(x.params for x in lin),
        "kv_bytes_per_token": bytes_per_block(arch, 1, kv_dtype),
    }


def _status_kib(field: str) -> int | None:
    """A VmRSS-style line of /proc/self/status in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_by_part(model: Any, kv: Any) -> dict[str, int | None]:
    """Bytes by part, for /stats and the start-up log: quantized weights as their kernels hold them, dense float
    copies of quantized weights (only where the kernel plan runs them), dense linears, the embedding table (floats for
    the lookup), the KV tensors (reserved: their pages are backed as tokens are written), and the process's resident
    set now and at its peak."""
    lin = model.linears()
    quant = [x for x in lin if isinstance(x, QuantLinear)]
    embed = getattr(model, "embed", None)
    return {
        "quantized_weights": sum(x.nbytes for x in quant),
        "dense_copies": sum(x.dense.nbytes for x in quant if x.dense is not None),
        "dense_linears": sum(x.nbytes for x in lin if not isinstance(x, QuantLinear)),
        "embedding": getattr(embed, "nbytes", 0),  # (a quantized table that is the LM head's weight: 0)
        "kv_reserved": kv.nbytes if kv is not None else 0,
        "rss": _status_kib("VmRSS"),
        "peak_rss": _status_kib("VmHWM"),
    }


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): loading frees the repacking's
    temporaries, hundreds of MB for a 0.5B model, which glibc otherwise keeps in the process's resident set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
