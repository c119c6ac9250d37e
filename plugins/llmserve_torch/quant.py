"""Weight-only quantized weights and linears on CPU: int8 per output channel, int4 in groups of 32.

The matmuls are our own C kernels for a few rows (csrc/quant_matmul.cpp for int4, csrc/decoder_ops.cpp for
int8) where the kernel library builds, else torch's own (aten._weight_int8pack_mm,
aten._weight_int4pack_mm_for_cpu), which are fast only at a few rows and only with bf16 activations on the
CPUs measured so far. A QuantLinear hands large batches (prefill, many decodes) to a dense copy of the
weight; kernel_plan.py measures where that crossover lies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # int4 group size: the group of llama.cpp's Q4_0 / Q4_1 blocks and Q4_K sub-blocks
KINDS = ("int8", "int4")
MODES = ("auto", "none", "int8", "int4")


@dataclass(slots=True)
class QuantWeight:
    """A linear's weight, [out, in], stored quantized.

    int8: q int8 [out, in], scale [out]:                       w = q * scale
    int4: q uint8 0..15 [out, in], scale, offset [out, in/32]: w = q * scale + offset (llama.cpp's Q4_1 form)
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor  # float32
    offset: torch.Tensor | None = None  # float32, int4 only
    source: str = "rtn"  # where the values came from: a GGUF type (Q4_1, ...) or rtn (rounded at load)

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the matrix it stands for."""
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix."""
        if self.kind == "int8":
            return self.q.float() * self.scale[:, None]
        return (self.q.float().unflatten(1, (-1, GROUP)) * self.scale[..., None] + self.offset[..., None]).flatten(1)

    def map_rows(self, fn) -> QuantWeight:
        """The same weight with fn (a reordering of axis 0, e.g. llama.cpp's Q/K permutation undone) applied."""
        return QuantWeight(self.kind, fn(self.q), fn(self.scale), None if self.offset is None else fn(self.offset),
                           self.source)


def quantize_int8(w: torch.Tensor, source: str = "rtn") -> QuantWeight:
    """Round-to-nearest, symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantWeight("int8", q, scale, source=source)


def _half(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x rounded to a float16 value (as float32) no lower (up) or no higher than x."""
    h = x.half()
    off = h.float() < x if up else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h).float()


def quantize_int4(w: torch.Tensor) -> QuantWeight:
    """Round-to-nearest, asymmetric (min/max), one scale and offset per group of 32 inputs.

    Scale and offset are float16 values, as in llama.cpp's Q4_1, so the kernel's float16 copy of them is exact; the
    offset rounds down and the scale up, so the 16 steps still span the group."""
    w = w.float()
    if w.shape[1] % GROUP:
        raise ValueError(f"int4 needs a number of inputs divisible by {GROUP}, got {w.shape[1]}")
    g = w.unflatten(1, (-1, GROUP))
    lo = _half(g.amin(-1), up=False)
    scale = _half(((g.amax(-1) - lo) / 15).clamp_min(2.0 ** -14), up=True)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).flatten(1)
    return QuantWeight("int4", q, scale, lo, "rtn")


