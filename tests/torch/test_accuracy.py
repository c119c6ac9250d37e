"""benchmarks/accuracy.py: its windows, and its perplexity through the engine on the embedded model."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch_helpers import Driver, batch_of, make_backend

from llmserve.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llmserve_bench_accuracy", ROOT / "benchmarks" / "accuracy.py")
acc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = acc  # dataclasses look their module up
_spec.loader.exec_module(acc)


@pytest.mark.parametrize("n,ctx,stride", [(1, 8, 4), (2, 8, 4), (7, 8, 4), (8, 8, 4), (9, 8, 4), (100, 16, 5),
                                          (100, 16, 15), (100, 16, 1), (101, 64, 32), (2794, 512, 256)])
def test_stride_windows_score_every_token_once_with_the_promised_context(n, ctx, stride):
    wins = acc.stride_windows(n, ctx, stride)
    scored = [p for w in wins for p in range(w.score_from, w.end)]
    assert scored == list(range(1, n))  # every token but the first, once, in order
    for w in wins:
        assert 0 <= w.start < w.score_from <= w.end <= n and w.end - w.start <= ctx
        # past the first window, every scored token sees at least ctx - stride tokens before it
        assert w.score_from - w.start >= min(w.score_from, ctx - stride)
    assert (wins[-1].end == n) if n > 1 else wins == []


def test_llama_windows_are_llama_perplexitys_chunks():
    wins = acc.llama_windows(1300, 512)
    assert [(w.start, w.end, w.score_from) for w in wins] == [(0, 512, 257), (512, 1024, 769)]
    assert sum(w.end - w.score_from for w in wins) == 2 * (512 - 512 // 2 - 1)  # llama.cpp's count


def test_bad_strides_are_refused():
    for stride in (0, 16, 17):
        with pytest.raises(ValueError, match="stride"):
            acc.stride_windows(100, 16, stride)


def _independent_nlls(ids, windows):
    """Each window's logits straight from a fresh backend (one forward over the window, no engine, no
    chunking), log-softmaxed here in float64."""
    b = make_backend("embedded", block_size=16)
    nll = {}
    for i, w in enumerate(windows):
        win = ids[w.start:w.end]
        logits = b.compute_logits(batch_of([Driver(b).request(f"w{i}", win, 0, len(win))]))
        lp = torch.log_softmax(logits.double(), dim=-1)
        for pos in range(w.score_from, w.end):
            nll[pos] = -lp[pos - w.start - 1, ids[pos]].item()
    return nll


@pytest.fixture
def one_thread():
    """A 128-wide model gains nothing from a second thread, and on a loaded machine two threads'
    barriers cost 30x (12 s against 0.4 s here): one thread, given back afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_perplexity_through_the_engine_is_exp_of_the_mean_nll_of_every_token(one_thread):
    text = (ROOT / "tests" / "data" / "perplexity.txt").read_text(encoding="utf-8")[:200]
    # a per-step budget below the window length: windows are prefilled in chunks, several per step
    eng = Engine.from_config({"model": {"model": "embedded", "dtype": "float32"},
                              "backend": {"kv_cache_memory": "16MiB"},
                              "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}})
    try:
        ids = eng.tokenizer.encode(text)
        assert len(ids) == len(text.encode())  # byte-level
        wins = acc.stride_windows(len(ids), 48, 20)
        got = acc.perplexity(eng, ids, wins)
    finally:
        eng.shutdown()
    # scored_logprobs refuses a position twice: n - 1 scored positions are each of 1..n-1 once
    assert got["tokens_scored"] == len(ids) - 1 and got["windows"] == len(wins) > 5
    assert math.isfinite(got["ppl"]) and got["ppl"] > 1.0
    ref = _independent_nlls(ids, wins)
    assert sorted(ref) == list(range(1, len(ids)))
    assert got["mean_nll"] == pytest.approx(math.fsum(ref.values()) / len(ref), rel=1e-6)
    assert got["ppl"] == pytest.approx(math.exp(math.fsum(ref.values()) / len(ref)), rel=1e-5)


def test_agreement_counts_exact_outputs_and_common_prefixes():
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0], [7, 0, 9]]
    a = acc.agreement(ref, got)
    assert (a["exact"], a["of"], a["common_prefix"]) == (1, 3, [4, 2, 1])
    assert a["mean_common_prefix"] == pytest.approx(7 / 3)


def test_llama_perplexity_output_is_parsed():
    out = ("[1]10.1234,[2]12.5678,[3]13.0001,\nFinal estimate: PPL = 13.0001 +/- 0.41234\n\n"
           "llama_perf_context_print: load time = 10 ms\n")
    assert acc.parse_llama_perplexity(out) == (13.0001, 0.41234)
    with pytest.raises(ValueError):
        acc.parse_llama_perplexity("perplexity: you need at least 1024 tokens")
