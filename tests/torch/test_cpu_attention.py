"""The CPU paged-attention kernel against the torch reference: mixed steps, grouped-query heads, contexts over one
chunk of keys, and the bf16 head_dim-64 path (vdpbf16ps scores, register-held values) where the CPU has
AVX512_BF16."""

from __future__ import annotations

import pytest
import torch

from llmserve_torch import kernel_library
from llmserve_torch.attention import CPUPagedAttention, ReferenceAttention
from llmserve_torch.kv_cache import KVCache
from torch_helpers import attention_arch, step_metadata

try:
    kernel_library.load()
except RuntimeError as e:  # no C++ compiler: `auto` falls back to the reference path, which these compare against
    pytest.skip(f"the CPU kernel does not build here: {e}", allow_module_level=True)

STEPS = {
    # a prompt chunk after a 20-token cached prefix, a decode, a whole short prompt, a one-token chunk
    "mixed": [(20, 37), (49, 1), (0, 5), (9, 1), (0, 70)],
    "decode": [(0, 1), (3, 1), (17, 1), (63, 1), (120, 1)],
    "one": [(194, 1)],  # a decode step of one sequence (c = 1): the threads share its blocks, merged after
    "one-short": [(2, 1)],  # one block for two threads: a share with no keys must count for nothing
    "one-long": [(590, 1)],  # shares past one chunk of keys each: rescaled within a share and across shares
    # contexts past one chunk of keys (256): the online softmax rescales between chunks
    "long": [(590, 1), (300, 20), (255, 2), (0, 1)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's heads: the bf16 head_dim-64 path, three query heads a KV head
    (14, 2, 64, 32),  # Qwen2.5-0.5B's: seven a KV head (the values path holds four at a time)
    (6, 2, 16, 4), (4, 4, 24, 16), (8, 2, 128, 8),
])
# threads: a one-token step is split into shares of its blocks, one a thread (two or three here, whatever the CPU)
@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_paged_attention_matches_reference(dtype, step, heads, kv_heads, head_dim, block_size, threads,
                                               monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the kernel is told, read at construction
    arch = attention_arch(heads, kv_heads, head_dim)
    num_blocks = 512 if step in ("long", "one", "one-long") else 64
    kv = KVCache(arch, num_blocks, block_size, dtype, torch.device("cpu"))
    meta = step_metadata(STEPS[step], block_size, num_blocks, seed=heads)
    g = torch.Generator().manual_seed(block_size)
    T = meta.num_tokens
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    qkv = torch.randn(T, arch.q_size + 2 * arch.kv_size, generator=g).to(dtype)
    q, k, v = qkv[:, :arch.q_size], qkv[:, arch.q_size:arch.q_size + arch.kv_size], qkv[:, arch.q_size + arch.kv_size:]
    before_k, before_v = kv.k.clone(), kv.v.clone()
    ref = ReferenceAttention(arch, kv)
    ref.begin_step(meta)
    want = ref.forward(0, q, k, v).clone()
    kv.k.copy_(before_k)
    kv.v.copy_(before_v)
    cpu = CPUPagedAttention(arch, kv)
    cpu.begin_step(meta)
    got = cpu.forward(0, q, k, v)
    assert got.isfinite().all()
    if dtype == torch.bfloat16:  # both round the output to bf16; the sums differ in order (and in q's scaling)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

