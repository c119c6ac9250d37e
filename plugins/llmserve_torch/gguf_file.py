"""A llama.cpp GGUF file read with the `gguf` package: its metadata as a transformers config, its tensors
dequantized under Hugging Face names, with llama.cpp's converter transforms undone. What each architecture's
metadata, names and transforms are is its model family's to say (models/family.py: gguf_config, gguf_names,
gguf_convert)."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig
from llmserve_torch.gguf_quant import repack
from llmserve_torch.gguf_reader import GGUFFile
from llmserve_torch.models.family import arch_from_hf, family_for_gguf, gguf_archs
from llmserve_torch.quant import QuantWeight

log = logging.getLogger("llmserve.torch")

# the ggml types we dequantize (gguf.quants does the work; each one has a test)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# stored in the cache as they are; the rest become float32, which holds every dequantized value exactly
_EXACT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}

_MISSING = object()


def resolve_gguf(model: str) -> Path:
    """model.model as a GGUF file: the path itself, or the one .gguf in a directory."""
    p = Path(model).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(f"model.model: {model!r} holds {len(found)} .gguf files "
                              f"({', '.join(f.name for f in found)}); pass the one to serve")
        return found[0]
    if not p.is_file():
        raise ConfigError(f"model.model: no such GGUF file {model!r}")
    return p


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values as float32 [rows, cols] (gguf.quants; the reader's shapes are reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(tensor.data, tensor.tensor_type)


class GGUFCheckpoint:
    """An open GGUF file: checked for a supported architecture and tensor types as it opens."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = GGUFFile(path)
        except (OSError, ValueError) as e:  # a truncated or foreign file
            raise ConfigError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.file.tensors}
        self.arch_name = self.meta("general.architecture")
        family = family_for_gguf(self.arch_name)
        if family is None:
            raise ConfigError(f"{path}: GGUF architecture {self.arch_name!r} is not supported by the torch backend "
                              f"(supported: {', '.join(gguf_archs())})")
        self.family = family
        self.names = family.gguf_names(self.arch_name)
        if self.meta("split.count", 1) > 1:
            raise ConfigError(f"{path}: a split GGUF (part of {self.meta('split.count')}) is not supported; "
                              "merge it first: llama-gguf-split --merge <first part> <out>.gguf")
        bad = sorted({t.tensor_type.name for t in self.tensors.values()} - set(SUPPORTED_TYPES))
        if bad:
            names = [t.name for t in self.tensors.values() if t.tensor_type.name in bad]
            raise ConfigError(f"{path}: GGUF tensor type(s) {', '.join(bad)} are not supported "
                              f"(e.g. {names[0]}); supported: {', '.join(SUPPORTED_TYPES)}")
        # the metadata read (and checked) before any slow work
        self._fields = self._hf_fields()

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (strings decoded, arrays as lists); a ConfigError names a missing required key."""
        value = self.file.meta(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ConfigError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        return value

    def type_counts(self) -> Counter:
        """How many tensors of each ggml type the file holds."""
        return Counter(t.tensor_type.name for t in self.tensors.values())

    def _dtype_name(self) -> str:
        """The checkpoint dtype `model.dtype: auto` means: the matrices' float type, float32 for quantized ones."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) > 1}
        return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")

    def values(self, name: str) -> np.ndarray:
        """A tensor's values, dequantized to float32."""
        return dequantize(self.tensors[name])

    def hf_fields(self) -> tuple[str, dict[str, Any]]:
        """The model type and transformers config fields the metadata describes (no transformers import needed)."""
        model_type, fields = self._fields
        return model_type, dict(fields)

    def _hf_fields(self) -> tuple[str, dict[str, Any]]:
        """The family's fields, and those of every file: the vocabulary, BOS/EOS ids and the dtype."""
        if "token_embd.weight" not in self.tensors:
            raise ConfigError(f"{self.path}: GGUF has no token_embd.weight tensor")
        model_type, fields = self.family.gguf_config(self)
        # the embedding's rows, not the tokenizer's length: files may pad the vocabulary
        return model_type, dict(fields, vocab_size=int(self.tensors["token_embd.weight"].shape[-1]),
                                bos_token_id=self.meta("tokenizer.ggml.bos_token_id", None),
                                eos_token_id=self.meta("tokenizer.ggml.eos_token_id", None),
                                torch_dtype=self._dtype_name())

    def hf_config(self):
        """The transformers config the metadata describes (saved as the dense cache's config.json)."""
        from transformers import AutoConfig

        model_type, fields = self.hf_fields()
        return AutoConfig.for_model(model_type, **fields)

    def arch(self) -> ArchConfig:
        """The ArchConfig of the model (the same translation a config.json goes through, without transformers:
        importing it costs seconds at every start)."""
        model_type, fields = self.hf_fields()
        return arch_from_hf(SimpleNamespace(model_type=model_type, **fields))

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor; None for one the model does not load (GPT-2's tied head, rope_freqs)."""
        names = self.names
        if gguf_name in names.dropped:
            return None  # (rope_freqs went into the config: hf_fields)
        top, block, prefix = names.top, names.block, names.prefix
        base, _, kind = gguf_name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m[2] in block:
            return f"{prefix}.{m[1]}.{block[m[2]]}.{kind}"
        if base in top:
            return f"{top[base]}.{kind}"
        raise ConfigError(f"{self.path}: GGUF tensor {gguf_name!r} has no place in the torch backend's "
                          f"{self.arch_name} model")

    def repacked(self, name: str) -> QuantWeight:
        """One quantized tensor repacked for the CPU kernels and converted (a linear's weight read when the model makes
        it: packed_cache.Deferred); its pages leave the resident set once read."""
        t = self.tensors[name]
        w = self.family.gguf_convert(self, name, repack(t))
        self.file.release(t)
        return w

    def state_dict(self, quantized: bool = False, placeholder=None) -> dict[str, torch.Tensor | QuantWeight]:
        """Every tensor under its HF name: dequantized (float32, or F16/BF16 as stored), or with quantized=True
        each quantized one repacked for the CPU kernels (gguf_quant) without a float copy; logs progress.
        placeholder(hf_name, tensor): what stands for a tensor not to be read at all (packed_cache.Packed), or None."""
        sd: dict[str, torch.Tensor | QuantWeight] = {}
        todo = []
        for n, t in self.tensors.items():
            hf = self.hf_name(n)
            stand_in = placeholder(hf, t) if hf is not None and placeholder is not None else None
            if stand_in is not None:
                sd[hf] = stand_in
            elif hf is not None:
                todo.append((n, t))
        for name, t in _progress(todo, f"{'repacking' if quantized else 'dequantizing'} {self.path.name}"):
            packed = repack(t) if quantized else None
            if packed is not None:
                sd[self.hf_name(name)] = self.family.gguf_convert(self, name, packed)
                continue
            w = self.family.gguf_convert(self, name, dequantize(t))
            w = np.ascontiguousarray(w) if w.flags.writeable else w.copy()  # torch wants a writable buffer
            sd[self.hf_name(name)] = torch.from_numpy(w).to(_EXACT_DTYPES.get(t.tensor_type.name, torch.float32))
        if self.names.tied_output and "output.weight" in self.tensors:
            # the model ties its head to the embedding (GPT-2, as HF's does); a quantized copy only differs by rounding
            head = torch.from_numpy(dequantize(self.tensors["output.weight"]).copy())
            embed = sd[self.hf_name("token_embd.weight")]
            if not torch.equal(head, embed.dequantize() if isinstance(embed, QuantWeight) else embed.float()):
                log.warning("%s: output.weight differs from token_embd.weight (quantized apart); the %s head "
                            "uses token_embd", self.path.name, self.family.name)
        return sd


def _progress(items: list[tuple[str, Any]], desc: str):
    """Yield the (name, tensor) items with a tqdm bar on a terminal, else a log line every few seconds."""
    total = sum(int(t.n_bytes) for _, t in items) or 1
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False) as bar:
            for item in items:
                yield item
                bar.update(int(item[1].n_bytes))
        return
    t0 = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += int(item[1].n_bytes)
        now = time.perf_counter()
        if now - last >= 5.0:
            log.info("%s: %.0f%% of %.0f MB (%.0fs)", desc, 100 * done / total, total / 1e6, now - t0)
            last = now
