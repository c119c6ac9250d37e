"""Every layer in one C call (fused_stack.py) gives exactly the Python path's hidden states: same kernels, same
order, same roundings; on Qwen2 (q/k/v bias) and Llama checkpoints quantized to int4 and int8, float32 and bf16,
over prompt chunks and decodes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch_helpers import Driver, batch_of, make_backend, make_llama

from llmserve.errors import ConfigError
from llmserve.request import SamplingParams
from llmserve_torch import kernel_library
from llmserve_torch.fused_stack import STAGES
from llmserve_torch.quant_embedding import QuantEmbedding


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_fused")
    make_llama({"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(d)
    return d


def _backend(path, dtype, quantization, fuse):
    # int16 activations in every row, as the Python path's linears take them (AVX2's auto: int8 in every decode)
    return make_backend(str(path), dtype=dtype, quantization=quantization,
                        options={"fuse_layers": fuse, "quant_rows": 4, "int8_decode_rows": 0})


def _steps(backend, seed):
    """Prompt chunks of 3 rows (fused) and 5 (above the quantized kernels' 4: the Python path), a mixed step,
    decodes of two sequences, then of one alone (its keys shared out between the threads): float32 logits of every
    row of every step."""
    d = Driver(backend, seed=seed)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 200, (10,), generator=g).tolist(), torch.randint(0, 200, (6,), generator=g).tolist()
    plan = [[d.request("a", a, 0, 3, do_sample=False)], [d.request("a", a, 3, 5, do_sample=False)],
            [d.request("a", a, 8, 2), d.request("b", b, 0, 1, do_sample=False)]]
    plan += [[d.request("a", a + [5] * (k + 1), 10 + k, 1), d.request("b", b, 1 + k, 1, do_sample=False)]
             for k in range(3)]
    plan += [[d.request("a", a + [5] * 4, 13, 1)]]
    return [backend.compute_logits(batch_of(reqs)) for reqs in plan]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("model", ["qwen2_dir", "llama_dir"])
def test_fused_layers_equal_the_python_path(request, model, quantization, dtype):
    path = request.getfixturevalue(model)
    path = path[0] if isinstance(path, tuple) else path
    fused, plain = _backend(path, dtype, quantization, "auto"), _backend(path, dtype, quantization, "off")
    assert fused.stack is not None and fused.describe()["fused_layers"] == "up to 4 rows"
    assert plain.stack is None and plain.describe()["fused_layers"] == "off"
    used = []
    forward = fused.stack.forward
    fused.stack.forward = lambda ids, *rest, **kw: used.append(ids.shape[0]) or forward(ids, *rest, **kw)
    for got, want in zip(_steps(fused, 1), _steps(plain, 1)):
        assert torch.equal(got, want)
    assert used == [3, 3, 2, 2, 2, 1]  # every step but the 5-row chunk ran fused


def _head_steps(backend, seed, sampling=None):
    """A prompt chunk in the call (no row samples), one above its rows (Python), one of four rows whose last
    samples, decodes of two sequences, then of one: per step _forward's (hidden, logits, tokens) as execute asks
    for them (tokens where the sampler's race_temperatures holds for its rows)."""
    d = Driver(backend, seed=seed)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 200, (10,), generator=g).tolist(), torch.randint(0, 200, (4,), generator=g).tolist()
    plan = [[d.request("a", a, 0, 3, do_sample=False)], [d.request("a", a, 3, 7, sampling)],
            [d.request("b", b, 0, 4, sampling)]]
    plan += [[d.request("a", a + [5] * (k + 1), 10 + k, 1, sampling), d.request("b", b + [7] * (k + 1), 4 + k, 1,
                                                                                  sampling)] for k in range(3)]
    plan += [[d.request("a", a + [5] * 4, 13, 1, sampling)]]
    out = []
    for reqs in plan:
        sample_reqs = [r for r in reqs if r.do_sample]
        temps = backend.sampler.race_temperatures(sample_reqs, None)
        step = backend._forward(batch_of(reqs), temps)
        hidden, logits, tokens = step.hidden, step.logits, step.tokens
        out.append((hidden.clone(), None if logits is None else logits.clone(), tokens, sample_reqs))  # its buffers
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("model", ["qwen2_dir", "llama_dir"])
def test_the_fused_call_makes_the_python_paths_logits_and_greedy_tokens(request, model, quantization, dtype):
    """Where every row of a step samples, the final norm and the int8 LM head (int4 keeps the head at int8) run in
    the same call: float32 logits equal to Qwen2Model.logits' (its bf16 rounding included), for greedy rows the
    sampler's argmax, for drawn rows the sampler's keyed race (after its top-k/top-p/min-p filters). A row that asks
    for logprobs gets logits, not a token."""
    path = request.getfixturevalue(model)
    path = path[0] if isinstance(path, tuple) else path
    fused, plain = _backend(path, dtype, quantization, "auto"), _backend(path, dtype, quantization, "off")
    assert fused.stack.head_rows == 4 == fused.forwards.max_rows  # (the rows it runs ahead)
    made = []
    for (hidden, logits, tokens, _), (plain_hidden, *_) in zip(_head_steps(fused, 1), _head_steps(plain, 1)):
        want = plain.model.logits(plain_hidden)
        assert torch.equal(hidden, plain_hidden)
        if logits is None:
            assert tokens is None
            made.append(0)
            continue
        assert torch.equal(logits, want) and tokens == want.argmax(dim=-1).tolist()
        made.append(len(tokens))
    assert made == [0, 0, 0, 2, 2, 2, 1]
    # seeded drawn rows, at a temperature alone or filtered: the keyed race's token, as the sampler draws it from
    # those logits
    for sampling in (SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=1.0, top_p=0.5, seed=3),
                     SamplingParams(temperature=0.8, top_k=7, min_p=0.05, seed=4)):
        backend = _backend(path, dtype, quantization, "auto")
        steps = _head_steps(backend, 1, sampling)
        assert [logits is not None for _, logits, _, _ in steps] == [False] * 3 + [True] * 4
        for _, logits, tokens, reqs in steps[3:]:
            assert tokens == backend.sampler.sample(logits, reqs)[0]
    # logprobs: the sampler's to do, on the call's logits
    steps = _head_steps(_backend(path, dtype, quantization, "auto"), 1, SamplingParams(temperature=0.0, logprobs=2))
    assert [logits is not None for _, logits, _, _ in steps] == [False] * 3 + [True] * 4
    assert all(tokens is None for _, _, tokens, _ in steps)


