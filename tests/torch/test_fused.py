"""The fused C decoder ops agree with the torch reference (HF's roundings) in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch_helpers import Driver, batch_of, make_backend

from llmserve_torch.fused import CpuOps, TorchOps, decoder_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def cpu_ops():
    ops = decoder_ops(torch.device("cpu"), torch.float32)
    assert isinstance(ops, CpuOps), "the kernel library builds wherever the test suite runs (g++ is required)"
    return ops


def _close(got, want, dtype):
    # bf16: at most one rounding step apart (the float sums run in another order); float32: summation order only
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])  # 33: the OpenMP-parallel path
def test_add_rms_matches_torch(cpu_ops, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    delta = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    ref_x, got_x = x.clone(), x.clone()
    want = TorchOps().add_rms(ref_x, delta, w, 1e-5)
    got = cpu_ops.add_rms(got_x, delta, w, 1e-5)
    assert torch.equal(got_x, ref_x)  # the residual add rounds exactly as torch's
    _close(got, want, dtype)
    _close(cpu_ops.add_rms(x.clone(), None, w, 1e-5), TorchOps().add_rms(x.clone(), None, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
def test_rope_matches_torch_in_place_and_leaves_v_alone(cpu_ops, dtype, rows):
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    ang = torch.rand(rows, d // 2, generator=g) * 6
    ref, got = qkv.clone(), qkv.clone()
    TorchOps().rope(ref, heads + kv_heads, d, *TorchOps().tables(ang.cos(), ang.sin(), dtype))
    cpu_ops.rope(got, heads + kv_heads, d, *cpu_ops.tables(ang.cos(), ang.sin(), dtype))
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)  # same products, same roundings: bit for bit
    else:
        _close(got, ref, dtype)  # float32: fused multiply-adds may round once instead of twice
    assert torch.equal(got[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])
    assert not torch.equal(got[:, :d], qkv[:, :d])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(cpu_ops, dtype):
    gu = torch.randn(9, 2 * 40, generator=torch.Generator().manual_seed(3)).to(dtype) * 3
    _close(cpu_ops.silu_mul(gu, 40), TorchOps().silu_mul(gu, 40), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_gives_the_same_logits_with_either_ops(qwen2_dir, dtype):
    ids = [5, 17, 99, 140, 33, 60, 7, 150]
    out = {}
    for kind in ("torch", "cpu"):
        b = make_backend(str(qwen2_dir[0]), dtype=dtype, options={"decoder_ops": kind})
        assert b.describe()["decoder_ops"] == kind
        out[kind] = b.compute_logits(batch_of([Driver(b).request("x", ids, 0, len(ids))]))
    tol = 1e-4 if dtype == "float32" else 0.05
    torch.testing.assert_close(out["cpu"], out["torch"], atol=tol * out["torch"].abs().max().item(), rtol=0)
