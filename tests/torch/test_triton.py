"""The GPU path's Triton kernels against the torch reference, run by Triton's interpreter on a CPU (compiled on a GPU).

The attention kernel is checked on mixed steps (prompt chunks after a cached prefix, decodes), grouped-query heads,
shuffled blocks and a block size that does not divide its key step; the elementwise kernels round as torch does;
and the whole backend with both gives HF's greedy tokens, also through the padded decode batches that CUDA graphs
replay.
"""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from llmserve_torch import triton_kernels  # noqa: E402
from llmserve_torch.attention import ReferenceAttention, StepMetadata, TritonPagedAttention  # noqa: E402
from llmserve_torch.fused import TorchOps, TritonOps  # noqa: E402
from llmserve_torch.kv_cache import KVCache  # noqa: E402
from llmserve_torch.sampling import EXP_FLOOR  # noqa: E402
from torch_helpers import attention_arch, step_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


# Triton's interpreter (the CPU run of these tests) rounds float32 to bf16 towards zero, not to nearest as a GPU
# does, so there a bf16 result may sit one rounding step from torch's; compiled, the roundings agree exactly
INTERPRETED = triton_kernels.INTERPRETED


def _same_rounding(got, want, dtype):
    """Equal where Triton rounds to nearest; within one bf16 step under the interpreter."""
    if INTERPRETED and dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
    else:
        assert torch.equal(got, want)


def _close(got, want, dtype):
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


STEPS = {
    # a prompt chunk after a 20-token cached prefix, a decode, a whole short prompt, a one-token chunk
    "mixed": [(20, 37), (49, 1), (0, 5), (9, 1), (0, 70)],
    "decode": [(0, 1), (3, 1), (17, 1), (63, 1), (120, 1)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(6, 2, 16, 4), (4, 4, 24, 16), (7, 1, 32, 8)])