def test_execute_samples_the_same_tokens_from_the_fused_logits(llama_dir):
    """Through execute: greedy decodes (the call's tokens), seeded sampling at a temperature and logprobs (the
    sampler on the call's logits) give the Python path's tokens and logprobs."""
    fused, plain = _backend(llama_dir, "bfloat16", "int4", "auto"), _backend(llama_dir, "bfloat16", "int4", "off")
    mixes = [(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)),
             (SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0, logprobs=3))]
    for first, second in mixes:
        got, want = [], []
        for backend, out in ((fused, got), (plain, want)):
            d = Driver(backend, seed=7)
            a, b = [3, 14, 15, 92, 65], [35, 89, 79]
            backend.execute(batch_of([d.request("a", a, 0, 5, first), d.request("b", b, 0, 3, second)]))
            for k in range(4):
                a, b = a + [11 + k], b + [22 + k]
                mo = backend.execute(batch_of([d.request("a", a, len(a) - 1, 1, first),
                                               d.request("b", b, len(b) - 1, 1, second)]))
                out.append((mo.sampled_token_ids, mo.logprobs))
        assert got == want


@pytest.mark.parametrize("threads", [2, 3])
def test_the_fused_argmax_takes_the_first_of_equal_logits(tmp_path, threads):
    """An LM head whose rows are all one row: every logit of a step is equal, and the token is 0 (the first, as
    the sampler's argmax takes it), though the threads' shares of the vocabulary each find their own first."""
    hf = make_llama({"rope_type": "default", "rope_theta": 10000.0})
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.lm_head.weight[:1].expand_as(hf.lm_head.weight))
    hf.save_pretrained(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in ("float32", "bfloat16"):
            steps = _head_steps(_backend(tmp_path, dtype, "int8", "auto"), 4)
            assert [tokens for _, _, tokens, _ in steps] == [None] * 3 + [[0, 0]] * 3 + [[0]]
            assert all(bool((logits == logits[:, :1]).all()) for _, logits, _, _ in steps[3:])
    finally:
        torch.set_num_threads(before)


def test_a_token_id_past_the_embedding_raises_as_torch_does(llama_dir):
    """The call checks the ids before it runs anything (it copies their embedding rows itself): IndexError as
    torch's embedding raises (the engine fails that request alone), and the next step runs as before."""
    fused, plain = _backend(llama_dir, "bfloat16", "int4", "auto"), _backend(llama_dir, "bfloat16", "int4", "off")
    for b in (fused, plain):
        d = Driver(b, seed=5)
        with pytest.raises(IndexError, match="index out of range"):
            b._forward(batch_of([d.request("bad", [1, 2, 211], 0, 3)]))
    got, want = (b.compute_logits(batch_of([Driver(b, seed=6).request("a", [3, 4, 5], 0, 3)])) for b in (fused, plain))
    assert torch.equal(got, want)


def test_the_fused_call_times_its_kernels_when_asked(llama_dir):
    """benchmarks/profile_step.py's view inside the call: every stage gets time, the results do not change."""
    timed, untimed = (_backend(llama_dir, "bfloat16", "int4", "auto") for _ in range(2))
    timed.stack.stage_us = torch.zeros(len(STAGES), dtype=torch.float64)
    for got, want in zip(_steps(timed, 2), _steps(untimed, 2)):
        assert torch.equal(got, want)
    assert (timed.stack.stage_us > 0).all() and untimed.stack.stage_us is None


def amx_note(rows: int) -> str:
    """What the stack's note adds where this CPU runs a batch of that many decodes on AMX tiles."""
    if not kernel_library.amx(kernel_library.load()):
        return ""
    return f" ({rows}+: bf16 on AMX tiles, the weights dequantized as they are read)"


def int8_note(rows: int) -> str:
    """What the stack's note says of int8 activations from that many decodes (AMX's tiles from 16)."""
    if rows == 1:
        return "; int8 activations in every decode" + amx_note(16)
    return f"; int8 activations in batches of {rows}+ decodes" + amx_note(max(rows, 16))


def test_int8_decode_rows_auto_follows_what_binds_this_builds_products(qwen2_dir):
    """auto (the default): every decode on int8 where the build multiplies int16 as two bytes (AVX2 without VNNI:
    the products bind even one row), else from 16 decodes; a lone decode's logits are then those of the number."""
    path, _ = qwen2_dir
    lib = kernel_library.load()
    isa = lib.llmserve_quant_isa().decode()
    opts = {"fuse_layers": "auto", "quant_rows": 100_000}
    auto = make_backend(str(path), quantization="int4", options=opts)
    rows = 1 if isa == "avx2" else 16
    assert auto.stack.int8_rows == kernel_library.int8_decode_rows(lib) == rows
    assert auto.describe()["fused_layers"] == "up to 512 rows" + int8_note(rows)
    one = make_backend(str(path), quantization="int4", options={**opts, "int8_decode_rows": 1})
    wide = make_backend(str(path), quantization="int4", options={**opts, "int8_decode_rows": 0})

    def decode(b):  # one request's prompt, then its one decode as a step alone
        d, ids = Driver(b, seed=2), list(range(3, 11))
        b.compute_logits(batch_of([d.request("a", ids, 0, 8)]))
        return b.compute_logits(batch_of([d.request("a", ids + [5], 8, 1, prompt_len=8)]))

    got, int8, int16 = decode(auto), decode(one), decode(wide)
    assert torch.equal(got, int8 if rows == 1 else int16)
    fmt = auto.model.layers[0]["qkv"]._fmt
    assert torch.equal(int8, int16) != (lib.llmserve_quant_narrow(fmt) == 1)


def test_without_dense_copies_it_covers_what_a_step_can_hold(qwen2_dir):
    """quant_rows above any step: no dense copy is kept, the quantized kernels take every step, and so does the
    stack, up to the scheduler's token budget (512 here), with buffers sized by the steps it sees."""
    path, _ = qwen2_dir
    opts = {"fuse_layers": "auto", "quant_rows": 100_000}
    fused = make_backend(str(path), quantization="int4", options=opts)
    plain = make_backend(str(path), quantization="int4", options={**opts, "fuse_layers": "off"})
    assert fused.describe()["fused_layers"] == "up to 512 rows" + int8_note(fused.stack.int8_rows)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 200, (40,), generator=g).tolist()
    got, want = (b.compute_logits(batch_of([Driver(b).request("a", ids, 0, 40)])) for b in (fused, plain))
    assert torch.equal(got, want) and fused.stack._rows == 40


