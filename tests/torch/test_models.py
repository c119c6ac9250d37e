"""Our GPT-2 and Qwen2 on the paged cache give HF transformers' logits, prefill and decode, mixed in one batch."""

from __future__ import annotations

import pytest
import torch
from torch_helpers import Driver, batch_of, make_backend

MODELS = ["gpt2_dir", "qwen2_dir", "qwen2_tied_dir"]


def _cpu_kernel_builds() -> bool:
    from llmserve_torch import kernel_library

    try:
        kernel_library.load()
        return True
    except RuntimeError:
        return False


# the cpu kernel needs a C++ compiler on the machine; without one `auto` falls back to reference
KERNELS = ["reference", pytest.param("cpu", marks=pytest.mark.skipif(not _cpu_kernel_builds(),
                                                                      reason="no C++ compiler: cpu kernel not built"))]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fixture", MODELS)
def test_prefill_then_decode_logits_match_hf(fixture, kernel, request):
    """Three prompts prefilled in one flattened batch, then decoded together for 4 steps."""
    assert_prefill_then_decode_match_hf(*request.getfixturevalue(fixture), kernel, (5, 17, 33), 4)


def assert_prefill_then_decode_match_hf(path, hf, kernel: str, lengths, steps: int) -> None:
    """Prompts of these lengths prefilled in one flattened batch, then decoded together for `steps` steps: float32
    logits as HF's, each step."""
    b = make_backend(str(path), attention=kernel)
    assert b.attention.name == kernel
    d = Driver(b)
    g = torch.Generator().manual_seed(3)
    seqs = {f"r{i}": torch.randint(0, b.vocab_size, (n,), generator=g).tolist() for i, n in enumerate(lengths)}
    logits = b.compute_logits(batch_of([d.request(rid, s, 0, len(s)) for rid, s in seqs.items()]))
    off = 0
    for s in seqs.values():
        torch.testing.assert_close(logits[off:off + len(s)], hf_logits(hf, s), atol=2e-4, rtol=1e-4)
        off += len(s)
    for _ in range(steps):
        nxt = {rid: int(hf_logits(hf, s)[-1].argmax()) for rid, s in seqs.items()}
        for rid in seqs:
            seqs[rid] = seqs[rid] + [nxt[rid]]
        reqs = [d.request(rid, s, len(s) - 1, 1) for rid, s in seqs.items()]
        logits = b.compute_logits(batch_of(reqs))
        for i, s in enumerate(seqs.values()):
            torch.testing.assert_close(logits[i], hf_logits(hf, s)[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fixture", ["gpt2_dir", "qwen2_dir"])
def test_chunked_prefill_mixed_with_decode_matches_hf(fixture, kernel, request):
    """A long prompt prefilled in uneven chunks while another sequence decodes in the same batches."""
    path, hf = request.getfixturevalue(fixture)
    b = make_backend(str(path), attention=kernel)
    d = Driver(b, seed=1)
    g = torch.Generator().manual_seed(4)
    long = torch.randint(0, b.vocab_size, (45,), generator=g).tolist()
    short = torch.randint(0, b.vocab_size, (6,), generator=g).tolist()
    b.compute_logits(batch_of([d.request("s", short, 0, 6)]))
    done = 0
    for chunk in (7, 16, 22):
        short = short + [int(hf_logits(hf, short)[-1].argmax())]
        logits = b.compute_logits(batch_of([d.request("L", long, done, chunk), d.request("s", short, len(short) - 1, 1)]))
        torch.testing.assert_close(logits[:chunk], hf_logits(hf, long)[done:done + chunk], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(logits[chunk], hf_logits(hf, short)[-1], atol=2e-4, rtol=1e-4)
        done += chunk


@pytest.mark.skipif(not _cpu_kernel_builds(), reason="no C++ compiler: cpu kernel not built")
def test_kernels_agree_on_bfloat16(gpt2_dir):
    """The CPU kernel's bf16 path matches the reference path on the same bf16 weights."""
    path, _ = gpt2_dir
    outs = []
    for kernel in ("reference", "cpu"):
        b = make_backend(str(path), attention=kernel, dtype="bfloat16")
        d = Driver(b)
        ids = list(range(3, 40))
        outs.append(b.compute_logits(batch_of([d.request("a", ids, 0, 30)])))
        outs.append(b.compute_logits(batch_of([d.request("a", ids, 30, 7)])))
    torch.testing.assert_close(outs[0], outs[2], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[1], outs[3], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_lm_head_equals_one_matmul(dtype):
    """The vocabulary-chunked LM head (uneven last chunk) gives float32 logits equal to one F.linear."""
    from llmserve_torch.models.common import Linear, lm_head

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=g).to(dtype)
    w = torch.randn(103, 24, generator=g).to(dtype)
    got = lm_head(x, Linear(w, None, pack=False), chunk=16)
    assert got.dtype == torch.float32 and got.shape == (5, 103)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w).float(), atol=1e-5, rtol=1e-5)


def test_execute_returns_logprobs_and_prompt_logprobs_like_hf(gpt2_dir):
    """Through execute(): prompt logprobs per chunk token (next prompt token), then the sampled token's logprob."""
    from llmserve.request import SamplingParams

    path, hf = gpt2_dir
    b = make_backend(str(path))
    d = Driver(b)
    prompt = list(range(20, 33))  # 13 tokens, prefilled in chunks of 8 and 5
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    sp = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
    first = b.execute(batch_of([d.request("p", prompt, 0, 8, sampling=sp, do_sample=False)]))
    assert first.sampled_token_ids == [None] and first.logprobs is None
    second = b.execute(batch_of([d.request("p", prompt, 8, 5, sampling=sp)]))
    plp = first.prompt_logprobs[0] + second.prompt_logprobs[0]
    assert len(plp) == 13 and plp[-1] is None  # the last prompt position predicts no prompt token
    for pos in range(12):
        e = plp[pos]
        assert e.token_id == prompt[pos + 1]
        assert abs(e.logprob - ref[pos, prompt[pos + 1]].item()) < 1e-4
        assert e.rank == int((ref[pos] > ref[pos, prompt[pos + 1]]).sum()) + 1
        assert [t for t, _ in e.top] == ref[pos].topk(2).indices.tolist()
    tok = second.sampled_token_ids[0]
    assert tok == int(ref[-1].argmax())
    lp = second.logprobs[0]
    assert lp.token_id == tok and lp.rank == 1 and abs(lp.logprob - ref[-1, tok].item()) < 1e-4
    assert len(lp.top) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(dtype):
    """oneDNN's pre-packed GEMM (the default on CPU where it exists) computes what F.linear does."""
    from llmserve_torch.models.common import Linear, choose_packing, onednn_available

    cpu = torch.device("cpu")
    if not onednn_available(cpu, dtype):
        # this torch build or CPU lacks it (bf16 on an AVX2-only CPU): asking for it is an error naming the
        # dtype, and auto falls back to F.linear
        with pytest.raises(ValueError, match=str(dtype)):
            choose_packing("onednn", cpu, dtype)
        assert choose_packing("auto", cpu, dtype) is False
        return
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(70, 48, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    packed = Linear(w, b, pack=True)
    assert packed.packed is not None and packed.weight is None
    for rows in (1, 7, 64):
        x = torch.randn(rows, 48, generator=g).to(dtype)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(packed(x).float(), torch.nn.functional.linear(x, w, b).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fixture", ["gpt2_dir", "qwen2_dir"])
def test_plain_torch_linear_path_matches_hf(fixture, request):
    """backend.options.linear: torch (F.linear, chunked LM head) gives HF's logits too."""
    path, hf = request.getfixturevalue(fixture)
    b = make_backend(str(path), linear="torch")
    assert b.describe()["linear"] == "torch"
    ids = list(range(3, 30))
    got = b.compute_logits(batch_of([Driver(b).request("a", ids, 0, len(ids))]))
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
