"""A checkpoint's generation_config.json (a GGUF's metadata): every EOS id ends generation, its sampling keys are defaults."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from gguf_helpers import make_decoder, write_gguf
from torch_helpers import make_qwen2
from transformers import GenerationConfig

from llmserve.config import ModelConfig, config_from_dict
from llmserve.engine import Engine
from llmserve.request import SamplingParams
from llmserve_torch import sources
from llmserve_torch.generation_config import FILE, read
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2-257")
    make_qwen2(vocab_size=257).save_pretrained(d)  # the byte tokenizer's vocabulary; eos 5
    return d


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the tiny checkpoint, for one test's generation_config.json."""
    return Path(shutil.copytree(saved, tmp_path / "m"))


def _engine(d: Path, **model) -> Engine:
    return Engine.from_config(config_from_dict({"model": {"model": str(d), **model}, "tokenizer": {"name": "none"},
                                                "backend": {"kv_cache_memory": "4MiB"}}))


def test_every_eos_id_and_the_sampling_keys_are_read(ckpt, caplog):
    GenerationConfig(eos_token_id=[5, 9], temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.05,
                     max_new_tokens=7, max_length=4096, do_sample=True).save_pretrained(ckpt)
    g = read(ckpt)
    assert g.eos_token_ids == {5, 9}
    assert g.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                          "max_tokens": 7}  # max_length and do_sample are not read (nor by vLLM)
    # a value a request could not have is skipped, with a warning naming it
    (ckpt / FILE).write_text(json.dumps({"eos_token_id": 11, "temperature": 5.0, "top_k": 2.5, "top_p": 0.5}))
    with caplog.at_level(logging.WARNING, logger="llmserve.torch"):
        g = read(ckpt)
    assert g.eos_token_ids == {5, 11} and g.sampling == {"top_p": 0.5}
    assert "temperature=5.0" in caplog.text and "top_k=2.5" in caplog.text
    (ckpt / FILE).unlink()
    assert read(ckpt).eos_token_ids == {5} and read(ckpt).sampling == {}


def test_every_eos_id_ends_generation_even_with_the_defaults_off(ckpt):
    prompt = [[1, 2, 3]]
    eng = _engine(ckpt)
    out = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    eng.shutdown()
    i = next(i for i in range(1, 8) if out[i] not in out[:i])
    assert 5 not in out[: i + 1]
    GenerationConfig(eos_token_id=[5, out[i]]).save_pretrained(ckpt)
    for gc in ("auto", "none"):
        eng = _engine(ckpt, generation_config=gc)
        try:
            assert eng.eos_token_ids == {5, out[i]} and eng.backend.eos_token_ids == {5, out[i]}
            assert eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0] == out[: i + 1]
            # min_tokens holds every EOS id back: the sampler masks the second one too
            held = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=i + 2))[0]
            assert held[:i] == out[:i] and held[i] != out[i]
        finally:
            eng.shutdown()


def test_a_chat_request_takes_the_checkpoints_defaults_over_http(ckpt):
    GenerationConfig(eos_token_id=5, do_sample=True, top_k=1, max_new_tokens=6).save_pretrained(ckpt)
    s = start_server({"model": {"model": str(ckpt), "max_model_len": 128}, "tokenizer": {"name": "byte"},
                      "backend": {"kv_cache_memory": "4MiB"}})
    try:
        c = s.client()

        def ids(**kw):
            r = c.chat.completions.create(model=str(ckpt), messages=[{"role": "user", "content": "hello"}], seed=1,
                                          logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids":
                                                                     True, **kw.pop("extra", {})}, **kw)
            return [e.token for e in r.choices[0].logprobs.content], r.choices[0].finish_reason

        greedy, _ = ids(temperature=0.0, max_tokens=6)
        # max_tokens 6 and top_k 1 (so temperature 1 samples the argmax) come from the file
        assert ids() == (greedy, "length")
        # fields the client sends win: all 257 tokens (top_k 0) at temperature 1 and max_tokens 10
        sampled, _ = ids(max_tokens=10, extra={"top_k": 0})
        assert len(sampled) == 10 and sampled[:6] != greedy
    finally:
        s.stop()


def test_a_gguf_gives_its_eot_id_and_sampling_keys_quantized_or_dequantized(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "t.gguf", make_decoder("llama"), extra_kv={
        "tokenizer.ggml.eot_token_id": 3, "general.sampling.temp": 0.6, "general.sampling.top_k": 20})

    def load(quantization: str):
        res = sources.find_source(str(path)).load(ModelConfig(model=str(path), quantization=quantization))
        res.finish()  # (a first start's tokenizer export runs beside the weights)
        return res

    for q in ("none", "auto", "none"):  # the dequantized cache, the weights repacked from the file, the cache again
        res = load(q)
        assert res.generation.eos_token_ids == {2, 3}
        assert res.generation.sampling == {"temperature": 0.6, "top_k": 20}  # float32 0.6, read back as 0.6
        assert (Path(res.tokenizer_dir) / FILE).is_file()  # (the metadata cache holds it, whichever the weights)
