"""GGUF quantized tensors repacked into the CPU kernels' forms, without keeping a float copy.

4-bit types with a scale and offset per 32 values (Q4_0, Q4_1, Q4_K) map exactly onto int4 in groups
of 32; the rest (Q8_0's per-32 scales, Q5_*, Q6_K) become int8 with one scale per output row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve_torch.quant import QuantWeight, quantize_int8

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row → the float16 they hold, as float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes → [n, 32] values: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _int4_parts(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of one type → (q [n, 32·k], scale, offset [n, k]) with value = q * scale + offset."""
    if qtype == "Q4_0":  # d, 16 bytes: (q - 8) * d
        d = _f16(blocks[:, 0:2])
        return _nibbles(blocks[:, 2:]), d, -8 * d
    if qtype == "Q4_1":  # d, m, 16 bytes: q * d + m
        return _nibbles(blocks[:, 4:]), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    # Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes; 8 sub-blocks of 32: d*sc*q - dmin*m
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 32 bytes: low nibbles sub-block 2c, high 2c+1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def repack(tensor: Any) -> QuantWeight | None:
    """A GGUF reader tensor as a QuantWeight [out, in]; None for float types (F32, F16, BF16)."""
    from gguf import GGML_QUANT_SIZES

    qtype = tensor.tensor_type.name
    if qtype in INT4_TYPES:
        rows = tensor.data.shape[0]
        _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        q, scale, offset = _int4_parts(qtype, np.asarray(tensor.data).reshape(-1, type_size))
        as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)  # noqa: E731
        return QuantWeight("int4", as_rows(q), as_rows(scale).float(), as_rows(offset).float(), qtype)
    if qtype in INT8_TYPES:
        from gguf.quants import dequantize

        w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
        return quantize_int8(w, qtype)
    return None
