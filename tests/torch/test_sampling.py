"""Each sampling knob moves the distribution the way it should; seeds make draws batch-independent."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from llmserve_torch.sampling import Sampler, filter_logits, prompt_logprobs, step_seed

from llmserve.batch import ScheduledRequest
from llmserve.request import SamplingParams

V = 8
BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])


def req(sp: SamplingParams, prompt=(0,), output=(), rid="r") -> ScheduledRequest:
    toks = list(prompt) + list(output)
    return ScheduledRequest(rid, toks, len(toks) - 1, 1, [0], sp, True, len(prompt), len(output))


def make_sampler(kind: str = "torch", seed: int = 0, eos=()) -> Sampler:
    """A CPU sampler drawing with torch's uniforms ("torch") or with the kernel library's keyed race ("kernel")."""
    s = Sampler(torch.device("cpu"), seed=seed, eos_token_ids=eos)
    if kind == "kernel":
        from llmserve_torch.sampling import cpu_sample

        s.keyed_sample = cpu_sample()
        if s.keyed_sample is None:
            pytest.skip("no C++ compiler: the kernel library did not build")
    return s


@pytest.fixture(params=["torch", "kernel"])
def kind(request) -> str:
    return request.param


def draw(sp: SamplingParams, n: int = 3000, logits=BASE, kind: str = "torch", **kw) -> Counter:
    """n draws of the same request (unseeded: the sampler's generator advances)."""
    s = make_sampler(kind, eos=kw.pop("eos", ()))
    rows = logits.unsqueeze(0).repeat(n, 1)
    toks, _ = s.sample(rows, [req(sp, **kw)] * n)
    return Counter(toks)


def test_greedy_takes_the_argmax():
    assert draw(SamplingParams(temperature=0.0), n=5) == Counter({0: 5})


def test_temperature_one_matches_softmax(kind):
    c = draw(SamplingParams(temperature=1.0), n=20000, kind=kind)
    p = BASE.softmax(-1)
    for t in range(V):
        assert abs(c[t] / 20000 - p[t].item()) < 0.015


def test_low_temperature_sharpens_high_temperature_flattens(kind):
    cold, hot = draw(SamplingParams(temperature=0.3), kind=kind), draw(SamplingParams(temperature=3.0), kind=kind)
    assert cold[0] > 0.8 * 3000 and hot[0] < 0.3 * 3000 and len(hot) == V


def test_top_k_keeps_only_k_tokens(kind):
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), kind=kind)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p(kind):
    p = BASE.softmax(-1)  # 0.44, 0.27, 0.16, ... → top_p 0.6 keeps {0, 1}
    assert p[0] < 0.6 <= p[0] + p[1]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.6), kind=kind)) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.3), kind=kind)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best(kind):
    # p[t]/p[0] = exp(BASE[t]-2): 1, .61, .37, .22, .14 → min_p 0.3 keeps {0,1,2}
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.3), kind=kind)) == {0, 1, 2}


def test_filter_logits_batched_rows_are_independent():
    x = BASE.unsqueeze(0).repeat(3, 1)
    out = filter_logits(x.clone(), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.6]), torch.tensor([0.0, 0, 0]))
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 3 and torch.isfinite(out[2]).sum() == 2


def test_repetition_penalty_discourages_seen_tokens():
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert draw(sp, n=1, prompt=(0,)) == Counter({1: 1})  # 2.0/2 = 1.0 < 1.5
    # a negative logit gets multiplied (more negative), never rewarded
    neg = torch.tensor([-1.0, -1.2, -3.0, -3, -3, -3, -3, -3])
    assert draw(sp, n=1, logits=neg, prompt=(1,)) == Counter({0: 1})
    assert draw(sp, n=1, logits=neg, prompt=(0,)) == Counter({1: 1})


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.tensor([2.0, 1.8, 1.0, 0, 0, 0, 0, 0])
    # token 0 appears in the prompt only: no presence/frequency penalty
    assert draw(SamplingParams(temperature=0.0, presence_penalty=1.0), n=1, logits=logits, prompt=(0,)) == Counter({0: 1})
    assert draw(SamplingParams(temperature=0.0, presence_penalty=0.5), n=1, logits=logits, output=(0,)) == Counter({1: 1})
    # frequency scales with the count: one occurrence × 0.1 keeps 0 ahead, three × 0.1 do not
    assert draw(SamplingParams(temperature=0.0, frequency_penalty=0.1), n=1, logits=logits, output=(0,)) == Counter({0: 1})
    assert draw(SamplingParams(temperature=0.0, frequency_penalty=0.1), n=1, logits=logits,
                output=(0, 0, 0)) == Counter({1: 1})


