"""Attention over the paged KV cache: the kernel seam (`backend.options.attention`).

Kernels:
  reference  pure torch, any device: gathers each request's K/V by slot and runs SDPA per request.
  cpu        a C++ kernel (built once with the system compiler, loaded with ctypes) that reads
             every K/V block in place through the block tables; float32 and bfloat16.
  triton     Triton kernels (triton_kernels.py) for the GPU: one launch stores the step's K/V, one attends for
             every token of the step (prompt chunks and decodes alike) reading K/V in place; graph-capturable.
  auto       triton on CUDA (where Triton imports), cpu on a CPU where it builds, else reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig
from llmserve_torch.kv_cache import KVCache

log = logging.getLogger("llmserve.torch")

KERNELS = ("auto", "reference", "cpu", "triton")
_CSRC = Path(__file__).with_name("csrc")
# one library; bf16.h is shared (the longest to compile first: _compile runs them side by side)
_SOURCES = ("quant_matmul.cpp", "decode_layers.cpp", "paged_attention.cpp", "decoder_ops.cpp", "race.cpp")


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

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def kernel_cache_dir() -> Path:
    """Where built kernels live: $LLMSERVE_CACHE_DIR, else kernels/ in llmserve's cache root, else the temp dir."""
    from llmserve_torch.gguf_cache import cache_root  # the one rule for where llmserve caches things

    if os.environ.get("LLMSERVE_CACHE_DIR"):
        return Path(os.environ["LLMSERVE_CACHE_DIR"])
    base = cache_root() / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"llmserve-kernels-{os.getuid()}"