def to_kind(w: torch.Tensor | QuantWeight, kind: str) -> QuantWeight:
    """w as a QuantWeight of that kind: kept when it is one already, else rounded to nearest from floats."""
    if isinstance(w, QuantWeight):
        if w.kind == kind:
            return w
        w = w.dequantize()
    return quantize_int8(w) if kind == "int8" else quantize_int4(w)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights along the output axis (fused q|k|v, gate|up); mixed kinds meet at int8."""
    kind = parts[0].kind if len({p.kind for p in parts}) == 1 else "int8"
    parts = [to_kind(p, kind) for p in parts]
    offset = torch.cat([p.offset for p in parts]) if kind == "int4" else None
    sources = sorted({p.source for p in parts})
    return QuantWeight(kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offset,
                       "+".join(sources))


# csrc/decoder_ops.cpp's int8 matmul (activations rounded to int16 per 64), SmolLM2's 49152 x 576 int8 LM head, AMD
# EPYC with AVX512-VNNI, 2 threads, ms at 1/2/4/8 rows: 0.20/0.36/0.73/1.59, float activations 0.38/0.72/1.45/3.07;
# aten._weight_int8pack_mm took 2.81/3.55/3.96/6.53 on an earlier such machine.
OWN_INT8_MAX_ROWS = 8  # kMaxRows in decoder_ops.cpp; it also caps the inputs at kMaxK = 8192
OWN_DTYPES = (torch.float32, torch.bfloat16)  # what our kernels read (they tell them apart by element size)


@functools.cache
def _own_kernels():
    """Our C kernel library (None where it cannot be built: torch's kernels run instead)."""
    from llmserve_torch.attention import build_kernel

    try:
        return build_kernel()
    except RuntimeError:
        return None


def _own_int8_kernel():
    """Our C int8 matmul for a few rows, or None."""
    lib = _own_kernels()
    return None if lib is None else lib.llmserve_int8_matmul


def own_kernel_isa() -> str | None:
    """The integer SIMD our kernels run on this CPU (avx512-vnni, avx512bw, avx2, scalar), or None where they do not
    build."""
    lib = _own_kernels()
    return None if lib is None else lib.llmserve_quant_isa().decode()


def own_int4_tile() -> int:
    """The row tile of our int4 kernel's weight layout on this CPU: 16 with AVX-512, else 1 (rows in order)."""
    return _own_kernels().llmserve_int4_tile()


def pack_int4_own(qw: QuantWeight) -> torch.Tensor:
    """csrc/quant_matmul.cpp's form of an int4 weight: one byte tensor, [tiles, 20 * t * groups] for tiles of t rows.

    A tile's values, then its scales, then its offsets (w = q * scale + offset), each [groups, t] in float16: 5 bits
    a weight, as llama.cpp's Q4_1 (float32 scales and offsets made it 6). Values two a byte, byte j of a group of 32
    holding inputs j (low nibble) and j + 16 (high). With tiles of t > 1 rows (AVX-512), the rows are padded to a
    whole tile with zeros and each tile's group is t rows' 16 bytes as four chunks, chunk c holding each row's bytes
    4c..4c+3 in turn; with t = 1 (rows in order) a row's groups follow each other."""
    g = qw.q.view(qw.q.shape[0], -1, 2, GROUP // 2)
    packed = (g[:, :, 0] | (g[:, :, 1] << 4)).flatten(1)  # [out, in/2]
    scale, offset = qw.scale.half(), qw.offset.half()
    if not (scale.isfinite().all() and offset.isfinite().all()):
        raise ValueError("int4 scales or offsets beyond float16's range")
    t = own_int4_tile()
    pad = -packed.shape[0] % t
    packed, scale, offset = (F.pad(v, (0, 0, 0, pad)) for v in (packed, scale, offset))
    tiles, groups = packed.shape[0] // t, scale.shape[1]
    # [tiles, t rows, groups, 4 chunks, 4 bytes] → [tiles, groups, chunks, rows, bytes]
    packed = packed.view(tiles, t, groups, 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    scale, offset = (v.view(tiles, t, groups).transpose(1, 2).reshape(tiles, -1).view(torch.uint8)
                     .view(tiles, groups, -1) for v in (scale, offset))
    parts = [packed, scale, offset]  # each [tiles, groups, bytes]
    if t > 1:  # group after group
        return torch.cat(parts, dim=2).reshape(tiles, -1).contiguous()
    return torch.cat([v.reshape(tiles, -1) for v in parts], dim=1).contiguous()  # a row's values, scales, offsets


class QuantLinear:
    """y = x @ w.T (+ bias) through a weight-only quantized kernel, or a dense copy above plan's row limit."""

    __slots__ = ("kind", "source", "out_features", "in_features", "bias", "plan", "dense", "_w", "_scale", "_zero",
                 "_scales", "_own4")

    fused_gelu = False  # no post-op fusion in these kernels: the model applies its activation itself

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, plan, dense=None):
        self.kind = qw.kind
        self.source = qw.source
        self.out_features, self.in_features = qw.shape
        self.bias = bias
        self.plan = plan  # kernel_plan.KernelPlan: activation dtype and dense row limit per kind
        self.dense = dense  # a common.Linear over the dequantized weight, or None
        if qw.kind == "int8":
            self._w = qw.q.contiguous()
        self._own4 = qw.kind == "int4" and _own_kernels() is not None
        self._scale, self._zero = qw.scale, None
        if self._own4:  # our kernel: values, scales and offsets in one tensor of its own layout
            self._w, self._scale = pack_int4_own(qw), None
        elif qw.kind == "int4":
            # torch's form: w = (q - 8) * scale + zero; its CPU packing takes int32 values 0..15, two a byte,
            # [out, in/2]
            self._zero = qw.offset + 8 * qw.scale
            self._w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
        self._scales = {}  # activation dtype → scales in it (torch's kernels want them in the activation dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a quantized matmul reads: the packed values and their scales (and offsets)."""
        n = self._w.numel() * self._w.element_size()
        if self.kind == "int8":
            return n + self.out_features * 2
        if self._own4:  # its scales and offsets are in it (rows padded to the kernel's tile)
            return n
        return n + self.out_features * (self.in_features // GROUP) * 2 * 2  # in the bf16 activations for torch's

    @property
    def kernel(self) -> str:
        """Which matmul runs the quantized rows (for /stats and the start-up log)."""
        if self._own4:
            return f"llmserve int4 (int16 activations, {own_kernel_isa()})"
        if self.kind == "int8" and _own_int8_kernel() is not None:
            return f"llmserve int8 (int16 activations, {own_kernel_isa()}) up to {OWN_INT8_MAX_ROWS} rows, then aten"
        return f"aten {self.kind}"

    @property
    def params(self) -> int:
        """Multiply-accumulates per row of input."""
        return self.out_features * self.in_features

    @property
    def own_int4(self) -> bool:
        """int4 packed for llmserve's own kernel."""
        return self._own4

    @property
    def own_int8(self) -> bool:
        """int8 that llmserve's own kernel runs (up to OWN_INT8_MAX_ROWS rows)."""
        return self.kind == "int8" and _own_int8_kernel() is not None and self.in_features <= 8192

    def max_quantized_rows(self) -> int:
        """The most rows a call runs in the quantized kernel (more go to the dense copy, where there is one)."""
        from llmserve_torch.kernel_plan import NEVER

        return self.plan.choice(self.kind)[1] if self.dense is not None else NEVER

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What our kernels read: int8 values and their float32 scales, or (int4) pack_int4_own's tensor and None."""
        return self._w, self._scale

    def relocate(self, place) -> None:
        """The kernel tensors replaced by place(t), a copy of t elsewhere (huge_pages.Arena.copy); values unchanged."""
        self._w = place(self._w)
        if self._scale is not None:
            self._scale = place(self._scale)

    def scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's scale tensor in the activation dtype (made once per dtype)."""
        s = self._scales.get(dtype)
        if s is None:
            if self.kind == "int8":
                s = self._scale.to(dtype).contiguous()
            else:  # [in/32, out, 2]: scale and zero per group and output
                s = torch.stack([self._scale.t(), self._zero.t()], dim=-1).to(dtype).contiguous()
            self._scales[dtype] = s
        return s

    def quantized(self, x: torch.Tensor, act: torch.dtype) -> torch.Tensor:
        """The quantized kernel with activations in act (result in act; ours: int8 gives float32, int4 x's dtype)."""
        if self.kind == "int8":
            own = _own_int8_kernel()
            rows = x.shape[0]
            if own is not None and rows <= OWN_INT8_MAX_ROWS and self.in_features <= 8192 and \
                    x.dtype in OWN_DTYPES:
                y = torch.empty((rows, self.out_features), dtype=torch.float32)
                xc = x.contiguous()  # it reads float32 or bf16 directly: no cast to act
                own(xc.data_ptr(), xc.stride(0), rows, self._w.data_ptr(), self._scale.data_ptr(), y.data_ptr(),
                    y.stride(0), self.out_features, self.in_features, xc.element_size(), torch.get_num_threads())
                return y
        elif self._own4:  # int4 packed for our kernel: it reads float32 or bf16 directly, any rows
            xc = x.contiguous() if x.dtype in OWN_DTYPES else x.float().contiguous()
            y = torch.empty((xc.shape[0], self.out_features), dtype=xc.dtype)  # it writes x's dtype
            _own_kernels().llmserve_int4_matmul(xc.data_ptr(), xc.stride(0), xc.shape[0], self._w.data_ptr(),
                                                y.data_ptr(), y.stride(0), self.out_features, self.in_features,
                                                xc.element_size(), torch.get_num_threads())
            return y
        xa = (x if x.dtype == act else x.to(act)).contiguous()
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(xa, self._w, self.scales_for(act))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self._w, GROUP, self.scales_for(act))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        act, limit = self.plan.choice(self.kind)
        if self.dense is not None and x.shape[0] > limit:
            return self.dense(x)
        y = self.quantized(x, act)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y