def test_a_bf16_models_prompt_of_many_rows_runs_on_amx_tiles(qwen2_dir):
    """Where the CPU has AMX, a bf16 model's steps of 16+ rows, a prompt's among them, run the quantized linears in
    bf16 on the tiles (the note says so): logits other than the int16 products' with the tiles off, and as close to
    the model's as bf16's rounding allows; a prompt of fewer rows takes the int16 products either way."""
    if not kernel_library.amx(kernel_library.load()):
        pytest.skip("this CPU (or its OS) has no AMX tiles: a prompt's rows take int16 here")
    path, _ = qwen2_dir
    b = make_backend(str(path), dtype="bfloat16", quantization="int4",
                     options={"fuse_layers": "auto", "quant_rows": 100_000})
    tiles = kernel_library.AMX_MIN_ROWS
    assert b.describe()["fused_layers"] == (f"up to 512 rows; steps of {tiles}+ rows (prompts too) in bf16 on AMX "
                                            "tiles, the weights dequantized as they are read")
    lib, g = kernel_library.load(), torch.Generator().manual_seed(4)

    def prompt(n):
        ids = torch.randint(0, 200, (n,), generator=g).tolist()
        on = b.compute_logits(batch_of([Driver(b, seed=n).request("a", ids, 0, n)]))
        lib.llmserve_quant_amx(0)
        try:
            off = b.compute_logits(batch_of([Driver(b, seed=n).request("a", ids, 0, n)]))
        finally:
            assert lib.llmserve_quant_amx(1) == 1
        return on, off

    on, off = prompt(tiles + 4)
    assert not torch.equal(on, off)
    torch.testing.assert_close(on, off, atol=0.05 * off.abs().max().item(), rtol=0)
    on, off = prompt(tiles - 4)
    assert torch.equal(on, off)