def test_logit_bias_and_min_tokens():
    assert draw(SamplingParams(temperature=0.0, logit_bias={5: 10.0}), n=1) == Counter({5: 1})
    assert draw(SamplingParams(temperature=0.0, logit_bias={0: -100.0}), n=1) == Counter({1: 1})
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert draw(sp, n=1, eos={0, 2}) == Counter({3: 1})  # every EOS id (0, 2) and the stop id (1) are masked
    assert draw(sp, n=1, eos={0, 2}, output=(3, 4)) == Counter({0: 1})  # min_tokens reached


def test_seed_is_a_function_of_seed_and_output_index_only(kind):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=1.0, seed=42)
    target = req(sp, output=(1, 2, 3))
    a, _ = make_sampler(kind, seed=0).sample(logits[:1], [target])
    # other rows (seeded differently or unseeded), another sampler seed, another position in the batch
    mix = [req(SamplingParams(temperature=1.0)), req(SamplingParams(temperature=0.7, seed=1)), target,
           req(SamplingParams(temperature=0.0))]
    rows = torch.cat([logits[1:3], logits[:1], logits[3:4]])
    b, _ = make_sampler(kind, seed=99).sample(rows, mix)
    assert b[2] == a[0]
    # a different output index gives a different stream, so a sequence of draws is not constant
    draws = {make_sampler(kind).sample(logits[:1], [req(sp, output=(0,) * k)])[0][0] for k in range(20)}
    assert len(draws) > 1
    assert step_seed(42, 3) != step_seed(42, 4) != step_seed(43, 3)


def test_logprobs_with_top_alternatives():
    sp = SamplingParams(temperature=0.0, logprobs=3)
    toks, lps = Sampler(torch.device("cpu")).sample(BASE.unsqueeze(0), [req(sp)])
    lp = lps[0]
    ref = BASE.log_softmax(-1)
    assert lp.token_id == toks[0] == 0 and lp.rank == 1
    assert math.isclose(lp.logprob, ref[0].item(), abs_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert all(math.isclose(v, ref[t].item(), abs_tol=1e-6) for t, v in lp.top)
    # rank of a sampled token that is not the best; logprobs=0 gives no alternatives
    sp = SamplingParams(temperature=0.0, logprobs=0, logit_bias={4: 100.0})
    _, lps = Sampler(torch.device("cpu")).sample(BASE.unsqueeze(0), [req(sp)])
    assert lps[0].token_id == 4 and lps[0].rank == 5 and lps[0].top == []
    # requests that did not ask get None
    _, lps = Sampler(torch.device("cpu")).sample(BASE.unsqueeze(0).repeat(2, 1),
                                                 [req(SamplingParams(temperature=0.0)), req(sp)])
    assert lps[0] is None and lps[1] is not None


def test_prompt_logprobs_layout():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    out = prompt_logprobs(logits, [4, 2, None], 2)
    ref = logits.log_softmax(-1)
    assert out[2] is None
    assert out[0].token_id == 4 and math.isclose(out[0].logprob, ref[0, 4].item(), abs_tol=1e-6)
    assert len(out[1].top) == 2


@pytest.mark.parametrize("knob", [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}])
def test_filters_never_leave_an_empty_distribution(knob, kind):
    flat = torch.zeros(V)
    c = draw(SamplingParams(temperature=1.0, **knob), n=200, logits=flat, kind=kind)
    assert sum(c.values()) == 200


