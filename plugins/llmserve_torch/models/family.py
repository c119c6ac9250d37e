"""The model-family registry: what a family of checkpoints provides to the torch backend, and where each registers.

A family is one module of this package that defines a `ModelFamily` and calls `register_family` on it: the HF
`model_type`s and GGUF architectures it serves, how their config becomes an ArchConfig, the tensors it loads (names,
shapes, which feed linears), the GGUF names and what llama.cpp's converter did to undo, how its model object is
built, and what the backend may do with it (generate, pool, run the fused C decode stack). The sources, the loader,
the GGUF reader and the backend ask the registry; none of them names a family. Every module of this package is
imported with it (models/__init__.py), so a new family is one new file; a plugin registers its own the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig


@dataclass(frozen=True, slots=True)
class GGUFNames:
    """How a GGUF architecture's tensors are named in the HF checkpoint (without the .weight / .bias suffix)."""

    top: dict[str, str]  # GGUF name → HF name, outside the layers (token_embd → model.embed_tokens)
    block: dict[str, str]  # a layer's GGUF part → HF part (attn_q → self_attn.q_proj)
    prefix: str  # the HF layers' prefix: blk.N.<part> becomes <prefix>.N.<HF part>
    # GGUF tensors the model does not load (read into the config instead, e.g. rope_freqs.weight)
    dropped: tuple[str, ...] = ()
    # a file's output.weight is a copy of token_embd the model does not load (its head is tied): a warning where they
    # differ
    tied_output: bool = False


class GGUFView(Protocol):
    """What a family reads of an open GGUF file (gguf_file.GGUFCheckpoint) to describe its model."""

    path: Path
    arch_name: str  # general.architecture
    tensors: dict[str, Any]  # GGUF tensor name → tensor (.shape: the reader's reversed shape)

    def meta(self, key: str, default: Any = ...) -> Any:
        """A metadata value; a ConfigError names a missing required key."""

    def values(self, name: str) -> np.ndarray:
        """A tensor's values, dequantized to float32."""