def test_a_steps_many_decodes_round_activations_to_int8_and_a_prompt_never(qwen2_dir):
    """int8_decode_rows: where a step has that many decodes, their rows (listed first) run the group kernels on int8
    activations: close to int16's logits, not equal, where this build has the int8 products. Fewer decodes, and
    every prompt row (alone or in the same step), stay int16: equal."""
    path, _ = qwen2_dir
    opts = {"fuse_layers": "auto", "quant_rows": 100_000}
    narrow = make_backend(str(path), quantization="int4", options={**opts, "int8_decode_rows": 6})
    wide = make_backend(str(path), quantization="int4", options={**opts, "int8_decode_rows": 0})
    assert narrow.describe()["fused_layers"] == "up to 512 rows; int8 activations in batches of 6+ decodes" + amx_note(16)
    assert wide.describe()["fused_layers"] == "up to 512 rows"

    def run(b, n):  # n prompts of 8 tokens in one step; one decode of each beside a new prompt's 8 tokens
        d, g = Driver(b, seed=1), torch.Generator().manual_seed(n)
        prompts = [torch.randint(0, 200, (8,), generator=g).tolist() for _ in range(n + 1)]
        pre = b.compute_logits(batch_of([d.request(f"r{i}", p, 0, 8) for i, p in enumerate(prompts[:n])]))
        step = [d.request(f"r{i}", p + [5], 8, 1, prompt_len=8) for i, p in enumerate(prompts[:n])]
        return pre, b.compute_logits(batch_of(step + [d.request("new", prompts[n], 0, 8)]))

    fmt = narrow.model.layers[0]["qkv"]._fmt
    has_int8 = kernel_library.load().llmserve_quant_narrow(fmt) == 1
    (pre_n, mixed_n), (pre_w, mixed_w) = run(narrow, 6), run(wide, 6)
    assert torch.equal(pre_n, pre_w) and torch.equal(mixed_n[6], mixed_w[6])  # the prompts
    assert torch.equal(mixed_n[:6], mixed_w[:6]) != has_int8
    assert torch.allclose(mixed_n, mixed_w, atol=0.05 * mixed_w.abs().max().item())
    (pre_n, mixed_n), (pre_w, mixed_w) = run(narrow, 5), run(wide, 5)
    assert torch.equal(pre_n, pre_w) and torch.equal(mixed_n, mixed_w)


