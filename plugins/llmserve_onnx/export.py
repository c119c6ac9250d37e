"""Our torch model families (llmserve_torch.models) exported to ONNX with a KV-cache input and output, once per
checkpoint: a directory of the cache (llmserve_torch.cache_paths) holds decoder.onnx, head.onnx and the facts
the backend reports, written into a temporary directory and renamed into place.

decoder.onnx: input_ids int64 [T], positions int64 [T], past_k_<layer> / past_v_<layer> float32 [P, kv_size]
(the sequence's K/V of positions 0..P-1) → hidden float32 [T, hidden] (before the final norm) and new_k_<layer> /
new_v_<layer> float32 [T, kv_size] (the K/V of the T tokens, for the caller to keep). head.onnx: hidden [N, hidden]
→ float32 logits [N, vocab] (final norm and LM head), run only on the rows that need logits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.config import ModelConfig
from llmserve_torch.arch import ArchConfig
from llmserve_torch.cache_paths import cache_root
from llmserve_torch.fused import TorchOps
from llmserve_torch.loader import LoadedModel, load_model

log = logging.getLogger("llmserve.onnx")

FORMAT = 1  # bump when the export changes what it writes: caches of another format are made again
MARKER = "llmserve-onnx.json"  # written last: a directory without it is not a finished export
OPSET = 17


@dataclass(slots=True)
class Export:
    """A finished export: its directory and the model facts the backend reports without loading torch weights."""

    path: Path
    facts: dict  # the architecture (ArchConfig's fields), kv_size, the generation defaults, the source, ...

    @property
    def decoder(self) -> Path:
        return self.path / "decoder.onnx"

    @property
    def head(self) -> Path:
        return self.path / "head.onnx"


class _ExportOps(TorchOps):
    """TorchOps with RoPE written into its rows by slice assignment: the tracer drops TorchOps' copy_ into a view."""

    def rope(self, qk, heads, head_dim, cos, sin):
        """Rotate-half RoPE on the first `heads` heads of each row (qk [T, ...] updated)."""
        T, n, half = qk.shape[0], heads * head_dim, head_dim // 2
        x = qk[:, :n].reshape(T, heads, head_dim)
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        qk[:, :n] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(T, n)


class _ConcatAttention:
    """The attention seam for export: one sequence, its past K/V given as inputs, the new K/V collected as outputs."""

    def __init__(self, arch: ArchConfig, past: tuple[torch.Tensor, ...]):
        self.arch, self.past, self.new = arch, past, []

    def forward(self, layer: int, q, k, v):
        """Causal attention of the T new tokens over the P past ones and themselves (as SDPA with a mask)."""
        a = self.arch
        self.new += [k, v]
        keys, values = torch.cat([self.past[2 * layer], k]), torch.cat([self.past[2 * layer + 1], v])
        T, P = q.shape[0], self.past[2 * layer].shape[0]
        group = a.num_heads // a.num_kv_heads

        def heads(x, n):
            return x.reshape(-1, n, a.head_dim).transpose(0, 1)

        kh = heads(keys, a.num_kv_heads).repeat_interleave(group, 0)
        vh = heads(values, a.num_kv_heads).repeat_interleave(group, 0)
        mask = torch.arange(P + T).unsqueeze(0) <= torch.arange(T).unsqueeze(1) + P
        o = F.scaled_dot_product_attention(heads(q, a.num_heads), kh, vh, attn_mask=mask, scale=a.head_dim ** -0.5)
        return o.transpose(0, 1).reshape(T, a.q_size)


class _Decoder(torch.nn.Module):
    def __init__(self, loaded: LoadedModel):
        super().__init__()
        self.model, self.arch = loaded.model, loaded.arch

    def forward(self, input_ids, positions, *past):
        att = _ConcatAttention(self.arch, past)
        hidden = self.model.forward(input_ids, self.model.prepare_step(positions), att)
        return (hidden, *att.new)


class _Head(torch.nn.Module):
    def __init__(self, loaded: LoadedModel):
        super().__init__()
        self.model = loaded.model

    def forward(self, hidden):
        return self.model.logits(hidden)


def _names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kv}_{i}" for i in range(num_layers) for kv in "kv"]


def _write(loaded: LoadedModel, out: Path) -> None:
    """Trace both graphs (TorchScript exporter: torch.export would need onnxscript) into out."""
    a = loaded.arch
    if getattr(loaded.model, "ops", None) is not None:
        loaded.model.ops = _ExportOps()
    L = a.num_layers
    past = tuple(torch.zeros(2, a.kv_size) for _ in range(2 * L))
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(2, 5)
    past_names = _names(L, "past")
    dims = {"input_ids": {0: "tokens"}, "positions": {0: "tokens"}, "hidden": {0: "tokens"},
            **{n: {0: "past"} for n in past_names}, **{n: {0: "tokens"} for n in _names(L, "new")}}
    with torch.inference_mode(), warnings.catch_warnings():
        # the TorchScript exporter warns it is deprecated on every call; torch.export's needs onnxscript (not a
        # dependency) and a model written for it: this one traces our model code as it is
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(_Decoder(loaded), (ids, pos, *past), str(out / "decoder.onnx"),
                          input_names=["input_ids", "positions", *past_names],
                          output_names=["hidden", *_names(L, "new")], dynamic_axes=dims, opset_version=OPSET,
                          dynamo=False)
        torch.onnx.export(_Head(loaded), (torch.zeros(2, a.hidden_size),), str(out / "head.onnx"),
                          input_names=["hidden"], output_names=["logits"],
                          dynamic_axes={"hidden": {0: "rows"}, "logits": {0: "rows"}}, opset_version=OPSET,
                          dynamo=False)


def _key(mc: ModelConfig) -> str:
    """What names an export: the checkpoint's files (path, size, mtime), what changes the weights, the format."""
    p = Path(mc.model).expanduser()
    files = sorted(p.rglob("*")) if p.is_dir() else [p] if p.exists() else []
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    ident = {"model": mc.model, "files": stats, "load_format": mc.load_format, "seed": mc.seed, "format": FORMAT,
             "max_model_len": mc.max_model_len, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def exported(mc: ModelConfig) -> Export:
    """The checkpoint's export from the cache, made first where missing (float32 weights, as the CPU runs them)."""
    d = cache_root() / "onnx" / _key(mc)
    try:
        return Export(d, json.loads((d / MARKER).read_text()))
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    # float32, unquantized, plain torch ops: what the exporter can trace, and onnxruntime's CPU kernels run
    loaded = load_model(replace(mc, dtype="float32", device="cpu", quantization="none"), linear="torch", ops="torch")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}-"))
    try:
        _write(loaded, tmp)
        g = loaded.generation
        facts = {"source": loaded.source, "weights": loaded.weights, "tokenizer_dir": loaded.tokenizer_dir,
                 "arch": asdict(loaded.arch), "kv_size": loaded.arch.kv_size,
                 "context_bound": loaded.arch.context_bound, "eos_token_ids": sorted(g.eos_token_ids),
                 "generation_defaults": g.sampling, "generation_defaults_source": g.source, "format": FORMAT,
                 "opset": OPSET, "torch": torch.__version__, "export_seconds": round(time.perf_counter() - t0, 3)}
        (tmp / MARKER).write_text(json.dumps(facts, indent=1, default=str))
        try:
            os.replace(tmp, d)
        except OSError:  # another process finished the same export first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s to ONNX in %.1f s: %s", loaded.source, time.perf_counter() - t0, d)
    return Export(d, json.loads((d / MARKER).read_text()))