class ModelFamily(ABC):
    """One family of checkpoints the torch backend serves: its facts, its tensors, its model object."""

    name: str  # the family's name (ArchConfig.family)
    model_types: tuple[str, ...] = ()  # the HF config model_types it serves
    gguf_archs: tuple[str, ...] = ()  # the GGUF general.architecture values it serves (none: no GGUF support)
    generates: bool = True  # it has an LM head (False: an encoder that serves embeddings only)
    causal: bool = True  # False: attention within each whole prompt, no K/V kept (own_attention)

    @abstractmethod
    def arch(self, cfg: Any) -> ArchConfig:
        """The ArchConfig of a transformers config (or any object with its attributes); what it cannot run is a
        ConfigError naming the setting."""

    @abstractmethod
    def hf_shapes(self, arch: ArchConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the model loads, under its (normalized) HF name, with its shape in the checkpoint."""

    def normalize_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as hf_shapes lists it, or None for one the model does not use."""
        return name

    @abstractmethod
    def linear_weights(self, arch: ArchConfig) -> dict[str, bool]:
        """The 2-D weights that feed linears (the LM head included), each with whether it is stored [in, out]."""

    def quantized_tables(self, arch: ArchConfig) -> set[str]:
        """Embedding tables the model keeps in a quantized file's form (LinearMaker.embedding), read like linears."""
        return set()

    def head_weight(self, arch: ArchConfig) -> str | None:
        """The LM head's weight (the embedding table where tied), or None without a head."""
        return None

    @abstractmethod
    def build(self, arch: ArchConfig, sd: dict, make: Any, max_len: int, ops: str) -> Any:
        """The model object over a checked state dict (which it may empty as it goes: it owns sd): forward,
        prepare_step, final_hidden, logits, linears.

        make: models.common.LinearMaker; max_len: the longest context it must serve (RoPE tables); ops: the
        decoder_ops option (auto | torch | cpu | triton) for families whose elementwise steps have fused kernels.
        """

    def fused_stack(self, arch: ArchConfig) -> str | None:
        """None where the fused C decode stack (fused_stack.py, and with it decode-ahead) can run the model: it runs
        DecoderModel's layout only (RMSNorm, RoPE, SiLU·up); else why not."""
        return "its layers are not Llama-style (RMSNorm, RoPE, SiLU·up)"

    def default_pooling(self, source: str) -> str:
        """How embeddings pool by default (last | mean | cls), given the model's directory or file."""
        return "last"

    def own_attention(self, arch: ArchConfig) -> Any:
        """A non-causal family's attention (it keeps no K/V); causal families use the KV cache's kernels."""
        raise NotImplementedError(f"{self.name} attends through the KV cache")

    # --- GGUF (llama.cpp) files ---------------------------------------------------------------------------------

    def gguf_config(self, ckpt: GGUFView) -> tuple[str, dict[str, Any]]:
        """The HF model_type and config fields a file's metadata describes (the vocabulary size, BOS/EOS ids and dtype
        are added by the reader)."""
        raise ConfigError(f"{ckpt.path}: the {self.name} family reads no GGUF files")

    def gguf_names(self, arch_name: str) -> GGUFNames:
        """How the GGUF architecture's tensors map onto the HF names."""
        raise ConfigError(f"the {self.name} family reads no GGUF files")

    def gguf_convert(self, ckpt: GGUFView, gguf_name: str, w: Any) -> Any:
        """Undo what llama.cpp's converter did to a tensor beyond renaming it (w: a numpy array, or a QuantWeight,
        always [out, in]); as it is by default."""
        return w


@dataclass(slots=True)
class _Registry:
    by_name: dict[str, ModelFamily] = field(default_factory=dict)
    by_model_type: dict[str, ModelFamily] = field(default_factory=dict)
    by_gguf: dict[str, ModelFamily] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_family(family: ModelFamily, replace: bool = False) -> ModelFamily:
    """Make a family's model types and GGUF architectures loadable; one another family claims is an error unless
    replace=True (a plugin's family then serves them instead). Returns the family."""
    r = _REGISTRY
    if not replace:
        taken = [t for t in family.model_types if t in r.by_model_type and r.by_model_type[t] is not family]
        taken += [a for a in family.gguf_archs if a in r.by_gguf and r.by_gguf[a] is not family]
        if family.name in r.by_name and r.by_name[family.name] is not family:
            taken.append(f"the name {family.name!r}")
        if taken:
            raise ValueError(f"model family {family.name!r}: {', '.join(taken)} already registered "
                             "(pass replace=True to take them over)")
    r.by_name[family.name] = family
    r.by_model_type.update(dict.fromkeys(family.model_types, family))
    r.by_gguf.update(dict.fromkeys(family.gguf_archs, family))
    return family


def unregister_family(family: ModelFamily) -> None:
    """Remove a family added with register_family (what it took over from another stays unserved)."""
    r = _REGISTRY
    for table in (r.by_name, r.by_model_type, r.by_gguf):
        for key in [k for k, f in table.items() if f is family]:
            del table[key]


def model_types() -> list[str]:
    """Every HF model_type a registered family serves, sorted."""
    return sorted(_REGISTRY.by_model_type)


def gguf_archs() -> list[str]:
    """Every GGUF architecture a registered family reads, sorted."""
    return sorted(_REGISTRY.by_gguf)


def family_of(arch: ArchConfig) -> ModelFamily:
    """The registered family an ArchConfig came from."""
    try:
        return _REGISTRY.by_name[arch.family]
    except KeyError:
        raise ConfigError(f"model family {arch.family!r} is not registered with the torch backend") from None


def family_for_gguf(arch_name: str) -> ModelFamily | None:
    """The family that reads GGUF files of this general.architecture, or None."""
    return _REGISTRY.by_gguf.get(arch_name)


def arch_from_hf(cfg: Any) -> ArchConfig:
    """A transformers config as an ArchConfig, through the family of its model_type; an unknown type is a
    ConfigError listing the supported ones."""
    mt = getattr(cfg, "model_type", None)
    family = _REGISTRY.by_model_type.get(mt)
    if family is None:
        raise ConfigError(f"model type {mt!r} is not supported by the torch backend "
                          f"(supported: {', '.join(model_types())})")
    return family.arch(cfg)
