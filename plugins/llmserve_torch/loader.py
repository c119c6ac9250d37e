"""Find a model through its source (sources.py), check its tensors, build it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmserve.config import ModelConfig
from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig
from llmserve_torch.generation_config import GenerationDefaults
from llmserve_torch.kernel_plan import KernelPlan, plan_kernels
from llmserve_torch.model_cards import with_card
from llmserve_torch.models.common import LinearMaker, choose_packing
from llmserve_torch.models.family import family_of
from llmserve_torch.quant import GROUP, MODES, QuantLinear, QuantWeight, to_kind
from llmserve_torch.sources import find_source

log = logging.getLogger("llmserve.torch")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A built model and the facts the backend reports about it."""

    model: Any  # what the family's build() made: DecoderModel, GPT2Model, BertModel, ...
    arch: ArchConfig
    dtype: torch.dtype
    dtype_reason: str  # "asked for", or why dtype auto chose it
    device: torch.device
    source: str  # the directory, "embedded", or the hub id and where it was cached
    weights: str  # the files read, or "dummy (seed N)"
    linear: str = "torch"  # how the matmuls run: onednn (pre-packed) or torch (F.linear)
    tokenizer_dir: str | None = None  # tokenizer files the model source produced (a GGUF's cache directory)
    kernels: KernelPlan | None = None  # the quantized linears' kernel choices (empty: no quantized linears)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # EOS ids, sampling defaults


def resolve_device(name: str) -> torch.device:
    """cpu | cuda | cuda:N | auto → a torch.device, with a clear error when CUDA is missing."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {name!r} was asked for but this torch build sees no CUDA device "
                          f"(torch {torch.__version__}); use device: cpu")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """float32 | bfloat16 | float16 | auto (what the hardware runs fast; also None, the default) → the dtype, and
    why."""
    if name is None or name == "auto":
        name, why = auto_dtype(device)
        return _DTYPES[name], f"auto: {why}"
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype: must be float32, bfloat16, float16 or auto, got {name!r}")
    return _DTYPES[name], "asked for"


def auto_dtype(device: torch.device) -> tuple[str, str]:
    """bfloat16 where the hardware computes it natively, else float32; with the reason in words."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU computes bf16 natively"
        return "float32", "this GPU has no bf16"
    # without AVX512_BF16 or AMX, oneDNN emulates bf16: a GEMM ran 3x slower than fp32 on such a Xeon
    if torch.cpu._is_avx512_bf16_supported():
        return "bfloat16", "the CPU has AVX512_BF16"
    if torch.cpu._is_amx_tile_supported():
        return "bfloat16", "the CPU has AMX"
    return "float32", "the CPU has neither AVX512_BF16 nor AMX, so bf16 would be emulated (slower than fp32)"


def build_model(arch: ArchConfig, sd: dict, make: LinearMaker, max_len: int, ops: str = "auto"):
    """Instantiate the family's model, checking that every tensor it needs is present with the right shape."""
    fam = family_of(arch)
    expected = fam.hf_shapes(arch)
    missing = [n for n in expected if n not in sd]
    if missing:
        raise ConfigError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    stored_in_out = fam.linear_weights(arch)
    for n, shape in expected.items():
        got = tuple(sd[n].shape)
        if isinstance(sd[n], QuantWeight) and stored_in_out.get(n):
            got = got[::-1]  # a QuantWeight is [out, in] whatever the checkpoint's layout
        if got != shape:
            raise ConfigError(f"checkpoint tensor {n} has shape {got}, the config implies {shape}")
    return fam.build(arch, sd, make, max_len, ops)


