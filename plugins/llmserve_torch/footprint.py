"""What one decode step reads and computes, for the limit `llmserve bench offline` prints (llmserve_bench/bound.py).

A step reads every linear's weight once (the LM head included) whatever the batch, and every
sequence's K and V once per layer. The embedding table is not counted: a lookup reads one row per
token; when the LM head is tied to it, the head's linear counts it. Norm weights and biases outside
the linears are a few KiB and are left out.

Only the `nbytes` and `params` of the model's linears (`model.linears()`) are used, so every linear
class (plain, oneDNN-packed, quantized: what a step at a few rows reads) is counted as it is stored.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve_torch.arch import ArchConfig
from llmserve_torch.kv_cache import bytes_per_block


def footprint(model: Any, arch: ArchConfig, kv_dtype: torch.dtype) -> dict[str, int]:
    """weight_bytes and matmul_params of a decode step (per token), and K+V bytes per token of context."""
    lin = model.linears()
    return {
        "weight_bytes": sum(x.nbytes for x in lin),
        "matmul_params": sum(x.params for x in lin),
        "kv_bytes_per_token": bytes_per_block(arch, 1, kv_dtype),
    }