def test_fuse_layers_option(qwen2_dir):
    path, _ = qwen2_dir
    dense = make_backend(str(path))  # float weights: nothing to fuse, and it says why
    assert dense.stack is None and "quantized" in dense.describe()["fused_layers"]
    assert _backend(path, "float32", "int4", False).stack is None  # YAML's bare `off`
    with pytest.raises(ConfigError, match="fuse_layers: must be one of auto, off"):
        _backend(path, "float32", "int4", "on")
    for bad in (-1, "16", "Auto", True, 1.5):
        with pytest.raises(ConfigError, match="int8_decode_rows: must be auto or a number of rows >= 0"):
            make_backend(str(path), quantization="int4", options={"int8_decode_rows": bad})


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_every_thread_count_shares_the_work_out_whole(llama_dir, quantization):
    """The call's threads split every kernel and meet at barriers (csrc/team.h). At 3 threads (uneven shares, more
    threads than this machine's cores, so members wait at barriers while descheduled) it equals the Python path on
    3 threads, and the one-thread call (nothing split) up to the order of attention's float sums (~2e-4 of logits
    up to ~6; a share left undone, tried by skipping one member's last tile, is off by the logits' whole size)."""
    def logits(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fused, plain = (_backend(llama_dir, "float32", quantization, f) for f in ("auto", "off"))
            return _steps(fused, 2), _steps(plain, 2)
        finally:
            torch.set_num_threads(before)

    three, three_plain = logits(3)
    one, _ = logits(1)
    for got, want, alone in zip(three, three_plain, one):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-3 * float(alone.abs().max()))


