"""Embeddings on the torch backend against transformers: decoders' final-norm states (last-token and mean pooling,
chunked prefill, beside a generation, through the fused CPU layers) and the BERT encoder family."""

from __future__ import annotations

import math

import pytest
import torch
from bert_helpers import hf_embedding, save_tiny_bert

from llmserve.engine import Engine
from llmserve.request import PoolingParams, SamplingParams


def _engine(model: str, tokens: int = 512, **model_kw) -> Engine:
    return Engine.from_config({"model": {"model": model, "dtype": "float32", **model_kw},
                               "backend": {"name": "torch", "kv_cache_memory": "16MiB"},
                               "cache": {"block_size": 4},
                               "scheduler": {"max_num_batched_tokens": tokens, "max_num_seqs": 8}})


def _run(engine: Engine, prompts: list[list[int]], pooling: PoolingParams, gen: list[int] | None = None):
    """Each prompt's embedding, run together (and with a greedy generation of 12 tokens from `gen`); the
    generation's tokens, and how many backend calls held both an embedding chunk and a sampled token."""
    # the generation first: it decodes while the embeddings' chunks are computed
    g = engine.add_request(gen, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) if gen else None
    ids = [engine.add_request(p, pooling=pooling) for p in prompts]
    vecs, toks, mixed = {}, [], []
    execute = engine.backend.execute

    def watched(batch):
        mixed.append(any(r.pooling for r in batch.requests) and any(r.do_sample for r in batch.requests))
        return execute(batch)

    engine.backend.execute = watched
    try:
        while engine.has_unfinished:
            for o in engine.step().outputs:
                if o.request_id == g:
                    toks += o.new_token_ids
                elif o.finished:
                    assert o.error is None, o.error
                    vecs[o.request_id] = o.embedding
    finally:
        engine.backend.execute = execute
    return [torch.tensor(vecs[i]) for i in ids], toks, sum(mixed)


def _hf_states(model, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states of a decoder (the states its LM head reads)."""
    with torch.no_grad():
        base = model.transformer if hasattr(model, "transformer") else model.model
        return base(torch.tensor([ids])).last_hidden_state[0]


def _hf_pooled(model, ids: list[int], kind: str) -> torch.Tensor:
    h = _hf_states(model, ids)
    return torch.nn.functional.normalize(h[-1] if kind == "last" else h.mean(0), dim=0)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_decoder_embeddings_equal_transformers_across_chunks_and_beside_a_generation(qwen2_dir, kind):
    path, hf = qwen2_dir
    engine = _engine(str(path), tokens=16)  # 16 tokens a step: the 41-token prompt takes three chunks
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(41)], [5, 9, 11], [17]]
    gen = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = engine.generate([gen], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    vecs, toks, mixed = _run(engine, prompts, PoolingParams(kind=kind), gen)
    assert mixed >= 2  # the generation decoded in the steps that computed the embeddings' chunks
    for p, v in zip(prompts, vecs):
        assert v.shape == (64,) and math.isclose(v.norm().item(), 1.0, rel_tol=1e-5)
        torch.testing.assert_close(v, _hf_pooled(hf, p, kind), atol=2e-5, rtol=1e-4)
    assert toks == alone  # the generation it was batched with is unchanged
    assert engine.scheduler_stats().cache.used_blocks == 0  # every embedding's blocks were freed


def test_gpt2_pools_its_last_token_by_default_and_cuts_matryoshka_dimensions(gpt2_dir):
    path, hf = gpt2_dir
    engine = _engine(str(path), matryoshka=True)
    assert engine.pooling == "last" and engine.generates
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    (v,), _, _ = _run(engine, [p], PoolingParams())
    torch.testing.assert_close(v, _hf_pooled(hf, p, "last"), atol=2e-5, rtol=1e-4)
    (short,), _, _ = _run(engine, [p], PoolingParams(dimensions=8))
    ref = torch.nn.functional.normalize(_hf_states(hf, p)[-1][:8], dim=0)
    torch.testing.assert_close(short, ref, atol=2e-5, rtol=1e-4)
    (raw,), _, _ = _run(engine, [p], PoolingParams(normalize=False))
    torch.testing.assert_close(raw, _hf_states(hf, p)[-1], atol=2e-5, rtol=1e-4)


def test_the_fused_cpu_layers_pool_what_the_python_path_pools(qwen2_dir):
    path, _ = qwen2_dir
    fused = _engine(str(path), quantization="int8")
    if fused.backend.stack is None:
        pytest.skip(f"no fused layers here: {fused.backend.stack_note}")
    plain = Engine.from_config({"model": {"model": str(path), "quantization": "int8", "dtype": "float32"},
                                "backend": {"name": "torch", "kv_cache_memory": "16MiB",
                                            "options": {"fuse_layers": "off"}},
                                "cache": {"block_size": 4}})
    prompts = [[4, 8, 15, 16, 23, 42], [1, 2]]
    for kind in ("last", "mean"):
        a, _, mixed = _run(fused, prompts, PoolingParams(kind=kind), gen=[9, 9, 9])
        b, _, _ = _run(plain, prompts, PoolingParams(kind=kind))
        assert mixed  # the fused call made the generation's token and the embeddings' states together
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory):
    """Tiny BERTs: one with a sentence-transformers mean-pooling config, one without (so [CLS])."""
    d = tmp_path_factory.mktemp("bert")
    return (d / "mean", save_tiny_bert(d / "mean", seed=1, pooling="mean")), (d / "plain", save_tiny_bert(d / "plain"))


def test_bert_embeddings_equal_transformers_with_the_pooling_its_config_names(bert_dirs):
    (mean_dir, mean_hf), (plain_dir, plain_hf) = bert_dirs
    for path, hf, kind in ((mean_dir, mean_hf, "mean"), (plain_dir, plain_hf, "cls")):
        engine = _engine(str(path))
        assert (engine.pooling, engine.generates, engine.embedding_size) == (kind, False, 32)
        tok = engine.tokenizer
        texts = ["the cat sat on the mat!", "hello world", "what is the capital of france?", "hello world"]
        prompts = [tok.encode(t) for t in texts]
        assert prompts[0][0] == 2 and prompts[0][-1] == 3  # [CLS] ... [SEP]
        vecs, _, _ = _run(engine, prompts, PoolingParams())
        for p, v in zip(prompts, vecs):
            torch.testing.assert_close(v, hf_embedding(hf, p, kind), atol=2e-5, rtol=1e-4)
        assert torch.equal(vecs[1], vecs[3])


def test_an_encoder_computes_each_prompt_whole_and_refuses_to_generate(bert_dirs):
    (path, hf), _ = bert_dirs
    engine = _engine(str(path), tokens=24)  # the step budget bounds an encoder's context
    assert engine.max_model_len == 24
    prompts = [list(range(5, 25)), list(range(30, 50)), [2, 7, 3]]  # 20 + 20 tokens: two steps, never chunks
    vecs, _, _ = _run(engine, prompts, PoolingParams())
    for p, v in zip(prompts, vecs):
        torch.testing.assert_close(v, hf_embedding(hf, p, "mean"), atol=2e-5, rtol=1e-4)
    with pytest.raises(Exception, match="encoder"):
        engine.add_request([2, 5, 3], SamplingParams(max_tokens=2))
    with pytest.raises(Exception, match="context length"):
        engine.add_request(list(range(5, 30)), pooling=PoolingParams())
