"""Scaled RoPE (linear, Llama 3.1's llama3, dynamic NTK) gives HF transformers' frequencies, logits and greedy tokens.

The tiny Llama has head_dim 16, so its 8 wavelengths run from ~6 to ~20000 positions. For llama3 the
pretraining context is 64 with low/high frequency factors 1 and 4: wavelengths under 16 stay, those
over 64 are divided by the factor, the two between are blended. Prompts run past position 64.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from test_engine_vs_hf import engine_for, hf_greedy, prompts, run
from test_models import hf_logits
from torch_helpers import Driver, batch_of, make_backend, make_llama

from llmserve.errors import ConfigError
from llmserve.request import SamplingParams
from llmserve_torch.arch import Rope, rope_from_hf
from llmserve_torch.checkpoint import read_arch
from llmserve_torch.models.rope import default_inv_freq, inv_freq

MAX_POSITIONS = 256
ORIGINAL = 64
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}
SUPPORTED = "supported: default, linear, llama3, dynamic"


@pytest.fixture(scope="module", params=sorted(ROPES))
def scaled(request, tmp_path_factory):
    """A tiny Llama saved with one scaled rope type; yields (type, dir, hf_model)."""
    hf = make_llama(ROPES[request.param], max_positions=MAX_POSITIONS)
    d = tmp_path_factory.mktemp(f"llama-{request.param}")
    hf.save_pretrained(d)
    return request.param, d, hf


def test_frequencies_are_bit_identical_to_hf(scaled):
    rope_type, path, hf = scaled
    arch = read_arch(path)
    assert arch.rope.type == rope_type
    assert torch.equal(inv_freq(arch.rope, arch.head_dim), hf.model.rotary_emb.inv_freq)


def test_llama3_keeps_scales_and_blends_frequencies():
    """The llama3 fixture exercises all three regimes, so the comparisons above see each of them."""
    rope = rope_from_hf(SimpleNamespace(model_type="llama", max_position_embeddings=MAX_POSITIONS,
                                        rope_parameters=ROPES["llama3"]))
    base, got = default_inv_freq(rope.theta, 16), inv_freq(rope, 16)
    wavelen = 2 * math.pi / base
    assert torch.equal(got[wavelen < ORIGINAL / 4], base[wavelen < ORIGINAL / 4])
    assert torch.equal(got[wavelen > ORIGINAL], base[wavelen > ORIGINAL] / 4.0)
    band = (wavelen >= ORIGINAL / 4) & (wavelen <= ORIGINAL)
    assert band.sum() == 2
    assert ((got[band] < base[band]) & (got[band] > base[band] / 4.0)).all()


def test_greedy_tokens_match_hf_generate(scaled):
    """Chunked prefill of prompts that cross the original context, then decode, token for token."""
    _, path, hf = scaled
    eng = engine_for(path, scheduler={"max_num_batched_tokens": 32, "max_num_seqs": 4})
    ps = prompts(hf.config.vocab_size, [90, 70, 12], seed=7)
    got, _, ids = run(eng, ps, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for rid, p in zip(ids, ps):
        assert got[(rid, 0)] == hf_greedy(hf, p)


def test_logits_match_hf_past_the_original_context(scaled):
    rope_type, path, hf = scaled
    b = make_backend(str(path))
    d = Driver(b)
    seq = prompts(b.vocab_size, [100], seed=8)[0]
    want = hf_logits(hf, seq)
    done = 0
    for chunk in (40, 35, 25):  # chunked prefill: later chunks attend to K/V already in the paged cache
        logits = b.compute_logits(batch_of([d.request("a", seq, done, chunk)]))
        torch.testing.assert_close(logits, want[done:done + chunk], atol=1e-4, rtol=1e-4)
        done += chunk
    unscaled = make_llama({"rope_type": "default"}, max_positions=MAX_POSITIONS)
    unscaled.load_state_dict(hf.state_dict())
    # dynamic NTK is the unscaled RoPE within max_position_embeddings, the only context it runs at
    differs = not torch.allclose(hf_logits(unscaled, seq), want, atol=1e-3)
    assert differs == (rope_type != "dynamic")


def test_dynamic_refuses_a_context_past_max_position_embeddings(tmp_path):
    make_llama(ROPES["dynamic"], max_positions=MAX_POSITIONS).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"max_model_len: 257 exceeds .*dynamic-NTK.*\(256\)"):
        make_backend(str(tmp_path), max_model_len=MAX_POSITIONS + 1)
    assert make_backend(str(tmp_path), max_model_len=MAX_POSITIONS).max_model_len == MAX_POSITIONS


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
     rf"RoPE type 'yarn' is not supported .*\({SUPPORTED}\)"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": ORIGINAL}, rf"RoPE type 'longrope' is not supported .*\({SUPPORTED}\)"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_types_we_cannot_compute_exactly_are_refused(tmp_path, rope, message):
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
                                   rope_parameters=rope)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        read_arch(tmp_path)


def _transformers4(rope_scaling: dict | None, **top) -> SimpleNamespace:
    """A config as transformers 4 laid it out: rope_theta on the config, scaling in rope_scaling."""
    return SimpleNamespace(model_type="llama", max_position_embeddings=MAX_POSITIONS, rope_theta=500000.0,
                           rope_scaling=rope_scaling, **top)


def test_transformers4_rope_scaling_layout():
    assert rope_from_hf(_transformers4(None)) == Rope(theta=500000.0)
    assert rope_from_hf(_transformers4({"type": "linear", "factor": 2})) == Rope(500000.0, "linear", 2.0)
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert rope_from_hf(_transformers4(llama31)) == Rope(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    assert rope_from_hf(_transformers4({"type": "dynamic", "factor": 2.0})).original_max_positions == MAX_POSITIONS
    with pytest.raises(ConfigError, match="'llama3' needs 'low_freq_factor'"):
        rope_from_hf(_transformers4({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}))
