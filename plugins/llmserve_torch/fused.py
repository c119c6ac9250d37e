"""The elementwise steps of a Llama-style layer: fused C kernels on CPU (csrc/decoder_ops.cpp), Triton kernels on a
GPU (triton_kernels.py), torch elsewhere.

At one sequence a SmolLM2 decode step ran ~40 small torch ops a layer (RMSNorm alone is six), which
cost more in dispatch than the quantized matmuls cost in arithmetic; each step below is one call.
Both implementations round where Hugging Face's code rounds, so they agree up to float summation order.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from llmserve_torch import kernel_library
from llmserve_torch.attention import triton_unavailable_on

log = logging.getLogger("llmserve.torch")

DECODER_OPS = ("auto", "torch", "cpu", "triton")


class TorchOps:
    """The reference: plain torch ops, any device and dtype."""

    name = "torch"

    def add_rms(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (in place, when given), then w * rms_norm(x) normalized in float32 as HF does."""
        if delta is not None:
            x += delta
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def tables(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's float32 cos/sin rows [T, head_dim/2] in the form rope() takes (rounded to dtype, as HF's)."""
        return cos.to(dtype), sin.to(dtype)

    def rope(self, qk: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row; cos/sin [T, head_dim/2] in x's dtype."""
        T = qk.shape[0]
        x = qk[:, :heads * head_dim].view(T, heads, head_dim)
        half = head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))

    def silu_mul(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(gate) * up for gate|up rows."""
        return F.silu(gu[:, :inter]) * gu[:, inter:]


class CpuOps(TorchOps):
    """One C call per step (float32 and bfloat16 on CPU)."""

    name = "cpu"

    def __init__(self, lib):
        self._rms, self._rope, self._silu = lib.llmserve_add_rms_norm, lib.llmserve_rope, lib.llmserve_silu_mul

    def add_rms(self, x, delta, w, eps):
        out = torch.empty_like(x)
        d_ptr, d_stride = (0, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
        self._rms(x.data_ptr(), x.stride(0), d_ptr or None, d_stride, w.data_ptr(), out.data_ptr(), out.stride(0),
                  x.shape[0], x.shape[1], eps, x.element_size(), torch.get_num_threads())
        return out

    def tables(self, cos, sin, dtype):
        return cos.to(dtype).float().contiguous(), sin.to(dtype).float().contiguous()

    def rope(self, qk, heads, head_dim, cos, sin):
        self._rope(qk.data_ptr(), qk.stride(0), qk.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                   qk.element_size(), torch.get_num_threads())

    def silu_mul(self, gu, inter):
        out = torch.empty((gu.shape[0], inter), dtype=gu.dtype)
        self._silu(gu.data_ptr(), gu.stride(0), out.data_ptr(), out.stride(0), gu.shape[0], inter,
                   gu.element_size(), torch.get_num_threads())
        return out


class TritonOps(TorchOps):
    """One launch per step on a GPU (each of torch's would be several: RMSNorm alone is six)."""

    name = "triton"

    def __init__(self):
        from llmserve_torch import triton_kernels  # only where Triton is installed

        self.add_rms, self.rope, self.silu_mul = (triton_kernels.add_rms, triton_kernels.rope,
                                                  triton_kernels.silu_mul)


def _triton_ops(device: torch.device, kind: str) -> TorchOps:
    """Triton's ops where Triton runs on this device; torch's otherwise (an error if triton was asked for)."""
    why = triton_unavailable_on(device)
    if why is None:
        return TritonOps()
    if kind == "triton":
        raise ValueError(f"backend.options.decoder_ops: triton cannot be used: {why}")
    log.info("decoder ops: torch (%s)", why)
    return TorchOps()


def decoder_ops(device: torch.device, dtype: torch.dtype, kind: str = "auto") -> TorchOps:
    """kind auto: the C kernels on a CPU (float32/bfloat16, a compiler), Triton's on CUDA, else torch; or
    torch | cpu | triton."""
    if kind == "triton" or (kind == "auto" and device.type == "cuda"):
        return _triton_ops(device, kind)
    if kind == "torch" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        if kind == "cpu":
            raise ValueError(f"the fused CPU ops need a CPU and float32/bfloat16, not {device} {dtype}")
        return TorchOps()
    try:
        return CpuOps(kernel_library.load())
    except RuntimeError as e:  # (load warned once, naming the cost)
        if kind == "cpu":
            raise ValueError(str(e)) from None
        return TorchOps()