def cpu_id() -> str:
    """The CPU's model name and flags (what a -march=native build and a kernel measurement depend on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ATTENTION = (None, [_P, _L, _P, _P, _P, _I, _P, _P, _P, _L, _I, _I, _I, _I, _I, _F, _I])
# the kernel library's C functions (csrc/): restype and argtypes, set once at load
_SIGNATURES = {
    "llmserve_write_kv": (None, [_P, _L, _P, _L, _P, _P, _P, _I, _L, _I, _I]),
    "llmserve_argmax_f32": (None, [_P, _I, _I, _L, _P, _I]),
    "llmserve_sample_f32": (None, [_P, _I, _I, _L, _P, _P, _P, _P, _P, _P, _I]),
    "llmserve_filter_f32": (None, [_P, _I, _I, _L, _P, _P, _P, _P, _P]),
    "llmserve_paged_attention_f32": _ATTENTION,
    "llmserve_paged_attention_bf16": _ATTENTION,
    "llmserve_add_rms_norm": (None, [_P, _L, _P, _L, _P, _P, _L, _I, _I, _F, _I, _I]),
    "llmserve_rope": (None, [_P, _L, _I, _I, _I, _P, _P, _I, _I]),
    "llmserve_silu_mul": (None, [_P, _L, _P, _L, _I, _I, _I, _I]),
    "llmserve_int8_matmul": (None, [_P, _L, _I, _P, _P, _P, _L, _I, _I, _I, _I]),
    "llmserve_quant_matmul": (None, [_I, _P, _L, _I, _P, _P, _L, _I, _I, _I, _I, _I]),
    "llmserve_quant_format": (_I, [_I, _I, _I, _I]),
    "llmserve_quant_bytes": (_L, [_I, _I, _I]),
    "llmserve_decode_layers": (_I, [_P, _P, _P]),
    "llmserve_quant_isa": (ctypes.c_char_p, []),
    "llmserve_quant_tile": (_I, []),
}


def cxx_flags(march: str) -> list[str]:
    """The kernel library's compiler flags for one target (`native` here; tests build other ISAs' paths too)."""
    return ["-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def kernel_march() -> str:
    """The -march the kernel library is built for: $LLMSERVE_KERNEL_MARCH (e.g. x86-64-v3, to run as an AVX2-only CPU
    would; benchmarks/vs_llama_cpp.py --avx2-only), else native."""
    return os.environ.get("LLMSERVE_KERNEL_MARCH") or "native"


def _compile(cxx: str, flags: list[str], tmp: Path, out: Path) -> None:
    """Each source into an object at once (one compiler a CPU: the group kernel's formats take the longest), then one
    library moved into place atomically (concurrent builders never load a half-written file)."""
    objs = [tmp / f"{Path(f).stem}.o" for f in _SOURCES]
    compile_flags = [f for f in flags if f != "-shared"]
    procs, running = [], []
    for f, o in zip(_SOURCES, objs):
        if len(running) >= (os.cpu_count() or 1):
            running.pop(0).wait(timeout=120)
        p = subprocess.Popen([cxx, *compile_flags, "-c", f"-I{_CSRC}", str(_CSRC / f), "-o", str(o)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        running.append(p)
    for p in procs:
        err = p.communicate(timeout=120)[1]
        if p.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {err.strip()[-400:]}")
    tmp_so = tmp / out.name
    r = subprocess.run([cxx, *flags, *map(str, objs), "-o", str(tmp_so)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-400:]}")
    os.replace(tmp_so, out)


def kernel_library_id() -> str:
    """The built kernel library's file name (it carries the hash of its sources, flags and CPU), or "none"."""
    try:
        return Path(build_kernel()._name).name
    except RuntimeError:
        return "none"


def build_kernel() -> ctypes.CDLL:
    """Compile the csrc/ kernels (paged attention, fused decoder ops) once per source/compiler/CPU (cached on disk)
    into one library and load it."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise RuntimeError(_lib_error)
        try:
            src = b"".join(f.read_bytes() for f in sorted(_CSRC.iterdir()) if f.suffix in (".cpp", ".h"))  # with headers
            cxx = os.environ.get("CXX", "g++")
            march = kernel_march()
            flags = cxx_flags(march)
            # -march=native: the binary is only valid on this kind of CPU, so the CPU is part of the key
            key = hashlib.sha256(src + " ".join([cxx, *flags, sys.platform, cpu_id()]).encode()).hexdigest()[:16]
            out = kernel_cache_dir() / f"paged_attention_{key}.so"
            if not out.exists():
                # once per source/compiler/CPU: up to a minute of silence otherwise on a first start
                log.info("compiling the CPU kernels (csrc/*.cpp, %s -O3 -march=%s) into %s; once per machine",
                         cxx, march, out.parent)
                t0 = time.perf_counter()
                out.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                    _compile(cxx, flags, Path(tmp), out)
                log.info("compiled the CPU kernels in %.1fs", time.perf_counter() - t0)
            lib = ctypes.CDLL(str(out))
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = lib
            return lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _lib_error = f"the CPU attention kernel could not be built: {e}"
            raise RuntimeError(_lib_error) from None


def cpu_kernel_unsupported(arch: ArchConfig, kv: KVCache) -> str | None:
    """Why the CPU kernel cannot serve this model/cache (None when it can)."""
    dev, dt = kv.k.device, kv.k.dtype
    if dev.type != "cpu":
        return f"it runs on CPU only (device is {dev})"
    if dt not in (torch.float32, torch.bfloat16):
        return f"it supports float32 and bfloat16 only (dtype is {dt})"
    if arch.q_size > 8192 or arch.num_heads > 128 or kv.block_size > 64:
        return "it supports heads*head_dim <= 8192, heads <= 128 and block_size <= 64"
    return None


class CPUPagedAttention(PagedAttention):
    """Reads each K/V block in place through the block tables: no per-layer gather, no padding."""

    name = "cpu"

    def __init__(self, arch: ArchConfig, kv: KVCache):
        super().__init__(arch, kv)
        lib = build_kernel()
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


def cpu_argmax():
    """argmax over the rows of a contiguous float32 CPU matrix via the kernel library (None if it cannot build).

    Only for raw model logits (finite): the library is built with -ffast-math.
    """
    try:
        lib = build_kernel()
    except RuntimeError:
        return None
    fn = lib.llmserve_argmax_f32

    def argmax(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.long)
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    return argmax


def cpu_sample():
    """Sampling over the rows of a float32 CPU matrix via the kernel library (csrc/race.cpp), as
    sample(x, temperatures, keys, top_k=None, top_p=None, min_p=None) → tokens, or None if the library cannot
    build: each row's top-k/top-p/min-p filter (None: none), then the keyed race. x's rows are contiguous; masked
    entries are -inf; one temperature (> 0), key (int64, read as uint64) and filter value a row."""
    try:
        lib = build_kernel()
    except RuntimeError:
        return None
    fn = lib.llmserve_sample_f32

    def sample(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, top_k: torch.Tensor | None = None,
               top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
        R = x.shape[0]
        top_k = torch.zeros(R, dtype=torch.int32) if top_k is None else top_k.to(torch.int32).contiguous()
        top_p = torch.ones(R) if top_p is None else top_p.float().contiguous()
        min_p = torch.zeros(R) if min_p is None else min_p.float().contiguous()
        temperatures, keys = temperatures.float().contiguous(), keys.contiguous()
        out = torch.empty(R, dtype=torch.long)
        fn(x.data_ptr(), R, x.shape[1], x.stride(0), temperatures.data_ptr(), top_k.data_ptr(), top_p.data_ptr(),
           min_p.data_ptr(), keys.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    return sample


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