def _pin_share(backend, share):
    """Before each call of the backend's fused stack: the first member's share of the matmuls set to `share`, with
    no busy times to move it (decode_layers.cpp's Balance: [0] the share, [8] and [16] the members' times)."""
    balance, call = backend.stack._balance, backend.stack._fn

    def pinned(*args):
        balance.zero_()
        balance[0] = share
        return call(*args)

    backend.stack._fn = pinned


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_uneven_matmul_shares_make_the_same_outputs(llama_dir, quantization):
    """Two members share the matmuls out by their measured rates: whatever the split (0.2 to 0.8 of the outputs
    to the first), each output is made as the Python path makes it, so hidden states, logits and greedy tokens are
    its own, the head's argmax merging vocabulary shares of any size, and a drawn row's token the sampler's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = _backend(llama_dir, "bfloat16", quantization, "off")
        drawn = [SamplingParams(temperature=0.9, seed=2), SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=2)]
        want = [(h, plain.model.logits(h)) for h, *_ in _head_steps(plain, 5)]
        want_drawn = [[plain.sampler.sample(plain.model.logits(h), reqs)[0] for h, _, _, reqs in
                       _head_steps(plain, 5, sp)[3:]] for sp in drawn]  # (the steps where every row samples)
        for share in (0.2, 0.37, 0.8):
            fused = _backend(llama_dir, "bfloat16", quantization, "auto")
            _pin_share(fused, share)
            for (hidden, logits, tokens, _), (plain_hidden, plain_logits) in zip(_head_steps(fused, 5), want):
                assert torch.equal(hidden, plain_hidden)
                if logits is not None:
                    assert torch.equal(logits, plain_logits) and tokens == plain_logits.argmax(dim=-1).tolist()
            # drawn rows: the race reads every member's logits, whatever their shares (a filtered row's filter too)
            for sp, want_tokens in zip(drawn, want_drawn):
                assert [tokens for *_, tokens, _ in _head_steps(fused, 5, sp)] == [None] * 3 + want_tokens
            assert float(fused.stack._balance[0]) == pytest.approx(share)
    finally:
        torch.set_num_threads(before)


def test_the_first_members_share_follows_the_measured_rates(llama_dir):
    """At each forward's start the lead moves its share a quarter of the way to where both members would finish
    together (each member's share over its busy time), within [0.2, 0.8], and clears the times."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused = _backend(llama_dir, "bfloat16", "int4", "auto")
        d = Driver(fused, seed=2)
        balance = fused.stack._balance
        a = [4, 8, 15]
        fused.execute(batch_of([d.request("a", a, 0, 3, SamplingParams(temperature=0.0))]))
        assert float(balance[8]) > 0 and float(balance[16]) > 0  # each member timed its matmuls
        for share, t0, t1, want in ((0.5, 300.0, 100.0, 0.4375), (0.21, 1e6, 1.0, 0.2), (0.7, 1.0, 1e6, 0.775)):
            balance.zero_()
            balance[0], balance[8], balance[16] = share, t0, t1
            a = a + [42]
            fused.execute(batch_of([d.request("a", a, len(a) - 1, 1, SamplingParams(temperature=0.0))]))
            assert float(balance[0]) == pytest.approx(want)
    finally:
        torch.set_num_threads(before)


def _engine_outputs(path, dtype, quantization, steps, sampling, early=None):
    """Every sequence's tokens and finish reason through an Engine on the fused call, and how many forwards its
    steps ran; with `early` (a list), outputs delivered mid-step (Engine.early) count too, and each such delivery's
    thread name is appended to it."""
    import threading

    from llmserve.engine import Engine

    eng = Engine.from_config({
        "model": {"model": str(path), "dtype": dtype, "quantization": quantization},
        "backend": {"name": "torch", "kv_cache_memory": "8MiB", "options": {"quant_rows": 4}},
        "tokenizer": {"name": "none"}, "cache": {"block_size": 4},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 64, "num_scheduler_steps": steps,
                      "stream_interval": 1}})
    g = torch.Generator().manual_seed(11)
    for i, (n, sp) in enumerate(zip((5, 9, 3, 14), sampling)):
        eng.add_request(torch.randint(0, 200, (n,), generator=g).tolist(), sp, request_id=f"r{i}")
    got, forwards, delivered = {}, [], []

    def take(outputs):
        for o in outputs:
            toks, _ = got.get(o.request_id, ([], None))
            got[o.request_id] = (toks + o.new_token_ids, o.finish_reason)

    if early is not None:
        eng.early = lambda outputs: (early.append(threading.current_thread().name), take(outputs))
    while eng.has_unfinished:
        so = eng.step()
        forwards.append(so.metrics.num_forwards)
        take(so.outputs)
    return got, forwards