def test_kernel_argmax_matches_torch_including_ties():
    from llmserve_torch.sampling import cpu_argmax

    argmax = cpu_argmax()
    if argmax is None:
        pytest.skip("no C++ compiler: the kernel library did not build")
    x = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0))
    x[3, 10] = x[3, 900] = 50.0  # a tie: the first index wins, as in torch
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(x)[3] == 10
    # a strided view of rows (every other row) works too
    assert torch.equal(argmax(x[::2]), x[::2].argmax(dim=-1))


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0.8, seed=3)])
def test_a_zero_uniform_draw_never_picks_a_masked_token(monkeypatch, sp):
    """u == 0 gave a masked token 0 / 0 = NaN noise-scaled probability, which argmax picked (rare, but real)."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros_like(real_rand(*a, **k)))
    s = Sampler(torch.device("cpu"), seed=0)
    mask = torch.tensor([[0b0100]], dtype=torch.int32)  # only token 2 (top-k alone would keep 0 and 1)
    toks, _ = s.sample(BASE.unsqueeze(0).clone(), [req(sp)], bitmask=mask, bitmask_rows=[0])
    assert toks == [2]
    toks, _ = s.sample(BASE.unsqueeze(0).clone(), [req(sp)])
    assert toks[0] in (0, 1) if sp.top_k == 2 else True


def _kernel_filter(x, temps, top_k, top_p, min_p):
    """csrc/race.cpp's filter_row over each row: x / t with what it drops at -1e30."""
    from llmserve_torch import kernel_library

    make_sampler("kernel")  # (skips where the library does not build)
    R, n = x.shape
    y = torch.empty(R, n)
    args = [torch.tensor(temps).float(), torch.tensor(top_k, dtype=torch.int32), torch.tensor(top_p).float(),
            torch.tensor(min_p).float()]  # (held while the call reads them)
    kernel_library.load().llmserve_filter_f32(x.data_ptr(), R, n, x.stride(0), *(a.data_ptr() for a in args), y.data_ptr())
    return y


def test_the_kernel_filter_keeps_what_the_sort_keeps():
    """Rows of every kind in one batch (top-k, top-p, both, min-p, none; a nearly flat row whose top-p set is
    most of the vocabulary; masked entries; a top-k past the unmasked entries): the kernel keeps what
    filter_logits' sort keeps, at each row's temperature."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3000, generator=g) * 3
    x[4] = torch.randn(3000, generator=g) * 0.01
    x[7, 100:] = float("-inf")
    top_k = [0, 5, 100, 0, 0, 40, 0, 0, 70, 200]
    top_p = [0.9, 1.0, 1.0, 0.5, 0.9, 0.8, 1.0, 0.99, 0.95, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0]
    temps = [1.0, 0.7, 1.3, 1.0, 1.0, 0.5, 1.0, 2.0, 0.9, 1.0]
    x[9, 150:] = float("-inf")  # top_k 200 of 150 entries: all of them
    x[0] = torch.randn(3000, generator=g) * 0.01
    x[0, 17] = 9.0  # p = 0.73 at t = 1: top_p 0.9 needs entries 9 below it (past the first span of candidates)
    t = torch.tensor(temps).unsqueeze(1)
    ref = filter_logits(x / t, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    got = _kernel_filter(x, temps, top_k, top_p, min_p)
    kept = got > -1e30
    assert torch.equal(kept, torch.isfinite(ref))
    assert torch.allclose(got[kept], ref[kept], rtol=1e-6)
    n = kept.sum(dim=1).tolist()
    assert n[1] == 5 and n[2] == 100 and n[9] == 150 and 1000 < n[4] < 3000 and n[7] <= 100 and n[6] < 3000
    assert 1 < n[0] < 3000  # the token at 9 and some of the rest


def test_the_kernel_filter_matches_the_sort_on_many_random_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 1000, generator=g) * torch.rand(200, 1, generator=g) * 6
    top_k = torch.randint(0, 120, (200,), generator=g).tolist()
    top_p = (torch.rand(200, generator=g) * 0.9 + 0.1).tolist()
    min_p = [0.0] * 150 + (torch.rand(50, generator=g) * 0.3).tolist()
    temps = (torch.rand(200, generator=g) + 0.5).tolist()
    ref = filter_logits(x / torch.tensor(temps).unsqueeze(1), torch.tensor(top_k), torch.tensor(top_p),
                        torch.tensor(min_p))
    assert torch.equal(_kernel_filter(x, temps, top_k, top_p, min_p) > -1e30, torch.isfinite(ref))


@pytest.mark.parametrize("vocab", [50, 64, 1000, 49152])
def test_the_kernel_race_finds_the_same_token_on_one_thread_or_two(vocab):
    """A row's chunks shared out between two threads (one row), or one thread a row (several): the same tokens."""
    race = make_sampler("kernel").keyed_sample
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=g) * 2
    x[1, ::3] = float("-inf")  # masked entries
    temps = torch.tensor([1.0, 0.7, 1.3])
    keys = torch.randint(-(2**63), 2**63 - 1, (3,), generator=g)
    together = race(x, temps, keys)
    before = torch.get_num_threads()
    try:
        alone = [race(x[r:r + 1], temps[r:r + 1], keys[r:r + 1]).item() for r in range(3)]
        torch.set_num_threads(1)
        one = race(x, temps, keys)
    finally:
        torch.set_num_threads(before)
    assert together.tolist() == alone == one.tolist()
    assert together[1] % 3 != 0  # never a masked entry


