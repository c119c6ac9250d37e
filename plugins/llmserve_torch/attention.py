"""Attention over the paged KV cache: the kernel seam (`backend.options.attention`).

Kernels:
  reference  pure torch, any device: gathers each request's K/V by slot and runs SDPA per request.
  cpu        the kernel library's (kernel_library.py: csrc/, built once with the system compiler) that reads
             every K/V block in place through the block tables; float32 and bfloat16.
  triton     Triton kernels (triton_kernels.py) for the GPU: one launch stores the step's K/V, one attends for
             every token of the step (prompt chunks and decodes alike) reading K/V in place; graph-capturable.
  auto       triton on CUDA (where Triton imports), cpu on a CPU where it builds, else reference.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.errors import ConfigError
from llmserve_torch import kernel_library
from llmserve_torch.arch import ArchConfig
from llmserve_torch.kv_cache import KVCache

log = logging.getLogger("llmserve.torch")

KERNELS = ("auto", "reference", "cpu", "triton")


@dataclass(slots=True)
class StepMetadata:
    """Per-step indices shared by every layer (built once per step, not per layer)."""

    slots: torch.Tensor  # int64 [T]: where each new token's K/V goes
    tok_req: torch.Tensor  # int32 [T]: the request each token belongs to
    tok_pos: torch.Tensor  # int32 [T]: each token's position
    block_tables: torch.Tensor  # int32 [R, max_blocks]
    q_starts: list[int]  # per request: first flattened token
    q_lens: list[int]  # per request: tokens computed this step
    ctx_lens: list[int]  # per request: tokens in context after this step
    num_tokens: int


class PagedAttention:
    """Writes the step's K/V into the cache and attends over it; subclasses differ in how they read."""

    name = "base"

    def __init__(self, arch: ArchConfig, kv: KVCache):
        self.arch = arch
        self.kv = kv
        self.scale = arch.head_dim ** -0.5
        self.meta: StepMetadata | None = None

    def begin_step(self, meta: StepMetadata) -> None:
        """Remember this step's metadata (and precompute what every layer reuses)."""
        self.meta = meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads*head_dim], k/v [T, kv_heads*head_dim] (views allowed) → [T, heads*head_dim]."""
        raise NotImplementedError


class ReferenceAttention(PagedAttention):
    """Portable and obviously right: per request, gather its context by slot and run SDPA with a causal offset."""

    name = "reference"

    def begin_step(self, meta: StepMetadata) -> None:
        super().begin_step(meta)
        bs = self.kv.block_size
        bt = meta.block_tables.tolist()
        dev = self.kv.k.device
        self._ctx_slots = []
        self._masks = []
        for r, (ql, cl) in enumerate(zip(meta.q_lens, meta.ctx_lens)):
            pos = torch.arange(cl, device=dev)
            blocks = torch.tensor(bt[r][: (cl + bs - 1) // bs], device=dev, dtype=torch.long)
            self._ctx_slots.append(blocks[pos // bs] * bs + pos % bs)
            qpos = torch.arange(cl - ql, cl, device=dev)
            self._masks.append(pos.unsqueeze(0) <= qpos.unsqueeze(1))  # [q, ctx]

    def forward(self, layer, q, k, v):
        a, m = self.arch, self.meta
        self.kv.write(layer, m.slots, k, v)
        out = torch.empty((m.num_tokens, a.q_size), dtype=q.dtype, device=q.device)
        kf, vf = self.kv.k_flat[layer], self.kv.v_flat[layer]
        group = a.num_heads // a.num_kv_heads
        for r, (qs, ql) in enumerate(zip(m.q_starts, m.q_lens)):
            slots = self._ctx_slots[r]
            kr = kf.index_select(0, slots).view(-1, a.num_kv_heads, a.head_dim).transpose(0, 1)
            vr = vf.index_select(0, slots).view(-1, a.num_kv_heads, a.head_dim).transpose(0, 1)
            if group > 1:
                kr = kr.repeat_interleave(group, dim=0)
                vr = vr.repeat_interleave(group, dim=0)
            qr = q[qs:qs + ql].reshape(ql, a.num_heads, a.head_dim).transpose(0, 1)
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=self._masks[r], scale=self.scale)
            out[qs:qs + ql] = o.transpose(0, 1).reshape(ql, a.q_size)
        return out


class TritonPagedAttention(PagedAttention):
    """Triton kernels on the paged cache: a decode-only step runs one program per (token, KV head) and needs
    nothing from the host but the step's tensors (so it can be replayed from a CUDA graph); a step with prompt
    tokens splits each request's tokens into tiles, built here with numpy and copied once per step."""

    name = "triton"

    def __init__(self, arch: ArchConfig, kv: KVCache):
        super().__init__(arch, kv)
        from llmserve_torch import triton_kernels  # only where Triton is installed

        self._kernels = triton_kernels
        self._group = arch.num_heads // arch.num_kv_heads

    def begin_step(self, meta: StepMetadata) -> None:
        super().begin_step(meta)
        self._tiles = None
        self._num_tiles = meta.num_tokens
        if meta.num_tokens != len(meta.q_lens):  # some request computes several tokens: tile them
            tt = self._kernels.attention_tile_tokens(self._group, decode=False)
            ql = np.asarray(meta.q_lens, dtype=np.int64)
            per_req = -(-ql // tt)
            first = np.repeat(np.cumsum(per_req) - per_req, per_req)
            req = np.repeat(np.arange(len(ql)), per_req)
            j = (np.arange(int(per_req.sum())) - first) * tt
            tiles = np.stack([np.asarray(meta.q_starts, dtype=np.int64)[req] + j, np.minimum(tt, ql[req] - j)])
            self._tiles = torch.from_numpy(tiles.astype(np.int32)).to(self.kv.k.device, non_blocking=True)
            self._num_tiles = tiles.shape[1]

    def forward(self, layer, q, k, v):
        a, m, kern = self.arch, self.meta, self._kernels
        kf, vf = self.kv.k_flat[layer], self.kv.v_flat[layer]
        kern.write_kv(k, v, kf, vf, m.slots)
        out = torch.empty((m.num_tokens, a.q_size), dtype=q.dtype, device=q.device)
        tiles = self._tiles
        kern.paged_attention(q, kf, vf, out, m.block_tables, m.tok_req, m.tok_pos,
                             None if tiles is None else tiles[0], None if tiles is None else tiles[1],
                             self._num_tiles, a.num_heads, a.num_kv_heads, a.head_dim, self.kv.block_size, self.scale)
        return out


def triton_unavailable_on(dev: torch.device) -> str | None:
    """Why the Triton kernels cannot run on this device (None when they can)."""
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on a GPU (or on the CPU under TRITON_INTERPRET=1, for tests)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


# --- the C++ CPU kernel --------------------------------------------------------------------------

def cpu_kernel_unsupported(arch: ArchConfig, kv: KVCache) -> str | None:
    """Why the CPU kernel cannot serve this model/cache (None when it can)."""
    dev, dt = kv.k.device, kv.k.dtype
    if dev.type != "cpu":
        return f"it runs on CPU only (device is {dev})"
    if dt not in (torch.float32, torch.bfloat16):
        return f"it supports float32 and bfloat16 only (dtype is {dt})"
    lim = kernel_library.api().limits
    if arch.q_size > lim["ATTN_MAX_Q"] or arch.num_heads > lim["ATTN_MAX_HEADS"] or kv.block_size > lim["ATTN_MAX_BLOCK"]:
        return (f"it supports heads*head_dim <= {lim['ATTN_MAX_Q']}, heads <= {lim['ATTN_MAX_HEADS']} and "
                f"block_size <= {lim['ATTN_MAX_BLOCK']}")
    return None


class CPUPagedAttention(PagedAttention):
    """Reads each K/V block in place through the block tables: no per-layer gather, no padding."""

    name = "cpu"

    def __init__(self, arch: ArchConfig, kv: KVCache):
        super().__init__(arch, kv)
        lib = kernel_library.load()
        self._fn = lib.llmserve_paged_attention_bf16 if kv.k.dtype == torch.bfloat16 else \
            lib.llmserve_paged_attention_f32
        self._write = lib.llmserve_write_kv
        self._elem = kv.k.element_size()
        self._out: torch.Tensor | None = None

    def begin_step(self, meta: StepMetadata) -> None:
        super().begin_step(meta)
        self._threads = torch.get_num_threads()
        T = meta.num_tokens
        if self._out is None or self._out.shape[0] < T:  # grow-only buffer: no fresh pages per layer
            self._out = torch.empty((max(T, 64), self.arch.q_size), dtype=self.kv.k.dtype)
        self._slots_ptr = meta.slots.data_ptr()
        self._args_tail = (meta.block_tables.data_ptr(), meta.block_tables.shape[1], meta.tok_req.data_ptr(),
                           meta.tok_pos.data_ptr())

    def forward(self, layer, q, k, v):
        a, m = self.arch, self.meta
        if k.stride(1) != 1:
            k = k.contiguous()
        if v.stride(1) != 1:
            v = v.contiguous()
        # the K/V store runs in the same library: one call instead of two index_copy_ dispatches per layer
        self._write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), self.kv.k[layer].data_ptr(),
                    self.kv.v[layer].data_ptr(), self._slots_ptr, m.num_tokens, a.kv_size, self._elem, self._threads)
        if q.stride(1) != 1:
            q = q.contiguous()
        out = self._out[: m.num_tokens]
        bt, maxb, treq, tpos = self._args_tail
        self._fn(q.data_ptr(), q.stride(0), self.kv.k[layer].data_ptr(), self.kv.v[layer].data_ptr(), bt, maxb,
                 treq, tpos, out.data_ptr(), out.stride(0), m.num_tokens, a.num_heads, a.num_kv_heads, a.head_dim,
                 self.kv.block_size, self.scale, self._threads)
        return out


def make_attention(name: str, arch: ArchConfig, kv: KVCache) -> PagedAttention:
    """Pick the kernel: an explicit name must work (or fail clearly); auto falls back to reference."""
    if name not in KERNELS:
        raise ConfigError(f"backend.options.attention: must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "reference":
        return ReferenceAttention(arch, kv)
    if name == "triton" or (name == "auto" and kv.k.device.type == "cuda"):
        why = triton_unavailable_on(kv.k.device)
        if why is None:
            return TritonPagedAttention(arch, kv)
        if name == "triton":
            raise ConfigError(f"backend.options.attention: the triton kernels cannot be used: {why}")
        log.info("attention: using the reference kernel (%s)", why)
        return ReferenceAttention(arch, kv)
    why = cpu_kernel_unsupported(arch, kv)
    if why is None:
        try:
            return CPUPagedAttention(arch, kv)
        except RuntimeError as e:
            why = str(e)
    if name == "cpu":
        raise ConfigError(f"backend.options.attention: the cpu kernel cannot be used: {why}")
    log.info("attention: using the reference kernel (%s)", why)
    return ReferenceAttention(arch, kv)
