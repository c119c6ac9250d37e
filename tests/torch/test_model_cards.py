"""A model card's sampling stands in where a model's files carry none; the files' own keys win."""

from __future__ import annotations

import pytest
from gguf_helpers import make_decoder, write_gguf

from llmserve.config import ModelConfig
from llmserve_torch.generation_config import GenerationDefaults
from llmserve_torch.loader import load_model
from llmserve_torch.model_cards import CARDS, card_for, with_card

SMOL, SMOL_Q4_1 = CARDS


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct",
                                  "smollm2-135m-instruct-q8_0", "SmolLM2-135M-Instruct.Q5_K_M",
                                  "/models/SmolLM2-135M-Instruct", "Smollm2 135M 8k Lc100K Mix1 Ep2"])
def test_the_names_the_default_models_weights_go_by_find_its_card(name):
    assert card_for([None, "", name]) is SMOL
    assert SMOL.sampling == {"temperature": 0.2, "top_p": 0.9}  # the card's transformers example


def test_the_default_models_own_file_is_served_greedy_as_measured():
    # its file's name first, then its general.name: the file's own entry wins
    assert card_for(["SmolLM2-135M-Instruct.Q4_1", "Smollm2 135M 8k Lc100K Mix1 Ep2"]) is SMOL_Q4_1
    assert SMOL_Q4_1.sampling == {"temperature": 0.0} and "14 times in 40" in SMOL_Q4_1.source


@pytest.mark.parametrize("name", ["SmolLM2-360M-Instruct", "SmolLM2-135M", "smollm2", "Qwen2.5-0.5B-Instruct"])
def test_another_model_finds_none(name):
    assert card_for([name]) is None


def test_the_card_fills_in_only_where_the_files_set_no_sampling_key():
    filled = with_card(GenerationDefaults(frozenset({2})), ["SmolLM2-135M-Instruct"])
    assert filled.sampling == {"temperature": 0.2, "top_p": 0.9} and filled.eos_token_ids == {2}
    assert "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct" in filled.source
    own = GenerationDefaults(frozenset({2}), {"top_k": 5}, "generation_config.json")
    assert with_card(own, ["SmolLM2-135M-Instruct"]) is own
    assert with_card(GenerationDefaults(), ["tiny"]).sampling == {}


@pytest.mark.parametrize("quantization", ["none", "auto"])  # the cached checkpoint, and the file's own tensors
def test_a_gguf_named_for_the_model_is_served_with_its_card_unless_its_metadata_has_sampling(
        tmp_path, monkeypatch, quantization):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    bare = write_gguf(tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf", make_decoder("llama"))
    gen = load_model(ModelConfig(model=str(bare), quantization=quantization)).generation
    assert gen.sampling == SMOL.sampling and gen.source == SMOL.source
    (tmp_path / "own").mkdir()
    own = write_gguf(tmp_path / "own" / "SmolLM2-135M-Instruct.Q8_0.gguf", make_decoder("llama"),
                     extra_kv={"general.sampling.temp": 0.7})
    gen = load_model(ModelConfig(model=str(own), quantization=quantization)).generation
    assert gen.sampling == {"temperature": 0.7} and gen.source == "SmolLM2-135M-Instruct.Q8_0.gguf's metadata " \
                                                                 "(general.sampling.*)"