def test_the_kernel_race_samples_softmax_over_a_vocabulary_of_several_chunks():
    """200 logits (three whole 64-entry chunks and a shorter one): each token's share of 40000 draws is its
    softmax probability; new keys each draw."""
    race = make_sampler("kernel").keyed_sample
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(200, generator=g) * 1.5
    n = 40000
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    toks = race(logits.unsqueeze(0).repeat(n, 1), torch.full((n,), 0.8), keys)
    freq = torch.bincount(toks, minlength=200).float() / n
    p = (logits / 0.8).softmax(-1)
    assert (freq - p).abs().max() < 0.01
    # a chi-square over the tokens with an expected count of 50 or more (~1 in 10^4 to fail by chance)
    big = p * n >= 50
    chi2 = (((freq - p) * n) ** 2 / (p * n))[big].sum().item()
    assert chi2 < int(big.sum()) + 4.5 * math.sqrt(2 * int(big.sum()))


def test_the_kernel_race_noise_is_finite_at_every_draw():
    """Token 0's logit 1000 above the rest: no draw of noise may lift another past it. The largest draw once
    rounded to u = 1.0, whose noise is +inf: one entry in 2^24, so ~12 of these 4000 rows of 49152 entries."""
    race = make_sampler("kernel").keyed_sample
    n, vocab = 4000, 49152
    x = torch.full((1, vocab), -1000.0)
    x[0, 0] = 0.0
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(3))
    toks = race(x.expand(n, vocab), torch.ones(n), keys)
    assert toks.tolist() == [0] * n


def test_race_filters_hand_the_kernel_what_it_can_read():
    """The fused call's filter values: none for greedy rows and for a top_k of the vocabulary or more (a top_k near
    2^31 is no int as a float32), None where no drawn row filters."""
    rows = [req(SamplingParams(temperature=0.0, top_k=5)), req(SamplingParams(temperature=0.8, top_k=2**31 - 1,
                                                                                top_p=0.9)),
            req(SamplingParams(temperature=1.0, top_k=7, min_p=0.2)), req(SamplingParams(temperature=0.5))]
    f = Sampler.race_filters(rows, 100)
    assert f.dtype.name == "float32" and f.tolist() == [[0, 0, 7, 0], [1.0, pytest.approx(0.9), 1.0, 1.0],
                                                        [0.0, 0.0, pytest.approx(0.2), 0.0]]
    assert Sampler.race_filters([rows[0], rows[3], req(SamplingParams(temperature=0.7, top_k=100))], 100) is None