def apply_quantization(sd: dict, mode: str, arch: ArchConfig) -> dict:
    """model.quantization applied to a state dict whose tensors may already be QuantWeights (from a GGUF).

    auto keeps every tensor as the source gave it; none dequantizes; int8 / int4 round the linears to
    nearest (int4 keeps the LM head at int8, as llama.cpp's Q4 files keep their output tensor finer).
    Tensors that feed no linear (norms, embedding tables) are floats, except with auto the tables the model keeps
    quantized (a GGUF's embedding: ModelFamily.quantized_tables).
    """
    if mode not in MODES:
        raise ConfigError(f"model.quantization: must be one of {', '.join(MODES)}, got {mode!r}")
    fam = family_of(arch)
    linears, head = fam.linear_weights(arch), fam.head_weight(arch)
    kept = fam.quantized_tables(arch) if mode == "auto" else set()
    out = {}
    for name, t in sd.items():
        transposed = linears.get(name)
        if (transposed is None and name not in kept) or mode == "none":
            if isinstance(t, QuantWeight):
                t = t.dequantize().t() if transposed else t.dequantize()
        elif mode != "auto":
            w = t if isinstance(t, QuantWeight) else (t.t() if transposed else t)
            kind = "int8" if mode == "int8" or name == head or w.shape[1] % GROUP else "int4"
            t = to_kind(w, kind)
        out[name] = t
    return out


def load_model(mc: ModelConfig, linear: str = "auto", batch_hint: int = 64, max_batch_rows: int = 512,
               quant_rows: int | str = "auto", ops: str = "auto", dense_copies: str = "auto") -> LoadedModel:
    """Everything from ModelConfig to a ready model: find, read config, read or invent weights, cast, place.

    linear: auto | torch | onednn (pre-pack weights for oneDNN on CPU); batch_hint: typical rows per GEMM;
    max_batch_rows: the most rows a step hands a linear; quant_rows: auto (measure, or recall a plan measured
    earlier), retime (measure afresh) or the most rows a quantized kernel runs before a dense copy takes over;
    ops: auto | torch | cpu (fused decoder ops); dense_copies: auto (where the plan measures them faster) | off
    (none for a weight our kernels run at any row count, unless quant_rows asks for them: memory first).
    """
    device = resolve_device(mc.device)
    if mc.threads is not None:
        if mc.threads < 1:
            raise ConfigError(f"model.threads: must be >= 1, got {mc.threads}")
        torch.set_num_threads(mc.threads)
    src = find_source(mc.model).load(mc)
    arch = src.arch
    dtype, dtype_reason = resolve_dtype(mc.dtype, device)
    # the longest context the model is built for (RoPE tables; where positions are learned, the backend refuses more)
    max_len = max(arch.max_position_embeddings, mc.max_model_len or 0)
    try:
        pack = choose_packing(linear, device, dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sd = apply_quantization(src.state_dict, mc.quantization, arch)
    src.state_dict = {}  # sd holds them now: the model frees each layer's weights as it makes them
    make = LinearMaker(dtype, device, pack, batch_hint, KernelPlan(), packed=src.packed,
                       # (a quant_rows other than auto asks for the dense copies it times or runs past its limit)
                       group_dense_copies=dense_copies == "auto" or quant_rows != "auto")
    make.name(sd)
    t0 = time.perf_counter()
    try:
        model = build_model(arch, sd, make, max_len, ops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    del sd
    t1 = time.perf_counter()
    src.finish()  # (what the source ran beside the build: a GGUF's first tokenizer export)
    log.debug("model built in %.2fs; waited %.2fs for the source's background work", t1 - t0, time.perf_counter() - t1)
    if src.packed is not None and not src.packed.entries:  # a first start: the next one reads these back
        src.packed.save(make.made, background=True)
    quant = [lin for lin in model.linears() if isinstance(lin, QuantLinear)]
    if quant:
        plan_kernels(make.plan, quant, dtype, max_batch_rows, quant_rows, model=src.source, defer=quant_rows == "auto")
    log.info("loaded %s (%s) %s (%s) on %s: %s", src.source, arch.model_type, str(dtype).replace("torch.", ""),
             dtype_reason, device, src.weights)
    return LoadedModel(model=model, arch=arch, dtype=dtype, dtype_reason=dtype_reason, device=device,
                       source=src.source, weights=src.weights, linear="onednn" if pack else "torch",
                       tokenizer_dir=src.tokenizer_dir, kernels=make.plan,
                       generation=with_card(src.generation, src.names))
