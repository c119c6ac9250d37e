"""Weight-only quantized weights and linears on CPU: int8 per output channel, and group formats of 4 to 8 bits.

The matmuls are our own C kernels (csrc/quant_matmul.cpp for the group formats, csrc/decoder_ops.cpp for int8 at a
few rows) where the kernel library builds, else torch's own (aten._weight_int8pack_mm,
aten._weight_int4pack_mm_for_cpu), which are fast only at a few rows and only with bf16 activations on the
CPUs measured so far. A QuantLinear hands large batches (prefill, many decodes) to a dense copy of the
weight; kernel_plan.py measures where that crossover lies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmserve_torch import kernel_library
from llmserve_torch.kernel_plan import NEVER

GROUP = 32  # a group: llama.cpp's Q4_0 ... Q8_0 block and the K-quants' sub-block (Q6_K's scales: per 16)
# the group kinds and their bits: each GGUF type's blocks map onto one at the file's own bits (gguf_quant.py);
# int8g is int8 in groups of 32 (Q8_0), not int8's one scale per row
GROUP_BITS = {"int4": 4, "int5": 5, "int6": 6, "int8g": 8}
KINDS = ("int8", *GROUP_BITS)
MODES = ("auto", "none", "int8", "int4")


@dataclass(slots=True)
class Factors:
    """A K-quant's own scales, kept so the kernel can hold them exactly: scale = d * sc and offset = dneg * m, with d
    and dneg float16 values per 256 inputs (a super-block) and sc and m int8, one per scale."""

    d: torch.Tensor  # float32 [out, in/256]
    sc: torch.Tensor  # int8, the shape of QuantWeight.scale
    dneg: torch.Tensor | None = None  # with offsets
    m: torch.Tensor | None = None

    def map(self, fn) -> Factors:
        """fn applied to each tensor."""
        return Factors(*(None if t is None else fn(t) for t in (self.d, self.sc, self.dneg, self.m)))


_DEQUANT_ROWS = 4096  # rows a dequantize() step computes in float32


@dataclass(slots=True)
class QuantWeight:
    """A linear's weight, [out, in], stored quantized.

    int8: q int8 [out, in], scale [out]:  w = q * scale
    a group kind of b bits (GROUP_BITS): q uint8 0 .. 2^b - 1 [out, in], scale [out, in/32] (or [out, in/16]: Q6_K's
      scales per 16, "half"), offset like scale or None: w = q * scale + offset (llama.cpp's Q4_1 form), or without
      offsets w = (q - 2^(b-1)) * scale (symmetric: Q4_0, Q5_0, Q6_K, Q8_0)
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor  # float32
    offset: torch.Tensor | None = None  # float32, group kinds with offsets only
    source: str = "rtn"  # where the values came from: a GGUF type (Q4_1, ...) or rtn (rounded at load)
    factors: Factors | None = None  # a K-quant's scale and offset factors (Q4_K, Q5_K, Q6_K), else None

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the matrix it stands for."""
        return tuple(self.q.shape)

    @property
    def bits(self) -> int:
        """Bits a value (int8: 8)."""
        return GROUP_BITS.get(self.kind, 8)

    @property
    def half(self) -> bool:
        """A group kind's scales (and offsets) are per 16 inputs, not per 32."""
        return self.kind != "int8" and self.scale.shape[1] * 16 == self.q.shape[1]

    @property
    def centre(self) -> int:
        """The value a symmetric group kind's zero is stored as: 2^(bits-1)."""
        return 1 << (self.bits - 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix in dtype, computed in float32 a block of rows at a time (a 152k-row embedding table whole took
        1 GB of float32 temporaries)."""
        out = torch.empty(self.shape, dtype=dtype)
        for r in range(0, self.shape[0], _DEQUANT_ROWS):
            out[r:r + _DEQUANT_ROWS] = self._dequantized_rows(slice(r, r + _DEQUANT_ROWS))
        return out

    def _dequantized_rows(self, rows: slice) -> torch.Tensor:
        q, scale = self.q[rows], self.scale[rows]
        if self.kind == "int8":
            return q.float() * scale[:, None]
        per = q.shape[1] // scale.shape[1]  # inputs a scale
        q = q.float().unflatten(1, (-1, per))
        if self.offset is None:
            return ((q - self.centre) * scale[..., None]).flatten(1)
        return (q * scale[..., None] + self.offset[rows][..., None]).flatten(1)

    def map_rows(self, fn) -> QuantWeight:
        """The same weight with fn (a reordering of axis 0, e.g. llama.cpp's Q/K permutation undone) applied."""
        return QuantWeight(self.kind, fn(self.q), fn(self.scale), None if self.offset is None else fn(self.offset),
                           self.source, None if self.factors is None else self.factors.map(fn))


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
    """w as a QuantWeight of that kind (int8 or int4): kept when it is one already, else rounded to nearest from
    floats."""
    if isinstance(w, QuantWeight):
        if w.kind == kind:
            return w
        w = w.dequantize()
    return quantize_int8(w) if kind == "int8" else quantize_int4(w)


def regroup(qw: QuantWeight, kind: str, offsets: bool, half: bool) -> QuantWeight:
    """A group-kind weight in a group kind of as many bits or more, with offsets and scales per 16 if asked: the same
    values exactly (a symmetric weight's offsets are -centre * scale, in float16 whenever its scales are)."""
    bits = GROUP_BITS[kind]
    assert qw.kind in GROUP_BITS and bits >= qw.bits and (offsets or qw.offset is None) and (half or not qw.half)
    q, scale, offset, f = qw.q, qw.scale, qw.offset, qw.factors
    if offset is None and offsets:
        offset = -qw.centre * scale
        if f is not None:
            f = Factors(f.d, f.sc, -qw.centre * f.d, f.sc)
    elif offset is None:  # still symmetric: the same distances from the new centre
        q = (q.to(torch.int16) + ((1 << (bits - 1)) - qw.centre)).to(torch.uint8)
    if half and not qw.half:
        scale = scale.repeat_interleave(2, dim=1)
        offset = None if offset is None else offset.repeat_interleave(2, dim=1)
        if f is not None:
            f = Factors(f.d, f.sc.repeat_interleave(2, dim=1), f.dneg, None if f.m is None else
                        f.m.repeat_interleave(2, dim=1))
    return QuantWeight(kind, q, scale, offset, qw.source, f)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights along the output axis (fused q|k|v, gate|up). Group kinds meet exactly in the widest's bits (with
    offsets if any has them, scales per 16 if any has those) where the kernel has that format; else at int8."""
    kinds = {p.kind for p in parts}
    if kinds <= set(GROUP_BITS):
        kind = max(kinds, key=GROUP_BITS.__getitem__)
        offsets, half = any(p.offset is not None for p in parts), any(p.half for p in parts)
        if group_format(GROUP_BITS[kind], offsets, half) is not None:
            parts = [regroup(p, kind, offsets, half) for p in parts]
        else:
            kind = "int8"
    else:
        kind = "int8"
    parts = [to_kind(p, kind) for p in parts]
    offset = None if parts[0].offset is None else torch.cat([p.offset for p in parts])
    factors = None  # kept where every part has them (K-quants only): else the float16 scales hold them all
    if all(p.factors is not None for p in parts):
        factors = Factors(*(None if getattr(parts[0].factors, n) is None else
                            torch.cat([getattr(p.factors, n) for p in parts]) for n in ("d", "sc", "dneg", "m")))
    sources = sorted({p.source for p in parts})
    return QuantWeight(kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offset,
                       "+".join(sources), factors)


# csrc/decoder_ops.cpp's int8 matmul (activations rounded to int16 per 64) takes up to this many rows and K inputs;
# it beats aten._weight_int8pack_mm at every row count it takes (docs/benchmarks.md, "The kernels' choices").
OWN_INT8_MAX_ROWS = kernel_library.api().limits["INT8_MAX_ROWS"]
OWN_INT8_MAX_K = kernel_library.api().limits["INT8_MAX_K"]
OWN_DTYPES = (torch.float32, torch.bfloat16)  # what our kernels read (they tell them apart by element size)


@functools.cache
def _own_kernels():
    """Our C kernel library (None where it cannot be built: torch's kernels run instead)."""
    try:
        return kernel_library.load()
    except RuntimeError:
        return None


def _own_int8_kernel():
    """Our C int8 matmul for a few rows, or None."""
    lib = _own_kernels()
    return None if lib is None else lib.llmserve_int8_matmul


def own_kernel_isa() -> str | None:
    """The integer SIMD our kernels run on this CPU (avx512-vnni, avx512bw, avx2-vnni, avx2, scalar), or None where
    they do not build."""
    lib = _own_kernels()
    return None if lib is None else lib.llmserve_quant_isa().decode()


def own_quant_tile() -> int:
    """The row tile of our group kernel's weight layout on this CPU: 16 with AVX-512, 8 with AVX2, else 1 (rows in
    order)."""
    return _own_kernels().llmserve_quant_tile()


def group_format(bits: int, offsets: bool, half: bool, sup: bool = False) -> int | None:
    """The kernel library's code for a group format (kernels.h's quant_format), or None where it has no such format
    (or does not build)."""
    lib = _own_kernels()
    fmt = -1 if lib is None else lib.llmserve_quant_format(bits, int(offsets), int(half), int(sup))
    return None if fmt < 0 else fmt


def weight_format(qw: QuantWeight) -> int | None:
    """A group-kind weight's format code for our kernels (None: they cannot run it); a K-quant's factors are kept
    only where the kernel has that format with them (see pack_own)."""
    return group_format(qw.bits, qw.offset is not None, qw.half, qw.factors is not None)


def kernel_form(qw: QuantWeight) -> QuantWeight:
    """qw as our kernel holds it: a K-quant's factors dropped (float16 scales) where no format has them (a fused
    projection that meets Q8_0 in 8 bits)."""
    if qw.factors is None or weight_format(qw) is not None:
        return qw
    return QuantWeight(qw.kind, qw.q, qw.scale, qw.offset, qw.source)


def pack_own(qw: QuantWeight) -> torch.Tensor:
    """csrc/quant_matmul.cpp's form of a group-kind weight (llmserve_pack_weight), one byte tensor: per group of 32
    inputs a row's values (4 * bits bytes: a nibble plane, then a bit plane for each bit above the fourth), its scales
    (one, or two with scales per 16) and its offsets (as many, or none for a symmetric weight), float16, or for a
    K-quant (qw.factors) int8 multiples of a float16 factor per 256 inputs, which then follow: 4.5 bits a weight for
    Q4_0, 5 for Q4_1, 4.625 for Q4_K, 6.5625 for Q6_K, 8.5 for Q8_0. With tiles of t > 1 rows (AVX-512, AVX2), the
    rows are padded to a whole tile with zeros and each tile's group is its values as 4-byte chunks, chunk c holding
    each row's chunk c in turn, then its scales [parts, t], then its offsets [parts, t], each 256 inputs' groups after
    their factors (d [t], then dneg [t]); with t = 1 (rows in order) a row's groups' values follow each other, then
    its scales [parts, groups], its offsets, its factors d [groups / 8], its dneg."""
    fmt = weight_format(qw)
    if fmt is None:
        raise ValueError(f"no kernel for {qw.kind} with{'' if qw.offset is not None else 'out'} offsets")
    out, k = qw.shape
    f = qw.factors
    parts = [qw.q.to(torch.uint8), qw.scale.float(), None if qw.offset is None else qw.offset.float()]
    parts += [None] * 4 if f is None else [f.sc.to(torch.int8), None if f.m is None else f.m.to(torch.int8),
                                           f.d.float(), None if f.dneg is None else f.dneg.float()]
    parts = [None if t is None else t.contiguous() for t in parts]
    lib = _own_kernels()
    packed = torch.empty(lib.llmserve_quant_bytes(fmt, out, k), dtype=torch.uint8)
    if lib.llmserve_pack_weight(fmt, *(None if t is None else t.data_ptr() for t in parts), out, k,
                                packed.data_ptr()):
        raise ValueError(f"{qw.kind} scales or offsets beyond float16's range")
    return packed


_DENSE_COLUMNS = 128  # inputs ensure_dense reads back at a time


class QuantLinear:
    """y = x @ w.T (+ bias) through a weight-only quantized kernel, or a dense copy above plan's row limit."""

    __slots__ = ("kind", "source", "out_features", "in_features", "bias", "plan", "dense", "densify", "_w", "_scale",
                 "_zero", "_scales", "_fmt", "bits_read")

    fused_gelu = False  # no post-op fusion in these kernels: the model applies its activation itself

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, plan, dense=None, densify=None):
        qw = kernel_form(qw)
        self._fmt = weight_format(qw) if qw.kind in GROUP_BITS else None
        if qw.kind in GROUP_BITS and self._fmt is None and not (qw.kind == "int4" and _own_kernels() is None):
            qw = to_kind(qw, "int8")  # no kernel for this format here: int8 per row, rounded once more
        self.kind = qw.kind
        self.source = qw.source
        self.out_features, self.in_features = qw.shape
        self.bias = bias
        self.plan = plan  # kernel_plan.KernelPlan: activation dtype and dense row limit per kind
        self.dense = dense  # a common.Linear over the dequantized weight, or None
        # float [out, in] weight → its dense Linear: how ensure_dense() makes one when the plan wants it (None: never)
        self.densify = densify
        if qw.kind == "int8":
            self._w = qw.q.contiguous()
        self._scale, self._zero = qw.scale, None
        if self._fmt is not None:  # our kernel: values, scales and offsets in one tensor of its own layout
            self._w, self._scale = pack_own(qw), None
        elif qw.kind == "int4":
            # torch's form: w = (q - 8) * scale + zero; its CPU packing takes int32 values 0..15, two a byte,
            # [out, in/2]
            self._zero = (qw.offset if qw.offset is not None else -8 * qw.scale) + 8 * qw.scale
            self._w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
        self._scales = {}  # activation dtype → scales in it (torch's kernels want them in the activation dtype)
        self.bits_read = 8 * self.nbytes / self.params  # a weight's bits the quantized kernel reads (scales too)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, kind: str, source: str, fmt: int, out_in: tuple[int, int],
                    bias: torch.Tensor | None, plan, densify=None) -> QuantLinear | None:
        """A linear over a tensor pack_own made earlier (packed_cache.py); None where it is not that format's size."""
        out, k = out_in
        if packed.dtype != torch.uint8 or packed.numel() != _own_kernels().llmserve_quant_bytes(fmt, out, k):
            return None
        self = cls.__new__(cls)
        self.kind, self.source, self.out_features, self.in_features = kind, source, out, k
        self.bias, self.plan, self.dense, self.densify = bias, plan, None, densify
        self._w, self._scale, self._zero, self._scales, self._fmt = packed, None, None, {}, fmt
        self.bits_read = 8 * self.nbytes / self.params
        return self

    @property
    def nbytes(self) -> int:
        """Bytes a quantized matmul reads: the packed values and their scales (and offsets)."""
        n = self._w.numel() * self._w.element_size()
        if self.kind == "int8":
            return n + self.out_features * 2
        if self._fmt is not None:  # its scales and offsets are in it (rows padded to the kernel's tile)
            return n
        return n + self.out_features * (self.in_features // GROUP) * 2 * 2  # in the bf16 activations for torch's

    @property
    def kernel(self) -> str:
        """Which matmul runs the quantized rows (for /stats and the start-up log)."""
        if self._fmt is not None:
            return f"llmserve {self.kind} (int16 activations, {own_kernel_isa()})"
        if self.kind == "int8" and _own_int8_kernel() is not None:
            return f"llmserve int8 (int16 activations, {own_kernel_isa()}) up to {OWN_INT8_MAX_ROWS} rows, then aten"
        return f"aten {self.kind}"

    @property
    def params(self) -> int:
        """Multiply-accumulates per row of input."""
        return self.out_features * self.in_features

    @property
    def fmt(self) -> int | None:
        """The group format our kernel runs it in (kernels.h's quant_format), or None (int8, or torch's int4)."""
        return self._fmt

    @property
    def own_int8(self) -> bool:
        """int8 that llmserve's own kernel runs (up to OWN_INT8_MAX_ROWS rows)."""
        return self.kind == "int8" and _own_int8_kernel() is not None and self.in_features <= OWN_INT8_MAX_K

    def max_quantized_rows(self) -> int:
        """The most rows a call runs in the quantized kernel (more go to the dense copy, where there is one)."""
        return self.plan.choice(self.kind)[1] if self.dense is not None else NEVER

    def ensure_dense(self, dtype: torch.dtype = torch.float32) -> None:
        """Make the dense copy if there is none: the weight read back through the quantized kernel (x = I gives w.T),
        so no float copy exists until a plan asks for one; dtype: the serving dtype (no second copy to cast)."""
        if self.dense is not None or self.densify is None:
            return
        with torch.inference_mode():
            # a block of inputs at a time, into one float32 matrix: a 152k-row head read back whole took a second
            # [in, out] float32 copy (545 MB) at once
            w = torch.empty((self.out_features, self.in_features), dtype=dtype)  # (densify keeps a dtype it wants)
            eye = torch.eye(self.in_features)
            for i in range(0, self.in_features, _DENSE_COLUMNS):
                w[:, i:i + _DENSE_COLUMNS] = self.quantized(eye[i:i + _DENSE_COLUMNS], torch.float32).float().t()
            del eye
            self.dense = self.densify(w)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What our kernels read: int8 values and their float32 scales, or (a group kind) pack_own's tensor and None."""
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
        """The quantized kernel with activations in act (result in act; ours: int8 gives float32, a group kind x's
        dtype)."""
        if self.kind == "int8":
            own = _own_int8_kernel()
            rows = x.shape[0]
            if own is not None and rows <= OWN_INT8_MAX_ROWS and self.in_features <= OWN_INT8_MAX_K and \
                    x.dtype in OWN_DTYPES:
                y = torch.empty((rows, self.out_features), dtype=torch.float32)
                xc = x.contiguous()  # it reads float32 or bf16 directly: no cast to act
                own(xc.data_ptr(), xc.stride(0), rows, self._w.data_ptr(), self._scale.data_ptr(), y.data_ptr(),
                    y.stride(0), self.out_features, self.in_features, xc.element_size(), torch.get_num_threads())
                return y
        elif self._fmt is not None:  # packed for our kernel: it reads float32 or bf16 directly, any rows
            xc = x.contiguous() if x.dtype in OWN_DTYPES else x.float().contiguous()
            y = torch.empty((xc.shape[0], self.out_features), dtype=xc.dtype)  # it writes x's dtype
            _own_kernels().llmserve_quant_matmul(self._fmt, xc.data_ptr(), xc.stride(0), xc.shape[0], self._w.data_ptr(),
                                                 y.data_ptr(), y.stride(0), self.out_features, self.in_features,
                                                 xc.element_size(), y.element_size(), torch.get_num_threads(), 0)
            return y
        xa = (x if x.dtype == act else x.to(act)).contiguous()
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(xa, self._w, self.scales_for(act))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self._w, GROUP, self.scales_for(act))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        act, limit = self.plan.choice(self.kind)
        dense = self.dense  # (read once: a plan may drop it meanwhile)
        if dense is not None and x.shape[0] > limit:
            return dense(x)
        y = self.quantized(x, act)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y += self.bias
        return y
