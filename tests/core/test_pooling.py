"""The engine's embedding sequences on the fake backend: chunks add up to the whole, the prefix-cache rules, blocks
freed at once, preemption, an encoder's whole prompts, and the refusals."""

from __future__ import annotations

import math

import pytest

from llmserve.engine import Engine
from llmserve.errors import InvalidRequestError
from llmserve.request import PoolingParams, SamplingParams


def engine(tokens: int = 512, blocks: int = 256, **backend) -> Engine:
    return Engine.from_config({"backend": {"name": "fake", "options": backend}, "model": {"model": "embedded"},
                               "cache": {"num_blocks": blocks, "block_size": 4},
                               "scheduler": {"max_num_batched_tokens": tokens, "max_num_seqs": 8}})


def run(e: Engine, adds) -> dict:
    """Add each (prompt, pooling or SamplingParams) and step to the end: request id → its finished output."""
    ids = [e.add_request(p, pooling=x) if isinstance(x, PoolingParams) else e.add_request(p, x) for p, x in adds]
    done = {}
    while e.has_unfinished:
        for o in e.step().outputs:
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


PROMPT = [(13 * i + 7) % 250 for i in range(45)]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_a_vector_is_the_same_whatever_the_chunks_and_unit_length(kind):
    whole = run(engine(), [(PROMPT, PoolingParams(kind=kind))])[0].embedding
    for budget in (8, 13):  # the 45-token prompt in 6 or 4 chunks, beside a generation
        (chunked, gen) = run(engine(budget), [(PROMPT, PoolingParams(kind=kind)),
                                              ([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))])
        assert chunked.embedding == pytest.approx(whole, rel=1e-9, abs=1e-12)
        assert gen.num_output_tokens == 6 and gen.embedding is None
    assert math.isclose(math.fsum(v * v for v in whole), 1.0)
    assert len(whole) == 64 and chunked.num_output_tokens == 0 and chunked.num_prompt_tokens == 45


def test_last_token_pooling_reads_the_prefix_cache_and_no_embedding_extends_it():
    e = engine()
    run(e, [(PROMPT, SamplingParams(max_tokens=2))])  # a generation caches the prompt's full blocks
    last, mean = run(e, [(PROMPT + [9], PoolingParams(kind="last")), (PROMPT + [9], PoolingParams(kind="mean"))])
    assert last.num_cached_tokens == 44 and mean.num_cached_tokens == 0
    assert last.embedding == run(engine(), [(PROMPT + [9], PoolingParams(kind="last"))])[0].embedding
    other = [(5 * i + 1) % 250 for i in range(40)]
    run(e, [(other, PoolingParams(kind="last"))])
    (gen,) = run(e, [(other + [3], SamplingParams(max_tokens=1))])
    assert gen.num_cached_tokens == 0  # the embedding left nothing in the cache
    assert e.scheduler_stats().cache.used_blocks == 0 and e.num_running == 0


def test_an_embedding_preempted_mid_prompt_starts_its_sum_afresh():
    # 16 blocks of 4: a 45-token embedding and two growing generations cannot all fit
    e = engine(tokens=8, blocks=16)
    outs = run(e, [([7, 7], SamplingParams(max_tokens=20, ignore_eos=True)),
                   ([8, 8], SamplingParams(max_tokens=20, ignore_eos=True)), (PROMPT, PoolingParams(kind="mean"))])
    assert e.scheduler_stats().num_preemptions > 0
    assert outs[2].embedding == pytest.approx(run(engine(), [(PROMPT, PoolingParams(kind="mean"))])[0].embedding,
                                              rel=1e-9, abs=1e-12)


def test_an_encoder_computes_whole_prompts_and_only_embeds():
    e = engine(tokens=24, generates=False, causal=False, pooling="cls")
    assert e.max_model_len == 24 and e.pooling == "cls" and not e.generates
    seen = []
    execute = e.backend.execute
    e.backend.execute = lambda batch: seen.append([(r.num_computed_tokens, r.num_new_tokens) for r in batch.requests]) \
        or execute(batch)
    a, b = run(e, [(list(range(1, 21)), PoolingParams()), (list(range(2, 22)), PoolingParams())])
    assert seen == [[(0, 20)], [(0, 20)]]  # never a chunk: the second waits for a step of its own
    assert a.embedding != b.embedding
    with pytest.raises(InvalidRequestError, match="encoder") as err:
        e.add_request([1, 2], SamplingParams())
    assert err.value.param == "model"
    with pytest.raises(InvalidRequestError, match="context length"):
        e.add_request(list(range(1, 26)), pooling=PoolingParams())


def test_pooling_refusals_name_their_field():
    e = engine()
    for p, param in ((PoolingParams(kind="max"), "pooling"), (PoolingParams(dimensions=8), "dimensions")):
        with pytest.raises(InvalidRequestError) as err:
            e.add_request([1, 2], pooling=p)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError, match="computes no embeddings"):
        engine(pooling=None).add_request([1, 2], pooling=PoolingParams())
