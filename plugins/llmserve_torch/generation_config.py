"""The model's own generation defaults: its EOS ids and the sampling parameters of generation_config.json.

A checkpoint has the file beside config.json; a GGUF's converted cache gets one written from its
metadata (the eos / eot / eom ids and llama.cpp's general.sampling.* keys). The keys read are the ones
vLLM reads (`--generation-config auto`); do_sample and max_length are not read, as vLLM does not.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.request import SamplingParams

log = logging.getLogger("llmserve.torch")

FILE = "generation_config.json"
# generation_config.json key → SamplingParams field
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key → generation_config.json key
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
# llama.cpp ends a generation at any of these
GGUF_EOS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Every EOS id the model declares, its default SamplingParams fields, and where those came from."""

    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # the file (or model card, model_cards.py) that set sampling; None: nothing did


def _ids(value: Any) -> set[int]:
    """The ids of an HF eos_token_id value: an int, a list of ints, or null."""
    return {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int) and not isinstance(v, bool)}


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s); it is not used", path, e)
        return {}
    return d if isinstance(d, dict) else {}


def read(model_dir: Path) -> GenerationDefaults:
    """The EOS ids of config.json and generation_config.json, and the latter's sampling keys (bad values skipped)."""
    gen = _json(model_dir / FILE)
    sampling = {}
    for key, name in HF_KEYS.items():
        v = gen.get(key)
        if v is None:
            continue
        try:
            SamplingParams(**{name: v}).validate()  # the rule a request's own value would meet
        except (InvalidRequestError, TypeError) as e:
            log.warning("%s: %s=%r is not used as a default (%s)", model_dir / FILE, key, v, e)
            continue
        sampling[name] = v
    return GenerationDefaults(frozenset(_ids(_json(model_dir / "config.json").get("eos_token_id"))
                                        | _ids(gen.get("eos_token_id"))), sampling,
                              str(model_dir / FILE) if sampling else None)


def from_gguf(ckpt) -> dict[str, Any]:
    """generation_config.json's content for a GGUFCheckpoint: its end-of-generation ids and sampling keys."""
    out: dict[str, Any] = {"eos_token_id": sorted(_ids([ckpt.meta(k, None) for k in GGUF_EOS]))}
    for key, hf in GGUF_KEYS.items():
        v = ckpt.meta(key, None)
        if v is not None:  # float32 in the file: 0.6 reads 0.6000000238
            out[hf] = float(f"{v:.6g}") if isinstance(v, float) else v
    return out
