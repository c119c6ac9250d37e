"""GGUF quantized tensors repacked into the CPU kernels' group kinds, at the file's own bits, without a float copy.

Each type's blocks map onto one group kind exactly (quant.QuantWeight): Q4_0 → int4 symmetric, Q4_1 and Q4_K →
int4 with offsets, Q5_0 → int5 symmetric, Q5_1 and Q5_K → int5 with offsets, Q6_K → int6 symmetric with a scale
per 16, Q8_0 → int8g (int8 in groups of 32). The K-quants keep their own scales as quant.Factors (a float16 factor
per 256 inputs times an integer per 32 or 16), so the kernel holds them exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve_torch import kernel_library
from llmserve_torch.quant import Factors, QuantWeight

# each type's group kind, whether it has offsets (else symmetric) and its scales a block
KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int5", "Q5_1": "int5", "Q5_K": "int5",
         "Q6_K": "int6", "Q8_0": "int8g"}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row → the float16 they hold, as float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes → [n, 32] values: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] bytes, a little-endian bit mask → [n, count] of its bits 0, 1, ... as 0 or 1."""
    mask = np.ascontiguousarray(qh).view("<u4")
    return ((mask >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _parts(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple | None]:
    """(numpy, where the kernel library cannot be built: _unpacked does the same in C) Blocks of one type → (q [n, values], scale [n, scales], offset like scale or None, factors): the group kind's
    values (quant.QuantWeight's: w = q * scale + offset, or (q - centre) * scale); a K-quant's factors (d [n, 1],
    sc [n, scales], dneg, m: scale = d * sc, offset = dneg * m), else None."""
    if qtype == "Q4_0":  # d, 16 bytes: (q - 8) * d
        return _nibbles(blocks[:, 2:]), _f16(blocks[:, 0:2]), None, None
    if qtype == "Q4_1":  # d, m, 16 bytes: q * d + m
        return _nibbles(blocks[:, 4:]), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), None
    if qtype == "Q5_0":  # d, 32 high bits, 16 bytes: (q - 16) * d
        return _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6], 32) << 4), _f16(blocks[:, 0:2]), None, None
    if qtype == "Q5_1":  # d, m, 32 high bits, 16 bytes: q * d + m
        return _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8], 32) << 4), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), None
    if qtype == "Q8_0":  # d, 32 signed bytes: q * d (stored + 128: a symmetric 8-bit group kind's centre)
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(blocks[:, 0:2]), None, None
    n = blocks.shape[0]
    if qtype == "Q6_K":  # 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d: d * sc * (q - 32) per 16
        ql = (blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = ql.reshape(n, 256) | (qh.reshape(n, 256) << 4)
        d, sc = _f16(blocks[:, 208:210]), blocks[:, 192:208].view(np.int8)
        return q, d * sc.astype(np.float32), None, (d, sc, None, None)
    # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high bits), 128 bytes; 8 sub-blocks
    # of 32: d * sc * q - dmin * m
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    qs = blocks[:, -128:].reshape(n, 4, 1, 32)  # 4 chunks of 32 bytes: low nibbles sub-block 2c, high 2c+1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    if qtype == "Q5_K":  # sub-block i's fifth bits: bit i of each of the 32 bytes
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1).reshape(n, 256) << 4)
    sc, m = sc.astype(np.int8), m.astype(np.int8)  # 6 bits
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32), (d, sc, -dmin, m)


# each type's values and groups (scales) a block, and whether it has offsets
_BLOCKS = {"Q4_0": (32, 1, False), "Q4_1": (32, 1, True), "Q5_0": (32, 1, False), "Q5_1": (32, 1, True),
           "Q8_0": (32, 1, False), "Q4_K": (256, 8, True), "Q5_K": (256, 8, True), "Q6_K": (256, 16, False)}


def _unpacked(qtype: str, blocks: np.ndarray) -> tuple | None:
    """_parts by the kernel library (llmserve_gguf_unpack, many times faster), or None where it cannot be built."""
    try:
        lib = kernel_library.load()
    except RuntimeError:
        return None
    from gguf import GGMLQuantizationType

    n, (values, groups, offsets), k_quant = blocks.shape[0], _BLOCKS[qtype], qtype.endswith("_K")
    blocks = np.ascontiguousarray(blocks)
    q, scale = np.empty((n, values), np.uint8), np.empty((n, groups), np.float32)
    offset = np.empty_like(scale) if offsets else None
    factors = (np.empty((n, 1), np.float32), np.empty((n, groups), np.int8),
               *((np.empty((n, 1), np.float32), np.empty((n, groups), np.int8)) if offsets else (None, None))) \
        if k_quant else (None,) * 4
    at = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    if lib.llmserve_gguf_unpack(GGMLQuantizationType[qtype].value, at(blocks), n, at(q), at(scale), at(offset),
                                *map(at, factors)):
        return None
    return q, scale, offset, factors if k_quant else None


def repack(tensor: Any) -> QuantWeight | None:
    """A GGUF reader tensor as a QuantWeight [out, in]; None for float types (F32, F16, BF16)."""
    from gguf import GGML_QUANT_SIZES

    qtype = tensor.tensor_type.name
    if qtype not in KINDS:
        return None
    rows = tensor.data.shape[0]
    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(-1, type_size)
    q, scale, offset, factors = _unpacked(qtype, blocks) or _parts(qtype, blocks)
    as_rows = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)  # noqa: E731
    return QuantWeight(KINDS[qtype], as_rows(q), as_rows(scale).float(), None if offset is None else
                       as_rows(offset).float(), qtype, None if factors is None else Factors(*map(as_rows, factors)))