@pytest.mark.parametrize(("quantization", "dtype"), [("int4", "bfloat16"), ("int8", "float32")])
def test_several_forwards_in_one_call_give_one_forward_a_steps_tokens(llama_dir, quantization, dtype):
    """scheduler.num_scheduler_steps: greedy decodes and seeded drawn rows (at a temperature alone, or filtered by
    top-k, top-p or min-p) run ahead in the one call (decode_ahead: positions, slots and ids moved on inside it, each
    forward's keys from (seed, output index)) and give exactly the tokens of a forward a step, a sequence's last run
    clamped at its max_tokens."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (19, 7, 23, 12)]
    mixed = greedy[:2] + [SamplingParams(temperature=0.9, seed=4, max_tokens=9, ignore_eos=True)] + greedy[3:]
    drawn = [SamplingParams(temperature=t, seed=i, max_tokens=m, ignore_eos=True)
             for i, (t, m) in enumerate([(0.7, 13), (1.0, 21), (1.3, 6), (0.5, 17)])]
    filtered = [SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=25, ignore_eos=True), greedy[1],
                SamplingParams(temperature=1.1, top_k=5, seed=2, max_tokens=16, ignore_eos=True),
                SamplingParams(temperature=0.7, min_p=0.1, top_p=0.95, seed=3, max_tokens=11, ignore_eos=True)]
    for sampling in (greedy, mixed, drawn, filtered):
        one, f1 = _engine_outputs(llama_dir, dtype, quantization, 1, sampling)
        many, f8 = _engine_outputs(llama_dir, dtype, quantization, 8, sampling)
        assert many == one
        assert set(f1) == {1} and max(f8) == 8
        assert [len(one[f"r{i}"][0]) for i in range(len(sampling))] == [sp.max_tokens for sp in sampling]
    assert len({tuple(toks) for toks, _ in many.values()}) > 1  # (not every row the same tokens)


def test_two_rows_of_one_sequence_read_each_others_keys(llama_dir):
    """A prompt chunk of two tokens runs on each member's own copies; the second token's attention reads the key
    the first stored in the same step, so the members meet after the store there (own_rope_and_kv): the logits are
    the Python path's. Fresh sequences on reused blocks (whose old keys a read before the store would find), two
    threads, many times (a missing barrier failed it most runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused, plain = _backend(llama_dir, "bfloat16", "int4", "auto"), _backend(llama_dir, "bfloat16", "int4", "off")
        g = torch.Generator().manual_seed(3)
        for i in range(60):
            toks = torch.randint(0, 200, (2,), generator=g).tolist()
            got, want = [backend.compute_logits(batch_of([Driver(backend, seed=i).request("a", toks, 0, 2)]))
                         for backend in (fused, plain)]
            assert torch.equal(got, want), i
    finally:
        torch.set_num_threads(before)


# a Q4_K_M-like file: each tensor in its own type (q|k|v meet in int6 with offsets and scales per 16, gate|up in int5
# with offsets), the LM head in Q6_K, the embedding (not tied) in Q4_K
MIXED_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q5_1", "ffn_gate": "Q5_K",
               "ffn_up": "Q5_0", "ffn_down": "Q8_0", "output": "Q6_K", "token_embd": "Q4_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    from gguf_helpers import dequantize, gguf_tensors, make_decoder, quantize, write_gguf

    hf = make_decoder("llama", hidden=256, seed=5)  # K-quants need 256 inputs per row
    tensors = {}
    for name, t in gguf_tensors(hf).items():
        qtype = MIXED_TYPES.get(name.split(".")[-2])
        tensors[name] = (quantize(t, qtype), qtype) if qtype and t.ndim == 2 else t.astype(np.float32)
    path = write_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", hf, tensors=tensors)
    return SimpleNamespace(path=path, embed=dequantize(*tensors["token_embd.weight"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_file_of_mixed_group_kinds_runs_fused_with_its_own_head(mixed_gguf, dtype):
    """Every GGUF type at its own bits in one call, the Q6_K LM head included, the Q4_K embedding kept quantized:
    hidden states, logits and greedy tokens equal the Python path's, and the embedding's rows the file's."""
    fused, plain = _backend(mixed_gguf.path, dtype, "auto", "auto"), _backend(mixed_gguf.path, dtype, "auto", "off")
    ids = torch.tensor([0, 5, 17, 200, 255])
    for b in (fused, plain):
        assert isinstance(b.model.embed, QuantEmbedding) and b.describe()["memory"]["embedding"] > 0
        want = torch.from_numpy(mixed_gguf.embed.reshape(-1, 256)).to(b.model.dtype)[ids]
        assert torch.equal(b.model.embed(ids), want)
    kinds = fused.describe()["quantization"]["linears"]
    assert kinds == {"int6 (Q4_K+Q5_0+Q6_K)": 2, "int5 (Q5_1)": 2, "int5 (Q5_0+Q5_K)": 2, "int8g (Q8_0)": 2,
                     "int6 (Q6_K)": 1}
    assert fused.stack is not None and fused.stack.head_rows == 4
    # /stats names each kind's kernel, its source types and the bits it reads a weight: the file's own
    kernels = fused.describe()["quantization"]["kernels"]
    assert kernels["int8g"]["sources"] == {"Q8_0": 2} and kernels["int8g"]["bits_read"] == 8.5
    assert kernels["int5"]["sources"] == {"Q5_0+Q5_K": 2, "Q5_1": 2} and kernels["int5"]["bits_read"] == 6.0
    assert kernels["int6"]["kernel"].startswith("llmserve int6")
    types = fused.describe()["quantization"]["types"]
    assert types["Q8_0"] == {"kind": "int8g", "kernel": kernels["int8g"]["kernel"], "linears": 2, "bits_read": 8.5}
    assert types["Q4_K+Q5_0+Q6_K"]["bits_read"] == 8.0  # int6 with offsets and scales per 16
    for (hidden, logits, tokens, _), (plain_hidden, *_) in zip(_head_steps(fused, 2), _head_steps(plain, 2)):
        assert torch.equal(hidden, plain_hidden)
        if logits is not None:
            want = plain.model.logits(plain_hidden)
            assert torch.equal(logits, want) and tokens == want.argmax(dim=-1).tolist()


def test_each_forward_of_a_call_is_handed_on_while_the_call_runs(llama_dir, monkeypatch):
    """decode_ahead with a listener (the engine's relay): each forward's tokens replayed and delivered from the
    relay's thread as the call writes them, before it returns, the same tokens as a forward a step."""
    from llmserve_torch import fused_stack

    sampling = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (19, 7, 23, 12)]
    one, _ = _engine_outputs(llama_dir, "float32", "int4", 1, sampling)
    # every call made to last 50 ms past its last forward (the GIL released, as in the call): the relay hands every
    # forward on before the call returns
    real_call = fused_stack.FusedStack._call

    def slow_call(self, *args):
        out = real_call(self, *args)
        if len(args) > 6 and args[6] is not None:
            time.sleep(0.05)
        return out

    monkeypatch.setattr(fused_stack.FusedStack, "_call", slow_call)
    threads: list[str] = []
    many, f8 = _engine_outputs(llama_dir, "float32", "int4", 8, sampling, early=threads)
    assert many == one and max(f8) == 8
    assert threads and set(threads) == {"llmserve-forward-relay"}
    # one delivery a forward of each call: as many as the forwards after each sequence's prompt
    assert len(threads) == sum(f for f in f8 if f > 1)
    monkeypatch.setattr(fused_stack.FusedStack, "_call", real_call)
    many, _ = _engine_outputs(llama_dir, "bfloat16", "int4", 8, sampling, early=[])  # as fast as it runs
    assert many == _engine_outputs(llama_dir, "bfloat16", "int4", 1, sampling)[0]
