"""Greedy outputs through the Engine are token-identical to HF generate, whatever the scheduling does.

Chunked prefill, preemption under a tiny cache, prefix-cache hits and n>1 forks change which
tokens are computed together and where their K/V live; none of them may change a token.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.request import SamplingParams

NEW = 10


def hf_greedy(hf, prompt: list[int], n: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_for(path, **sections) -> Engine:
    cfg = {
        "model": {"model": str(path), "dtype": "float32"},  # compared with transformers' float32
        "backend": {"name": "torch", "kv_cache_memory": "8MiB"},
        "tokenizer": {"name": "none"},
        "cache": {"block_size": 4, **sections.pop("cache", {})},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, **sections.pop("scheduler", {})},
    }
    return Engine.from_config(config_from_dict(cfg))


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, ps, sp) -> tuple[dict, int]:
    """Run every prompt; return outputs per (request, index) and the number of preemptions seen."""
    ids = [engine.add_request(p, sp) for p in ps]
    got: dict = {}
    preempted = 0
    while engine.has_unfinished:
        st = engine.step()
        if st.metrics is not None:
            preempted += st.metrics.num_preempted
        for o in st.outputs:
            assert o.error is None, o.error
            got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return {k: v for k, v in got.items()}, preempted, ids


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(params=["gpt2_dir", "qwen2_dir"])
def model(request):
    return request.getfixturevalue(request.param)


def test_mixed_lengths_with_chunked_prefill(model):
    path, hf = model
    eng = engine_for(path, scheduler={"max_num_batched_tokens": 12, "max_num_seqs": 6})
    ps = prompts(hf.config.vocab_size, [3, 9, 17, 30, 41, 5])
    got, _, ids = run(eng, ps, GREEDY)
    for rid, p in zip(ids, ps):
        assert got[(rid, 0)] == hf_greedy(hf, p)


def test_tiny_cache_forces_preemption_without_changing_tokens(model):
    path, hf = model
    eng = engine_for(path, cache={"num_blocks": 16}, scheduler={"max_num_batched_tokens": 32, "max_num_seqs": 6})
    ps = prompts(hf.config.vocab_size, [20, 22, 18, 25, 21], seed=1)
    got, preempted, ids = run(eng, ps, GREEDY)
    assert preempted > 0, "the cache was meant to be too small to hold every sequence at once"
    for rid, p in zip(ids, ps):
        assert got[(rid, 0)] == hf_greedy(hf, p)


def test_prefix_cache_hits_give_the_same_tokens(model):
    path, hf = model
    eng = engine_for(path)
    shared = prompts(hf.config.vocab_size, [16], seed=2)[0]
    tails = prompts(hf.config.vocab_size, [3, 7, 1, 10], seed=3)
    first, _, (rid0,) = run(eng, [shared + tails[0]], GREEDY)
    assert first[(rid0, 0)] == hf_greedy(hf, shared + tails[0])
    ps = [shared + t for t in tails[1:]]
    got, _, ids = run(eng, ps, GREEDY)
    assert eng.stats()["cache"]["prefix_hits"] >= 3 * 16 - 4  # each later prompt reused the shared blocks
    for rid, p in zip(ids, ps):
        assert got[(rid, 0)] == hf_greedy(hf, p)


def test_n_greater_than_one_forks_share_the_prompt(model):
    path, hf = model
    eng = engine_for(path)
    ps = prompts(hf.config.vocab_size, [13, 6], seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=3)
    got, _, ids = run(eng, ps, sp)
    for rid, p in zip(ids, ps):
        want = hf_greedy(hf, p)
        assert [got[(rid, i)] for i in range(3)] == [want] * 3


def test_seeded_sampling_is_independent_of_the_batch(gpt2_dir):
    """The same seed gives the same tokens alone, in a crowd, and as one of n samples drawn apart."""
    path, hf = gpt2_dir
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=NEW, ignore_eos=True, seed=1234)
    target = prompts(hf.config.vocab_size, [11], seed=5)[0]
    alone, _, (rid,) = run(engine_for(path), [target], sp)
    others = prompts(hf.config.vocab_size, [4, 19, 27], seed=6)
    eng = engine_for(path, scheduler={"max_num_batched_tokens": 8})
    ids = [eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)) for p in others]
    crowd, _, (rid2,) = run(eng, [target], sp)
    assert crowd[(rid2, 0)] == alone[(rid, 0)]
    assert len(alone[(rid, 0)]) == NEW and ids


def test_embedded_default_generates_without_a_download():
    """The default config (embedded model) runs end to end and stops at max_tokens."""
    eng = Engine.from_config(config_from_dict({"model": {"model": "embedded"}, "backend": {"kv_cache_memory": "32MiB"},
                                               "tokenizer": {"name": "none"}}))
    assert eng.backend.vocab_size == 257 and eng.backend.eos_token_id == 256 and eng.max_model_len == 1024
    out = eng.generate([list(b"hello"), list(b"a much longer prompt for the tiny model")],
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [len(o) for o in out] == [5, 5]
    assert all(0 <= t < 257 for o in out for t in o)
