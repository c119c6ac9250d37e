"""The CUDA path on a GPU: greedy tokens equal HF transformers' on the same GPU (float32) for tiny GPT-2, Qwen2 and
Llama checkpoints; graph replay gives the eager path's tokens in bfloat16; the KV budget leaves room for the
profiled forward. Skipped, with the reason, where no CUDA device is present (CI): the kernels' logic is checked on
CPU by test_triton.py through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU CI has none)")

from test_engine_vs_hf import GREEDY, prompts  # noqa: E402
from torch_helpers import generate, make_llama  # noqa: E402

from llmserve.config import config_from_dict  # noqa: E402
from llmserve.engine import Engine  # noqa: E402
from llmserve.request import SamplingParams  # noqa: E402

NEW = GREEDY.max_tokens


def cuda_engine(path, dtype: str = "float32", options: dict | None = None, **sched) -> Engine:
    return Engine.from_config(config_from_dict({
        "model": {"model": str(path), "device": "cuda", "dtype": dtype},
        "backend": {"name": "torch", "kv_cache_memory": 0.05, "options": options or {}},
        "tokenizer": {"name": "none"},
        "cache": {"block_size": 16},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 128, **sched},
    }))


def hf_greedy_cuda(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long, device="cuda"), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    model = make_llama({"rope_type": "default", "rope_theta": 10000.0})
    model.save_pretrained(d)
    return d, model


@pytest.mark.parametrize("model", ["gpt2_dir", "qwen2_dir", "llama_dir"])
def test_greedy_equals_hf_on_the_gpu(request, model):
    path, hf = request.getfixturevalue(model)
    engine = cuda_engine(path)
    d = engine.backend.describe()
    assert d["attention"] == "triton" and d["cuda_graphs"][-1] == 16, d
    hf = hf.to("cuda")
    ps = prompts(hf.config.vocab_size, [3, 9, 17, 30, 5, 41, 200, 64])  # 200 > 128: chunked over steps
    try:
        assert generate(engine, ps, GREEDY) == [hf_greedy_cuda(hf, p) for p in ps]
    finally:
        hf.to("cpu")


def test_graph_replay_gives_the_eager_tokens(qwen2_dir):
    path, hf = qwen2_dir
    ps = prompts(hf.config.vocab_size, [5, 12, 33, 70, 2, 19, 40, 8, 9, 10, 11])  # 11 requests: bucket 16
    graphed = generate(cuda_engine(path), ps, GREEDY)
    eager = generate(cuda_engine(path, options={"cuda_graphs": "off"}), ps, GREEDY)
    assert graphed == eager


def test_bf16_serves_with_graphs_and_seeded_sampling(qwen2_dir):
    path, hf = qwen2_dir
    engine = cuda_engine(path, "bfloat16")
    assert engine.backend.describe()["dtype"] == "bfloat16"
    ps = prompts(hf.config.vocab_size, [5, 12, 33, 70, 2])
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    first, again = generate(engine, ps, sp), generate(engine, ps, sp)
    assert first == again and all(len(t) == 24 and max(t) < hf.config.vocab_size for t in first)


def test_unset_dtype_is_bf16_on_the_gpu(qwen2_dir):
    path, _ = qwen2_dir
    engine = Engine.from_config(config_from_dict({
        "model": {"model": str(path), "device": "cuda"}, "tokenizer": {"name": "none"},
        "backend": {"name": "torch", "kv_cache_memory": "64MiB"}}))
    d = engine.backend.describe()
    assert d["dtype"] == "bfloat16" and d["dtype_reason"].startswith("auto: the GPU computes bf16"), d


def test_kv_budget_is_a_fraction_of_memory_left_after_the_profiled_forward(qwen2_dir):
    path, _ = qwen2_dir
    engine = cuda_engine(path)
    kv = engine.backend.kv
    free, _total = torch.cuda.mem_get_info()
    # 5% of what was free when the cache was sized (less the profiled activations): well under what is free now
    assert 0 < kv.nbytes < 0.06 * (free + kv.nbytes)
