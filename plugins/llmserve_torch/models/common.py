"""Pieces both model families share: the linear layers (oneDNN pre-packed on CPU) and the LM head."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from llmserve_torch.packed_cache import Deferred, Packed, cat_packed
from llmserve_torch.quant import QuantLinear, QuantWeight, cat_rows, kernel_form, to_kind, weight_format
from llmserve_torch.quant_embedding import QuantEmbedding

log = logging.getLogger("llmserve.torch")

# Measured on a 2-core AVX-512 CPU (torch 2.13, MKL/oneDNN): [64, 768] x [50257, 768]^T ran at 44 GFLOP/s
# in fp32 as one F.linear and at 130 GFLOP/s in chunks of 4096 vocabulary rows (bf16: 208 → 320).
# With a oneDNN-packed weight the one call runs at ~206 (bf16 ~404), so chunks are the fallback only.
LM_HEAD_CHUNK = 4096

LINEAR_KINDS = ("auto", "torch", "onednn")


@functools.cache
def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's pre-packed linear (the op torch.compile uses on CPU) runs here for this dtype and agrees
    with F.linear: the torch build must have it, and for bf16 the CPU must too (AVX512BW/VL/DQ or AVX_NE_CONVERT;
    on an AVX2-only CPU torch refuses to pack a bf16 weight)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and ops is not None and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    try:  # a packed GEMM must agree with F.linear before we trust it with a model
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        x = torch.randn(5, 32, generator=g).to(dtype)
        got = Linear(w, None, True)(x).float()
        return torch.allclose(got, F.linear(x, w).float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    except RuntimeError as e:
        log.info("oneDNN packed linear unusable for %s (%s); using F.linear", dtype, e)
        return False


class Linear:
    """y = x @ weight.T (+ bias): oneDNN with a weight packed once for it, or F.linear.

    On the dev CPU (AMD, AVX-512) the packed fp32 GEMM at 64 rows ran at ~225 GFLOP/s against ~150 for
    F.linear (MKL), and bf16 at ~447 against ~400, so pre-packing is the default wherever it exists.
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "post")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, batch_hint: int = 64,
                 gelu_tanh: bool = False):
        self.out_features = weight.shape[0]
        # tanh-GELU fused into the packed GEMM as a oneDNN post-op (one pass fewer over the MLP activations)
        self.post = ("gelu", [], "tanh") if gelu_tanh and pack else ("none", [], "")
        self.bias = bias
        self.packed = None
        self.weight = weight
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
            self.weight = None  # the packed copy replaces it (callers keep their own reference if they need one)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from memory: the weight (plain or packed) and the bias."""
        w = self.weight if self.packed is None else self.packed
        return w.nbytes + (0 if self.bias is None else self.bias.nbytes)

    @property
    def params(self) -> int:
        """Multiply-accumulates per input row: out_features × in_features."""
        return (self.weight if self.packed is None else self.packed).numel()

    @property
    def fused_gelu(self) -> bool:
        return self.post[0] == "gelu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, *self.post)
        return F.linear(x, self.weight, self.bias)