def test_paged_attention_matches_reference(dtype, step, heads, kv_heads, head_dim, block_size):
    arch = attention_arch(heads, kv_heads, head_dim)
    kv = KVCache(arch, 64, block_size, dtype, DEVICE)
    meta = step_metadata(STEPS[step], block_size, 64, seed=heads, device=DEVICE)
    g = torch.Generator().manual_seed(block_size)
    T = meta.num_tokens
    # every slot holds random K/V (the cached prefix), the step's own tokens are stored by the kernels
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    qkv = torch.randn(T, arch.q_size + 2 * arch.kv_size + 3, generator=g).to(dtype).to(DEVICE)  # padded rows
    q, k, v = qkv[:, :arch.q_size], qkv[:, arch.q_size:arch.q_size + arch.kv_size], qkv[:, arch.q_size + arch.kv_size:-3]
    want_k, want_v = kv.k.clone(), kv.v.clone()
    ref = ReferenceAttention(arch, kv)
    ref.begin_step(meta)
    want = ref.forward(0, q, k, v)
    want_k, kv.k = kv.k, want_k  # run the kernel on the cache as it was before the step
    want_v, kv.v = kv.v, want_v
    kv.k_flat, kv.v_flat = kv.k.view(kv.k_flat.shape), kv.v.view(kv.v_flat.shape)
    tri = TritonPagedAttention(arch, kv)
    tri.begin_step(meta)
    got = tri.forward(0, q, k, v)
    assert torch.equal(kv.k, want_k) and torch.equal(kv.v, want_v)  # the K/V store wrote exactly the step's slots
    assert got.isfinite().all()
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_kernels_round_as_torch(dtype):
    g = torch.Generator().manual_seed(3)
    ref, tri = TorchOps(), TritonOps()
    x = torch.randn(5, 96, generator=g).to(dtype).to(DEVICE)
    delta = torch.randn(5, 96, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    xr, xt = x.clone(), x.clone()
    want, got = ref.add_rms(xr, delta, w, 1e-6), tri.add_rms(xt, delta, w, 1e-6)
    _same_rounding(xt, xr, dtype)  # the residual add rounds as torch's
    _close(got, want, dtype)
    _close(tri.add_rms(x.clone(), None, w, 1e-6), ref.add_rms(x.clone(), None, w, 1e-6), dtype)

    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(6, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    ang = torch.rand(6, d // 2, generator=g).to(DEVICE) * 6
    cos, sin = ref.tables(ang.cos(), ang.sin(), dtype)
    a, b = qkv.clone(), qkv.clone()
    ref.rope(a, heads + kv_heads, d, cos, sin)
    tri.rope(b, heads + kv_heads, d, cos, sin)
    assert torch.equal(a[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])  # V untouched
    _close(b, a, dtype)

    gu = torch.randn(5, 2 * 40, generator=g).to(dtype).to(DEVICE)
    _close(tri.silu_mul(gu, 40), ref.silu_mul(gu, 40), dtype)


def _engine(path, options: dict, dtype: str = "float32"):
    from llmserve.config import config_from_dict
    from llmserve.engine import Engine

    return Engine.from_config(config_from_dict({
        "model": {"model": str(path), "device": DEVICE.type, "dtype": dtype},
        "backend": {"name": "torch", "kv_cache_memory": "8MiB", "options": options},
        "tokenizer": {"name": "none"},
        "cache": {"block_size": 4},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 48},
    }))


@pytest.mark.parametrize("model", ["qwen2_dir", "gpt2_dir"])
def test_backend_on_triton_kernels_matches_hf_greedy(request, model):
    """Prompt chunks run eagerly, decodes through the padded graph batches (6 requests → bucket 8): HF's tokens."""
    from test_engine_vs_hf import GREEDY, hf_greedy, prompts
    from torch_helpers import generate

    path, hf = request.getfixturevalue(model)
    engine = _engine(path, {"attention": "triton", "decoder_ops": "triton" if model == "qwen2_dir" else "auto",
                            "cuda_graphs": 8})
    backend = engine.backend
    assert backend.describe()["attention"] == "triton" and backend.graphs.buckets == [1, 2, 4, 8]
    graphs, replayed = backend.graphs, []
    run = graphs.run
    graphs.run = lambda ids, *rest: replayed.append(len(ids)) or run(ids, *rest)
    ps = prompts(hf.config.vocab_size, [3, 9, 17, 30, 5, 41])  # 41 > 48 - decodes: chunked
    got = generate(engine, ps, GREEDY)
    assert got == [hf_greedy(hf, p) for p in ps]
    assert 6 in replayed and set(replayed) - {1, 2, 4, 8}  # padded batches took the graph path


def test_sampling_race_kernel_picks_the_torch_paths_token():
    """argmax(softmax(x/t) / E) in one pass: the same token as the torch expression on the same uniform draws,
    with masked (-inf) entries, a zero draw and rows split over several programs."""
    g = torch.Generator().manual_seed(11)
    R, V = 6, 3 * triton_kernels.RACE_CHUNK + 77
    x = (torch.randn(R, V, generator=g) * 3).to(DEVICE)
    x[1, ::3] = float("-inf")  # a grammar mask
    u = torch.rand(R, V, generator=g).to(DEVICE)
    u[2, 5] = 0.0  # the floor: never NaN, never a masked token, no certain win for an unlikely token
    u[3, :100] = 1e-7  # where 1 - u rounds to 1: the series keeps E exact
    t = torch.tensor([0.6, 1.0, 0.3, 1.5, 0.8, 2.0], device=DEVICE)
    e = (-torch.log1p(-u)).clamp_min(EXP_FLOOR)
    want = ((x / t[:, None]).softmax(-1) / e).argmax(-1)
    got = triton_kernels.race_argmax(x, u, t)
    assert got.tolist() == want.tolist()


def test_a_zero_draw_does_not_make_an_unlikely_token_win():
    """torch.rand gives exactly 0 once in 2^24 draws (one row in ~110 at a 152k vocabulary): the floor of E must not
    hand that entry the token (with finfo.tiny it won whenever its probability was above ~1e-38)."""
    from llmserve_torch.sampling import _exp_noise

    x = torch.zeros(1, 64, device=DEVICE)
    x[0, 7] = 20.0  # p ~ 1
    u = torch.full((1, 64), 0.5, device=DEVICE)
    u[0, 5] = 0.0  # token 5: p ~ 2e-9
    t = torch.ones(1, device=DEVICE)
    assert triton_kernels.race_argmax(x, u, t).tolist() == [7]
    assert (x.softmax(-1) / _exp_noise(u)).argmax(-1).tolist() == [7]


def test_sampler_with_the_race_kernel_draws_the_same_tokens():
    """The backend's fast path changes no token: seeded and unseeded rows, through Sampler.sample."""
    from llmserve.batch import ScheduledRequest
    from llmserve.request import SamplingParams
    from llmserve_torch.sampling import Sampler

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=g).to(DEVICE) * 2
    sps = [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.2), SamplingParams(temperature=0.0),
           SamplingParams(temperature=0.5, seed=9)]
    reqs = [ScheduledRequest(f"r{i}", [1, 2, 3], 3, 1, [0], sp, True, 3, 0) for i, sp in enumerate(sps)]
    plain, fast = Sampler(DEVICE, seed=1), Sampler(DEVICE, seed=1)
    fast.fast_race = triton_kernels.race_argmax
    for _ in range(3):
        assert fast.sample(logits, reqs)[0] == plain.sample(logits, reqs)[0]
