"""Triton kernels for the GPU path: paged attention over the block tables, the K/V store, and a Llama layer's
elementwise steps (residual add + RMSNorm, RoPE, SiLU·up), each one launch.

Everything here runs on any device Triton runs on; on a CPU only under TRITON_INTERPRET=1 (the tests check the
logic that way against the torch reference). Every wrapper reads its inputs through strides and writes a fresh or
given output, and none of them syncs with the host, so a decode step made of them can be captured in a CUDA graph.

Rounding follows the torch reference (fused.TorchOps) step by step: products and sums are taken in float32 and
rounded to the activations' dtype wherever torch would round, so the two agree up to summation order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llmserve_torch import sampling

# query rows (tokens × heads of one KV group) per attention program in a step with prompt tokens
PREFILL_ROWS = 128
# keys per inner step of the attention loop (several KV blocks gathered through the block table)
KEYS_PER_STEP = 64
# Triton's CPU interpreter (tests) multiplies bf16 matrices wrongly (triton 3.9): there every product runs in
# float32 on the same bf16 values, which is what the tensor cores compute up to summation order
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# the block-table width changes from step to step: specializing on it (== 1, divisible by 16) would compile the
# kernel again in the middle of serving, stalling the step it happens in for about a second each time
@triton.jit(do_not_specialize=["bt_stride"])
def _paged_attention_kernel(
        q_ptr, q_stride, k_ptr, v_ptr, kv_stride, out_ptr, out_stride,
        block_tables, bt_stride, tok_req, tok_pos, tile_start, tile_len, qk_scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr,
        F32_DOT: tl.constexpr):
    """One program: up to TILE_TOKENS consecutive tokens of one request × the query heads of one KV head."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:  # one token per tile: the tile is the token, no tile arrays to build or copy
        t0 = tile
        n_tok = 1
    else:
        t0 = tl.load(tile_start + tile)
        n_tok = tl.load(tile_len + tile)
    req = tl.load(tok_req + t0).to(tl.int64)
    # the tile's tokens are consecutive positions of one request: the last one sees the longest context
    kv_len = tl.load(tok_pos + t0 + n_tok - 1) + 1

    rows = tl.arange(0, TILE_TOKENS * GROUP_PAD)
    qi = rows // GROUP_PAD
    gi = rows % GROUP_PAD
    row_ok = (qi < n_tok) & (gi < GROUP)
    tok = (t0 + qi).to(tl.int64)
    head = kvh * GROUP + gi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_pos = tl.load(tok_pos + tok, mask=row_ok, other=0)
    q = tl.load(q_ptr + tok[:, None] * q_stride + head[:, None] * HEAD_DIM + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_dtype = q.dtype
    if F32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([TILE_TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([TILE_TOKENS * GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_len
        blk = tl.load(block_tables + req * bt_stride + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = slot[:, None] * kv_stride + kvh * HEAD_DIM + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # key 0 is visible to every row, so the first step leaves no row at -inf (no NaN from -inf - -inf)
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if F32_DOT:  # p still rounds to the cache's dtype first, as the tensor-core product's operand would
            acc = acc * alpha[:, None] + tl.dot(p.to(kv_dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv_dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention_tile_tokens(group: int, decode: bool) -> int:
    """Tokens per attention program: one in a decode-only step, else as many as fill PREFILL_ROWS query rows."""
    return 1 if decode else max(1, PREFILL_ROWS // _pow2(group))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, tok_req: torch.Tensor, tok_pos: torch.Tensor,
                    tile_start: torch.Tensor | None, tile_len: torch.Tensor | None, num_tiles: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float) -> None:
    """Causal attention of each token over its request's cache (its own new K/V already stored), read in place.

    q/out [T, heads*head_dim] (row strides allowed); k/v_cache [slots, kv_heads*head_dim] of one layer;
    tile_start/tile_len None: a decode-only step, one tile per token (num_tiles = T).
    """
    group = num_heads // num_kv_heads
    decode = tile_start is None
    tile_tokens = attention_tile_tokens(group, decode)
    # tl.dot needs 16 rows: a decode tile pads its group with masked head rows up to that
    gpad = max(_pow2(group), 16 // tile_tokens)
    dummy = tok_pos  # never read in a decode step
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        q, q.stride(0), k_cache, v_cache, k_cache.stride(0), out, out.stride(0),
        block_tables, block_tables.stride(0), tok_req, tok_pos,
        dummy if decode else tile_start, dummy if decode else tile_len, scale * 1.4426950408889634,
        GROUP=group, GROUP_PAD=gpad, TILE_TOKENS=tile_tokens, HEAD_DIM=head_dim, BLOCK_D=_pow2(max(head_dim, 16)),
        BLOCK_N=KEYS_PER_STEP, BLOCK_SIZE=block_size, DECODE=decode, F32_DOT=q.dtype == torch.float32 or INTERPRETED,
        num_warps=4 if decode else 8)


@triton.jit
def _write_kv_kernel(k_ptr, k_stride, v_ptr, v_stride, k_cache, v_cache, slots, KV: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < KV
    tl.store(k_cache + slot * KV + c, tl.load(k_ptr + t.to(tl.int64) * k_stride + c, mask=m), mask=m)
    tl.store(v_cache + slot * KV + c, tl.load(v_ptr + t.to(tl.int64) * v_stride + c, mask=m), mask=m)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [T, kv_size] (row strides allowed) into one layer's cache [slots, kv_size] at slots [T]: one launch."""
    T, kv = k.shape
    if T:
        _write_kv_kernel[(T,)](k, k.stride(0), v, v.stride(0), k_cache, v_cache, slots, KV=kv, BLOCK=_pow2(kv))


@triton.jit
def _add_rms_kernel(x_ptr, x_stride, d_ptr, d_stride, w_ptr, out_ptr, out_stride, eps, H: tl.constexpr,
                    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < H
    x = tl.load(x_ptr + r * x_stride + c, mask=m, other=0.0)
    if HAS_DELTA:  # the residual add rounds to x's dtype before the norm reads it, as `x += delta` does
        x = (x.to(tl.float32) + tl.load(d_ptr + r * d_stride + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + r * x_stride + c, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * out_stride + c, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def add_rms(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then w * rms_norm(x) into a new tensor."""
    T, H = x.shape
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T:
        _add_rms_kernel[(T,)](x, x.stride(0), x if delta is None else delta, 0 if delta is None else delta.stride(0),
                              w, out, out.stride(0), eps, H=H, BLOCK=_pow2(H), HAS_DELTA=delta is not None,
                              num_warps=4 if H <= 2048 else 8)
    return out


@triton.jit
def _rope_kernel(x_ptr, x_stride, cos_ptr, sin_ptr, cs_stride, HEADS: tl.constexpr, HALF: tl.constexpr,
                 HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h < HEADS) & (i < HALF)
    p1 = x_ptr + r * x_stride + h * (2 * HALF) + i
    x1 = tl.load(p1, mask=m, other=0.0)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0)
    c = tl.load(cos_ptr + r * cs_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + r * cs_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # each product rounds before the sum, as the torch expression x1*c - x2*s does in x's dtype
    a1 = (x1f * c).to(dt).to(tl.float32)
    b1 = (x2f * s).to(dt).to(tl.float32)
    a2 = (x2f * c).to(dt).to(tl.float32)
    b2 = (x1f * s).to(dt).to(tl.float32)
    tl.store(p1, (a1 - b1).to(dt), mask=m)
    tl.store(p1 + HALF, (a2 + b2).to(dt), mask=m)


def rope(qk: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row; cos/sin [T, head_dim/2]."""
    T = qk.shape[0]
    if T:
        half = head_dim // 2
        _rope_kernel[(T,)](qk, qk.stride(0), cos, sin, cos.stride(0), HEADS=heads, HALF=half,
                           HEADS_PAD=_pow2(heads), HALF_PAD=_pow2(half))


@triton.jit
def _silu_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, INTER: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < INTER
    g = tl.load(gu_ptr + r * gu_stride + c, mask=m, other=0.0)
    u = tl.load(gu_ptr + r * gu_stride + INTER + c, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # F.silu rounds to the dtype, then the product
    tl.store(out_ptr + r * out_stride + c, (act * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up for gate|up rows [T, 2*inter] → [T, inter]."""
    T = gu.shape[0]
    out = torch.empty((T, inter), dtype=gu.dtype, device=gu.device)
    if T:
        block = min(_pow2(inter), 1024)
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gu, gu.stride(0), out, out.stride(0), INTER=inter,
                                                         BLOCK=block)
    return out


# vocabulary entries per program of the sampling race (a row is split over several programs, then reduced)
RACE_CHUNK = 8192


EXP_FLOOR = tl.constexpr(sampling.EXP_FLOOR)


@triton.jit
def _race_kernel(logits_ptr, l_stride, u_ptr, u_stride, temp_ptr, best_ptr, idx_ptr, V, n_chunks,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + r)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        i = c * CHUNK + off + tl.arange(0, BLOCK)
        m = i < V
        x = tl.load(logits_ptr + r * l_stride + i, mask=m, other=float("-inf"))
        u = tl.load(u_ptr + r * u_stride + i, mask=m, other=0.5)
        # E = -log1p(-u) ~ Exp(1), floored as the torch path floors it (sampling.EXP_FLOOR); the series keeps
        # small u exact where 1 - u would round to 1
        e = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
        e = tl.maximum(e, EXP_FLOOR)
        # argmax(softmax(x / t) / E) = argmax(x / t - log E): no softmax pass
        score = x / t - tl.log(e)
        take = score > best  # strictly: each lane keeps its first maximum, as argmax does
        best = tl.where(take, score, best)
        best_i = tl.where(take, i, best_i)
    v = tl.max(best, 0)
    first = tl.min(tl.where(best == v, best_i, 2147483647), 0)
    tl.store(best_ptr + r * n_chunks + c, v)
    tl.store(idx_ptr + r * n_chunks + c, first)


def race_argmax(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The sampled token of each row: argmax(softmax(logits / t) / E) with E = -log1p(-u) (the exponential race),
    in one read of the logits and the uniforms; logits/uniforms float32 [R, V], temperature float32 [R] → int64 [R].
    """
    R, V = logits.shape
    n_chunks = triton.cdiv(V, RACE_CHUNK)
    best = torch.empty((R, n_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((R, n_chunks), dtype=torch.int32, device=logits.device)
    _race_kernel[(R, n_chunks)](logits, logits.stride(0), uniforms, uniforms.stride(0), temperature, best, idx, V,
                                n_chunks, CHUNK=RACE_CHUNK, BLOCK=1024)
    # the first chunk holding the row's maximum, as argmax picks the first
    return idx.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