class LinearMaker:
    """Builds a model's linears from its state dict: dense (oneDNN-packed or F.linear) or, for a QuantWeight,
    a QuantLinear with a dense copy for large batches (kernel_plan decides where each runs)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, pack: bool, batch_hint: int, plan=None,
                 dense_copy: bool = True, packed=None, group_dense_copies: bool = True):
        self.dtype, self.device, self.pack, self.batch_hint = dtype, device, pack, batch_hint
        self.plan = plan  # kernel_plan.KernelPlan, filled in after the model is built
        self.dense_copy = dense_copy
        # dense copies also of weights our kernels run at any row count (group kinds), not only of int8 per row
        self.group_dense_copies = group_dense_copies
        self.packed = packed  # packed_cache.PackedCache: linears packed at an earlier start, or None
        # id of a state dict's QuantWeight (or of a stack of them) → the names of the weights it holds, for the
        # packed cache (names(sd) fills it); what was made from which names, for the cache to save
        self.names: dict[int, tuple[str, ...]] = {}
        self.made: list[tuple[tuple[str, ...], QuantLinear]] = []

    def read(self, w):
        """A Deferred weight read from its file now (its names kept for the packed cache); anything else as it is."""
        if not isinstance(w, Deferred):
            return w
        q = w.load()
        self.names[id(q)] = w.names
        return q

    def name(self, sd: dict) -> None:
        """Remember the name of each QuantWeight in sd (the packed cache keys linears by their weights' names)."""
        self.names.update({id(v): (k,) for k, v in sd.items() if isinstance(v, QuantWeight)})

    def embedding(self, w, shared: bool):
        """An embedding table: a quantized one kept packed where our kernels hold its format on this CPU (a
        QuantEmbedding over the linear of w; `shared`: that linear is the tied LM head), else a float tensor."""
        w = self.read(w)
        if isinstance(w, Packed) or (isinstance(w, QuantWeight) and self.device.type == "cpu"
                                     and weight_format(kernel_form(w)) is not None):
            return QuantEmbedding(self(w), self.dtype, shared)
        return self.tensor(w)

    def tensor(self, t: torch.Tensor | QuantWeight) -> torch.Tensor:
        """A float tensor in the model's dtype and device (a QuantWeight dequantized: an embedding table)."""
        if isinstance(t, QuantWeight):
            t = t.dequantize(self.dtype if self.device.type == "cpu" else torch.float32)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, parts: list) -> torch.Tensor | QuantWeight:
        """Weights stacked along the output axis (fused q|k|v, gate|up), quantized or not."""
        if all(isinstance(p, Packed) for p in parts):
            return cat_packed(parts)
        parts = [self.read(p) for p in parts]
        if any(isinstance(p, QuantWeight) for p in parts):
            names = [self.names.pop(id(p), None) for p in parts]
            out = cat_rows([p if isinstance(p, QuantWeight) else to_kind(p, "int8") for p in parts])
            if all(names):
                self.names[id(out)] = sum(names, ())
            return out
        return torch.cat(parts)

    def __call__(self, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
                 gelu_tanh: bool = False) -> Linear | QuantLinear:
        """The linear for a [out, in] weight."""
        b = None if bias is None else self.tensor(bias)
        if not isinstance(w, QuantWeight):
            return Linear(self.tensor(w), b, self.pack, self.batch_hint, gelu_tanh)
        if self.device.type != "cpu":
            raise ValueError(f"quantized weights run on CPU only; this model is on {self.device}: use "
                             "model.quantization none")
        # a dense copy only when the kernel plan uses one (made then, from the packed weight): none at load
        densify = (lambda weight: Linear(weight.to(self.dtype).contiguous(), b, self.pack, self.batch_hint)) \
            if self.dense_copy else None
        w = self.read(w)
        names = w.names if isinstance(w, Packed) else self.names.pop(id(w), None)
        lin = self.packed.linear(names, b, self.plan, densify) if self.packed is not None and names else None
        if lin is None:
            if isinstance(w, Packed):
                raise ValueError(f"the packed cache holds no usable entry for {', '.join(w.names)}; delete "
                                 f"{self.packed.path} to repack from the GGUF")
            lin = QuantLinear(w, b, self.plan, densify=densify)
        if lin.fmt is not None and not self.group_dense_copies:
            lin.densify = None  # the plan runs the quantized kernel at every row count: no dense copy, ever
        if names:
            self.made.append((names, lin))
        return lin


def choose_packing(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """linear: auto | torch | onednn → whether to pre-pack weights (onednn must work or it is an error)."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"backend.options.linear: must be one of {', '.join(LINEAR_KINDS)}, got {kind!r}")
    if kind == "torch":
        return False
    ok = onednn_available(device, dtype)
    if kind == "onednn" and not ok:
        raise ValueError(f"backend.options.linear: onednn is not available for {dtype} on {device} "
                         "(this torch build or this CPU lacks it)")
    return ok


def lm_head(x: torch.Tensor, head: Linear | QuantLinear, chunk: int = LM_HEAD_CHUNK) -> torch.Tensor:
    """float32 logits for a large vocabulary: one packed GEMM, or F.linear in vocabulary chunks on CPU.

    Chunks are written straight into the float32 result, so bf16 logits never take a pass of their own.
    """
    n = head.out_features
    if not isinstance(head, Linear) or head.packed is not None or n <= 2 * chunk or x.device.type != "cpu":
        return head(x).float()
    w = head.weight
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk):
        out[:, start:start + chunk] = F.linear(x, w[start:start + chunk])
    return out
