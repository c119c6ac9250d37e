#!/usr/bin/env python
"""llmserve against llama.cpp's llama-server on the same GGUF file, same token-id prompts, rounds alternated.

llama.cpp is built once from the sources vendored in the llama-cpp-python sdist (pinned below:
LLAMA_CPP_PYTHON) into the llmserve cache root, `<cache root>/llama.cpp/<version>/build/bin`, and
reused by later runs; `--llama-server PATH` uses an existing binary instead (no build).

Each (file, case) runs --rounds rounds; a round starts llmserve, warms it up, streams the case's
workload through it, stops it, then does the same with llama-server (one server at a time, so
noise from a shared machine hits both alike). Both get the same seeded token-id prompts (a fresh
seed per round), greedy, EOS ignored, and each run checks that every request produced its
max_tokens. The figures are client-side (TTFT, ITL between SSE events, TPOT, output tok/s).

    python benchmarks/vs_llama_cpp.py --build-only     # build llama.cpp into the cache (minutes)
    python benchmarks/vs_llama_cpp.py                  # every file and case, 2 rounds
    python benchmarks/vs_llama_cpp.py --files q4_1 --cases c1 --requests 4 --output-len 32 --rounds 1
    python benchmarks/vs_llama_cpp.py --llama-server ~/llama.cpp/build/bin/llama-server --json
    python benchmarks/vs_llama_cpp.py --files qwen2.5-0.5b:Q4_K_M qwen2.5-0.5b:Q8_0 --make-only
    python benchmarks/vs_llama_cpp.py --files llama-3.2-1b:Q4_K_M --cases c1 --avx2-only

SHAPE:QTYPE files (SHAPES: Qwen2.5 0.5B/1.5B/3B, Llama 3.2 1B/3B) are made as users' downloads are,
with random weights: a Hugging Face checkpoint in the real config (bf16, save_pretrained), the sdist's
convert_hf_to_gguf.py to F16, llama-quantize to QTYPE; the tokenizer is the default model's, its
vocabulary padded to the shape's with unused tokens. --avx2-only builds and runs llama.cpp without
AVX-512 (a second cached build) and llmserve with AVX2_ENV.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "plugins", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# the llama-cpp-python release whose vendored llama.cpp is built (the newest on PyPI when this was
# written; its CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098")
LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ["llama-server", "llama-perplexity", "llama-quantize"]


def log(msg: str) -> None:
    print(f"[vs_llama_cpp] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- building llama.cpp


def llama_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    from llmserve_torch.cache_paths import cache_root

    return cache_root() / "llama.cpp" / version


def vendored_commit(base: Path) -> str | None:
    """The llama.cpp commit the sdist vendors, from its CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@<sha>")."""
    for sdist in (base / "sdist").glob("llama_cpp_python-*.tar.gz"):
        with tarfile.open(sdist) as tf:
            top = tf.getnames()[0].split("/")[0]
            try:
                text = tf.extractfile(f"{top}/CHANGELOG.md").read().decode(errors="replace")
            except KeyError:
                return None
        section = text.split(f"## [{base.name}]", 1)[-1].split("\n## [", 1)[0]
        m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
        return m[1] if m else None
    return None


# the cmake flags of each build variant, built in <llama_dir>/<dir> and marked done by <llama_dir>/<marker>.
# "avx2" builds for an AVX2-only x86-64 CPU (x86-64-v3: AVX, AVX2, FMA, F16C, BMI2), what llmserve runs as with
# LLMSERVE_KERNEL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 (--avx2-only). With GGML_NATIVE=OFF llama.cpp enables
# no instruction set by itself (its GGML_AVX ... options then default to OFF), so each is named.
BUILDS: dict[str, tuple[str, str, list[str]]] = {
    "native": ("build", "BUILT", ["-DGGML_NATIVE=ON"]),
    "avx2": ("build-avx2", "BUILT-avx2",
             ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
              "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"]),
    # the native build's instruction sets less AMX, what "native" means on a CPU with AMX tiles: the pinned
    # llama.cpp's AMX matmul dies with SIGILL at its first tilezero (its tile configuration, built on the stack, is
    # not loaded on every thread; ggml-org/llama.cpp#26954), so llama-server would crash on the first decode
    "noamx": ("build-noamx", "BUILT-noamx",
              ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]),
}


def native_variant() -> str:
    """The build that runs as this CPU would natively: "noamx" where the CPU has AMX tiles (BUILDS says why)."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "native"
    return "noamx" if "amx_tile" in flags else "native"
# the llmserve server's environment under --avx2-only (recorded in the report's machine section)
# oneDNN (torch's bf16/fp32 GEMMs) picks its ISA itself and ignores ATEN_CPU_CAPABILITY: capped to AVX2 too
AVX2_ENV = {"LLMSERVE_KERNEL_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# what `--dtype auto` picks on a CPU without AVX512_BF16 (here it still sees the flag and would pick bf16)
AVX2_FLAGS = ["--dtype", "float32"]


def llama_source(version: str = LLAMA_CPP_PYTHON) -> Path:
    """<llama_dir>/src: the sdist's vendor/llama.cpp (downloaded with pip and extracted on the first call): the
    sources built here and convert_hf_to_gguf.py with its gguf-py."""
    base = llama_dir(version)
    src = base / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    base.mkdir(parents=True, exist_ok=True)
    sdist_dir = base / "sdist"
    sdist_dir.mkdir(exist_ok=True)
    sdists = list(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"downloading the llama-cpp-python {version} sdist (its vendored llama.cpp) with pip")
        # --no-binary for this package only: with :all: pip also builds the sdist's build
        # backend (scikit-build-core, hatchling, setuptools ...) from source to read its metadata
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={version}", "-d", str(sdist_dir)], check=True)
        sdists = list(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    log(f"extracting vendor/llama.cpp from {sdists[0].name}")
    tmp = base / ".extract"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdists[0]) as tf:
        prefix = tf.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        tf.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    (tmp / prefix).rename(src)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def build_llama_cpp(version: str = LLAMA_CPP_PYTHON, jobs: int | None = None, variant: str = "native") -> Path:
    """The directory holding the built binaries (llama-server ...), built on the first call per version and variant.

    Downloads the llama-cpp-python sdist with pip, extracts its vendor/llama.cpp and builds only
    TARGETS with cmake (Release, no curl, the variant's flags: BUILDS). A finished build is marked by
    its marker file; an interrupted one is resumed (cmake rebuilds only what is missing)."""
    base = llama_dir(version)
    dirname, marker_name, flags = BUILDS[variant]
    build = base / dirname
    bindir = build / "bin"
    marker = base / marker_name
    if marker.exists() and all((bindir / t).exists() for t in TARGETS):
        return bindir
    src = llama_source(version)
    jobs = jobs or os.cpu_count() or 1
    commit = vendored_commit(base) or "unknown"  # no .git in the sdist: tell cmake, so --version says it
    t0 = time.time()
    log(f"building llama.cpp {commit} ({', '.join(TARGETS)}; {variant}: {' '.join(flags)}) in {build} with "
        f"-j{jobs}; this takes minutes")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", f"-DLLAMA_BUILD_COMMIT={commit}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                    "--target", *TARGETS], check=True)
    took = time.time() - t0
    marker.write_text(json.dumps({"llama_cpp_python": version, "llama_cpp_commit": commit, "variant": variant,
                                  "cmake_flags": flags, "build_seconds": round(took), "jobs": jobs}) + "\n")
    log(f"llama.cpp built in {took:.0f} s")
    return bindir


def llama_version(server: Path) -> dict[str, Any]:
    """What the binary says of itself (`--version`), plus the build record when it is our cached build."""
    p = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    out = {"binary": str(server), "version": " ".join((p.stdout + p.stderr).split())}
    build = server.parent.parent  # <llama_dir>/<build dir>/bin/llama-server when it is one of ours
    marker = next((build.parent / m for d, m, _ in BUILDS.values() if build.name == d), None)
    if marker is not None and marker.exists():
        try:
            out.update(json.loads(marker.read_text()))
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------- the GGUF files


def derived_dir() -> Path:
    from llmserve_torch.cache_paths import cache_root

    return cache_root() / "llama.cpp" / "models"


def _atomic_write(dst: Path, write) -> Path:
    """write(tmp_path), then rename into dst: a killed run never leaves half a file under the real name."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _close(w) -> None:
    """What every GGUFWriter needs at the end: header, metadata, tensors, close."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_copy(src: Path, dst: Path, qtype: str = "F32") -> Path:
    """src with every tensor dequantized to float32 (qtype F32), or its 2-D tensors requantized to Q8_0 with gguf-py
    (1-D ones stay float32, as llama-quantize keeps them); the metadata copied as it is."""
    import gguf
    import numpy as np

    def write(tmp: Path) -> None:
        r = gguf.GGUFReader(src)
        arch = r.get_field("general.architecture").contents()
        w = gguf.GGUFWriter(str(tmp), arch)
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment", "general.file_type"):
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
        for t in r.tensors:
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if qtype == "Q8_0" and x.ndim == 2 and x.shape[-1] % 32 == 0:
                w.add_tensor(t.name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(t.name, x)
        _close(w)

    log(f"writing {dst.name} ({qtype}) from {src.name}")
    return _atomic_write(dst, write)


def make_q8_0(src: Path, quantize: Path | None) -> Path:
    """A Q8_0 file of the default model: its Q4_1 tensors dequantized to an F32 file, then llama-quantize'd to Q8_0
    (no --allow-requantize needed); gguf-py's Q8_0 when there is no llama-quantize binary."""
    stem = src.name.rsplit(".", 2)[0]  # SmolLM2-135M-Instruct
    dst = derived_dir() / f"{stem}.Q8_0.gguf"
    if dst.exists():
        return dst
    if quantize is None or not quantize.exists():
        return write_gguf_copy(src, dst, "Q8_0")
    f32 = derived_dir() / f"{stem}.F32.gguf"
    if not f32.exists():
        write_gguf_copy(src, f32, "F32")
    log(f"quantizing {f32.name} to Q8_0 with {quantize}")

    def write(tmp: Path) -> None:
        subprocess.run([str(quantize), str(f32), str(tmp), "Q8_0"], check=True, stdout=subprocess.DEVNULL)

    return _atomic_write(dst, write)


def make_random_gpt2(seed: int = 0) -> Path:
    """The GPT-2 124M shape (12 layers, 768 wide, 12 heads, 1024 positions, 50257 tokens) with random float32 weights,
    as llama.cpp's converter lays GPT-2 out (the head tied to token_embd), and a synthetic byte-level BPE vocabulary:
    the 256 byte symbols, 50000 two-symbol merges, <|endoftext|> (id 50256)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    dst = derived_dir() / f"gpt2-124m-random-seed{seed}.F32.gguf"
    if dst.exists():
        return dst
    n_vocab, n_ctx, n_embd, n_layer, n_head = 50257, 1024, 768, 12, 12
    byte_syms = list(bytes_to_unicode().values())
    merges = [f"{byte_syms[k // 256]} {byte_syms[k % 256]}" for k in range(n_vocab - 257)]
    tokens = byte_syms + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    types = [gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL]

    def write(tmp: Path) -> None:
        rng = np.random.default_rng(seed)
        randn = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02)  # noqa: E731
        w = gguf.GGUFWriter(str(tmp), "gpt2")
        w.add_name("gpt2-124m-random")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(4 * n_embd)
        w.add_block_count(n_layer)
        w.add_head_count(n_head)
        w.add_layer_norm_eps(1e-5)
        w.add_vocab_size(n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(n_vocab - 1)
        w.add_eos_token_id(n_vocab - 1)
        w.add_add_bos_token(False)
        ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
        # numpy shapes are [out, in] (GGUF lists them reversed)
        w.add_tensor("token_embd.weight", randn(n_vocab, n_embd))
        w.add_tensor("position_embd.weight", randn(n_ctx, n_embd))
        for i in range(n_layer):
            b = f"blk.{i}."
            for name, shape in (("attn_norm", None), ("attn_qkv", (3 * n_embd, n_embd)),
                                ("attn_output", (n_embd, n_embd)), ("ffn_norm", None),
                                ("ffn_up", (4 * n_embd, n_embd)), ("ffn_down", (n_embd, 4 * n_embd))):
                if shape is None:
                    w.add_tensor(b + name + ".weight", ones(n_embd))
                    w.add_tensor(b + name + ".bias", randn(n_embd))
                else:
                    w.add_tensor(b + name + ".weight", randn(*shape))
                    w.add_tensor(b + name + ".bias", randn(shape[0]))
        w.add_tensor("output_norm.weight", ones(n_embd))
        w.add_tensor("output_norm.bias", randn(n_embd))
        _close(w)

    log(f"writing {dst.name} (GPT-2 124M shape, random float32 weights, seed {seed})")
    return _atomic_write(dst, write)


@dataclass(frozen=True)
class Shape:
    """A model's shape as its transformers config.json gives it (ref: the Hugging Face repo it is copied from)."""
    arch: str  # transformers model_type: qwen2 or llama
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_position: int
    rope_theta: float
    rms_eps: float
    ref: str
    tied: bool = True
    head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None

    def params(self) -> int:
        hd = self.head_dim or self.hidden // self.heads
        attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads)
        bias = hd * (self.heads + 2 * self.kv_heads) if self.arch == "qwen2" else 0
        layer = attn + bias + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, 1e6, 1e-6, "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, 32768, 1e6, 1e-6, "Qwen/Qwen2.5-1.5B-Instruct"),
    "qwen2.5-3b": Shape("qwen2", 2048, 11008, 36, 16, 2, 151936, 32768, 1e6, 1e-6, "Qwen/Qwen2.5-3B-Instruct"),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, 131072, 500000.0, 1e-5,
                          "meta-llama/Llama-3.2-1B-Instruct", head_dim=64, rope_scaling=LLAMA3_ROPE),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, 131072, 500000.0, 1e-5,
                          "meta-llama/Llama-3.2-3B-Instruct", head_dim=128, rope_scaling=LLAMA3_ROPE),
}
# what convert_hf_to_gguf.py writes itself (--outtype); every other type is llama-quantize'd from its F16 output
CONVERTER_TYPES = ("F16", "BF16", "F32")
# llama-quantize's types that need no importance matrix
QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S",
          "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", *CONVERTER_TYPES)


def parse_shaped(name: str) -> tuple[str, str] | None:
    """(shape, qtype) of a SHAPE:QTYPE --files name (case-insensitive), None for any other name."""
    shape, sep, qtype = name.partition(":")
    if not sep or Path(name).expanduser().is_file():
        return None
    shape, qtype = shape.lower(), qtype.upper()
    if shape not in SHAPES or qtype not in QTYPES:
        raise SystemExit(f"--files {name!r}: SHAPE:QTYPE takes SHAPE from {', '.join(SHAPES)} and QTYPE from "
                         f"{', '.join(QTYPES)}")
    return shape, qtype


def shaped_tokenizer(dst: Path) -> tuple[str, int, int]:
    """The default model's tokenizer (SmolLM2's byte-level BPE, 49152 tokens, built by transformers from its GGUF
    metadata) saved into dst as Hugging Face files; its tokenizer.ggml.pre and BOS/EOS ids."""
    import gguf
    from transformers import AutoTokenizer

    from llmserve_torch.packaged import DEFAULT_MODEL, resolve

    src = resolve(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(dst))
    # a class name transformers 4.x (the converter's pin) and 5.x both read as "the tokenizer.json as it is"
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    pre = gguf.GGUFReader(src).get_field("tokenizer.ggml.pre").contents()
    return pre, tok.bos_token_id, tok.eos_token_id


def write_random_hf(shape_name: str, dst: Path, seed: int) -> str:
    """A Hugging Face checkpoint of the shape in dst: its config.json, random bfloat16 weights (normal, std 0.02;
    norms ones; Qwen2's q/k/v biases normal, std 0.02) written by save_pretrained, and shaped_tokenizer's files.
    Returns the tokenizer's tokenizer.ggml.pre."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SHAPES[shape_name]
    pre, bos, eos = shaped_tokenizer(dst)
    kw: dict[str, Any] = {"head_dim": s.head_dim} if s.head_dim else {}
    if s.rope_scaling:
        kw["rope_scaling"] = dict(s.rope_scaling)
    cfg = AutoConfig.for_model(
        s.arch, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
        max_position_embeddings=s.max_position, rope_theta=s.rope_theta, rms_norm_eps=s.rms_eps,
        tie_word_embeddings=s.tied, bos_token_id=bos, eos_token_id=eos, hidden_act="silu", initializer_range=0.02,
        **kw)
    # built on the meta device and given storage without transformers' own initialisation (which takes minutes for
    # a 3B shape); every parameter is then drawn here, from one seeded generator
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the head its own storage: tied again, saved once as the embedding
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(str(dst))
    got = sum(p.numel() for p in model.parameters())
    if got != s.params():
        raise RuntimeError(f"{shape_name}: {got} parameters, the table's shape says {s.params()}")
    return pre


# convert_hf_to_gguf.py run with one change: a tokenizer whose pre-tokenizer hash is not in its table (raising
# NotImplementedError) gets the tokenizer.ggml.pre of the GGUF the tokenizer came from. transformers 5 loads a
# tokenizer for config.json's model type (Qwen2Tokenizer for qwen2, with Qwen2's own pre-tokenizer regex), so the
# hash of SmolLM2's tokenizer in a Qwen2 directory is not smollm's; the vocabulary and merges it writes are the
# tokenizer's either way. argv: SRC PRE converter-args...
CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print(f"[vs_llama_cpp] the tokenizer's hash is not in the converter's table: tokenizer.ggml.pre = {pre!r}, "
              "as in the GGUF it came from", file=sys.stderr, flush=True)
        return pre
TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_env(src: Path) -> dict[str, str]:
    """The environment convert_hf_to_gguf.py runs in: its gguf-py and conversion package first, and sentencepiece
    (which it imports before it looks for a tokenizer.model) pip-installed into <llama_dir>/pydeps when this Python
    has none."""
    import importlib.util

    paths = [str(src / "gguf-py"), str(src)]
    if importlib.util.find_spec("sentencepiece") is None:
        deps = src.parent / "pydeps"
        if not any(deps.glob("sentencepiece*")):
            log(f"installing sentencepiece (a convert_hf_to_gguf.py requirement) into {deps} with pip")
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(deps),
                            "sentencepiece>=0.1.98,<0.3.0"], check=True, stdout=subprocess.DEVNULL)
        paths.append(str(deps))
    paths += [p for p in [os.environ.get("PYTHONPATH")] if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_quiet(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """cmd with its output (hundreds of lines per file from the converter and llama-quantize) in a temporary file:
    its own [vs_llama_cpp] lines shown, the rest only when it fails."""
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        p = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        out.seek(0)
        text = out.read()
    for line in text.splitlines():
        if line.startswith("[vs_llama_cpp]"):
            print(line, file=sys.stderr, flush=True)
    if p.returncode:
        raise RuntimeError(f"{Path(cmd[0]).name} ... exited with {p.returncode}:\n{text[-5000:]}")


def shaped_path(shape_name: str, qtype: str, seed: int = 0) -> Path:
    return derived_dir() / f"{shape_name}-random-seed{seed}.{qtype}.gguf"


def make_shaped(shape_name: str, qtypes: list[str], quantize: Path | None, seed: int = 0) -> dict[str, Path]:
    """GGUF files of a real model's shape (SHAPES) with random weights, made as users' downloads are: a Hugging Face
    checkpoint (write_random_hf) converted by the sdist's convert_hf_to_gguf.py to F16, then llama-quantize'd to each
    qtype (F16, BF16 and F32 come from the converter itself). Files already made are kept as they are; the checkpoint
    and the F16 file this call made only as a step are deleted at the end. The same seed gives the same weights in
    every file, made in one run or in several."""
    s = SHAPES[shape_name]
    out = {q: shaped_path(shape_name, q, seed) for q in qtypes}
    todo = [q for q in dict.fromkeys(qtypes) if not out[q].exists()]
    if not todo:
        return out
    quantized = [q for q in todo if q not in CONVERTER_TYPES]
    if quantized and (quantize is None or not quantize.exists()):
        raise SystemExit(f"{shape_name}: {', '.join(quantized)} needs llama-quantize ({quantize} does not exist)")
    n = s.params()
    # peak: the bf16 checkpoint and the F16 file at once, then the quantized files (Q8_0: 8.5 bits a weight)
    need = 4 * n + sum({"F32": 4, "F16": 2, "BF16": 2}.get(q, 1.1) * n for q in todo) + 1e9
    derived_dir().mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(derived_dir()).free
    if free < need:
        raise SystemExit(f"{shape_name}: making {', '.join(todo)} needs about {need / 1e9:.1f} GB free in "
                         f"{derived_dir()}, {free / 1e9:.1f} GB are")
    log(f"{shape_name} ({s.arch}, {n / 1e6:.0f}M parameters, as {s.ref}): making {', '.join(todo)} "
        f"(up to {need / 1e9:.1f} GB of disk on the way, {free / 1e9:.0f} GB free)")
    src = llama_source()
    env = converter_env(src)
    stem = shaped_path(shape_name, "X", seed).name.rsplit(".", 2)[0]
    hf = derived_dir() / f".{stem}.hf.{os.getpid()}"
    f16 = shaped_path(shape_name, "F16", seed)
    step_f16 = quantized and not f16.exists() and "F16" not in todo  # made only to be quantized
    converted = [q for q in todo if q in CONVERTER_TYPES] + (["F16"] if step_f16 else [])
    t0 = time.time()
    try:
        if converted:
            shutil.rmtree(hf, ignore_errors=True)
            hf.mkdir(parents=True)
            log(f"{shape_name}: random bf16 weights (seed {seed}) and the default model's tokenizer into {hf}")
            pre = write_random_hf(shape_name, hf, seed)
            log(f"{shape_name}: checkpoint written in {time.time() - t0:.0f} s")
        for q in converted:
            log(f"{shape_name}: convert_hf_to_gguf.py --outtype {q.lower()} -> {out.get(q, f16).name} "
                f"({time.time() - t0:.0f} s)")

            def convert(tmp: Path, q=q) -> None:
                run_quiet([sys.executable, "-c", CONVERT, str(src), pre, str(hf), "--outfile", str(tmp),
                           "--outtype", q.lower(), "--model-name", f"{shape_name}-random"], env)

            _atomic_write(out.get(q, f16), convert)
        shutil.rmtree(hf, ignore_errors=True)  # no longer needed: the disk it holds is free for the quantized files
        for q in quantized:
            log(f"{shape_name}: llama-quantize {f16.name} {q} -> {out[q].name} ({time.time() - t0:.0f} s)")

            def requant(tmp: Path, q=q) -> None:
                run_quiet([str(quantize), str(f16), str(tmp), q])

            _atomic_write(out[q], requant)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
        if step_f16:
            f16.unlink(missing_ok=True)
    log(f"{shape_name}: {', '.join(todo)} made in {time.time() - t0:.0f} s")
    return out


def resolve_file(name: str, quantize: Path | None) -> Path:
    from llmserve_torch.packaged import DEFAULT_MODEL, resolve

    if name == "q4_1":
        return resolve(DEFAULT_MODEL)
    if name == "q8_0":
        return make_q8_0(resolve(DEFAULT_MODEL), quantize)
    if name == "gpt2-f32":
        return make_random_gpt2()
    if shaped := parse_shaped(name):
        return make_shaped(shaped[0], [shaped[1]], quantize)[shaped[1]]
    p = Path(name).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p
    raise SystemExit(f"--files: {name!r} is neither one of {', '.join(FILES)}, nor SHAPE:QTYPE, nor a .gguf file")


def resolve_files(names: list[str], quantize: Path | None) -> list[tuple[str, Path]]:
    """(name, path) of each --files name; the SHAPE:QTYPE files of one shape made together (one checkpoint and one F16
    file for all their types)."""
    by_shape: dict[str, list[str]] = {}
    for name in names:
        if shaped := parse_shaped(name):
            by_shape.setdefault(shaped[0], []).append(shaped[1])
    made = {f"{shape}:{q}": path for shape, qtypes in by_shape.items()
            for q, path in make_shaped(shape, qtypes, quantize).items()}
    return [(name, made.get(name) or resolve_file(name, quantize)) for name in names]


def prepare_llmserve(path: Path) -> None:
    """Build the GGUF's tokenizer cache now, untimed: a first load (hashing the file, the tokenizer built by
    transformers) takes longer than a later start, which is what the figures are about."""
    try:
        from llmserve_torch.gguf_cache import cached_metadata
    except ImportError:
        return
    t0 = time.time()
    cached_metadata(path)
    if time.time() - t0 > 1:
        log(f"{path.name}: tokenizer cached by llmserve in {time.time() - t0:.0f} s")


FILES = {"q4_1": "the default model (SmolLM2-135M-Instruct) as packaged, Q4_1",
         "q8_0": "the default model's Q4_1 values in Q8_0 (dequantized to F32, then llama-quantize Q8_0)",
         "gpt2-f32": "the GPT-2 124M shape, random float32 weights"}
FILE_SHAPES = {"q4_1": "SmolLM2-135M-Instruct", "q8_0": "SmolLM2-135M-Instruct", "gpt2-f32": "gpt2-124m"}
SHAPED_HELP = (f"SHAPE:QTYPE (e.g. qwen2.5-0.5b:Q4_K_M): a real model's shape with random weights, made as users' "
               f"downloads are (a Hugging Face checkpoint, convert_hf_to_gguf.py to F16, llama-quantize QTYPE), with "
               f"the default model's tokenizer (its vocabulary padded to the shape's); SHAPE: "
               f"{', '.join(f'{k} ({v.ref})' for k, v in SHAPES.items())}; QTYPE: {', '.join(QTYPES)}")


# ---------------------------------------------------------------- cases and servers


@dataclass
class Case:
    name: str
    concurrency: int
    requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    what: str


CASES = {c.name: c for c in [
    Case("c1", 1, 16, (16, 128), (128, 128), "one client: decode latency"),
    Case("c8", 8, 64, (16, 128), (128, 128), "8 clients"),
    Case("c64", 64, 256, (16, 128), (128, 128), "64 clients: batched throughput"),
    Case("ttft", 1, 8, (960, 960), (32, 32), "960-token prompts, one client: prefill (TTFT)"),
]}
SYSTEMS = ("llmserve", "llama-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_context(case: Case) -> int:
    """Context per llama-server slot: the longest prompt + output + 1 (llama-server stops a sequence whose next
    token would fill the slot), rounded up to 256."""
    need = case.prompt_len[1] + case.output_len[1] + 1
    return -(-need // 256) * 256


class LlamaServer:
    """llama-server on FILE with one slot per client; its log in a temporary file, shown when it fails."""

    def __init__(self, binary: Path, gguf: Path, case: Case, threads: int, logdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "--parallel", str(case.concurrency), "-c", str(case.concurrency * slot_context(case)),
                    "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]
        self.logfile = logdir / f"llama-server-{self.port}.log"

    def __enter__(self) -> LlamaServer:
        import httpx

        self.log = open(self.logfile, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not become healthy within 300 s:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.logfile.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        _terminate(self.proc)
        self.log.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, a minute to exit, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LLMServe:
    """`llmserve serve` on FILE (this checkout's code and plugins), through llmserve_bench.serve.launch_server."""

    def __init__(self, gguf: Path, case: Case, threads: int, extra: list[str], env: dict[str, str] | None = None):
        self.flags = ["--model", str(gguf), "--quantization", "auto", "--dtype", "auto", "--threads", str(threads),
                      "--max-num-seqs", str(case.concurrency), *extra]
        self.env = env or {}  # set for the server process only (--avx2-only: AVX2_ENV)

    def __enter__(self) -> LLMServe:
        from llmserve_bench.serve import launch_server

        paths = [str(ROOT), str(ROOT / "plugins")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        self.proc, self.url = launch_server(self.flags, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths),
                                                             **self.env})
        return self

    def __exit__(self, *exc) -> None:
        _terminate(self.proc)


def client_args(concurrency: int, requests: int, prompt_len, output_len, seed: int, args) -> argparse.Namespace:
    """The namespace llmserve_bench.workload.make_workload and llmserve_bench.clients.run_http read."""
    return argparse.Namespace(requests=requests, prompt_len=list(prompt_len), output_len=list(output_len),
                              shared_prefix=0, workload_seed=seed, concurrency=concurrency, timeout=args.timeout,
                              client="raw", ignore_eos=True, json=args.json, no_progress=args.no_progress)


def measure(url: str, case: Case, vocab: int, seed: int, args) -> dict[str, Any]:
    """A warm-up, then the case's workload (seed) through the server at url: the summary and its checks."""
    from llmserve_bench.clients import run_client, run_http
    from llmserve_bench.report import summarize_results
    from llmserve_bench.serve import _server_facts
    from llmserve_bench.workload import make_workload

    model = _server_facts(url, None).get("model")
    warm = client_args(case.concurrency, max(2, min(case.concurrency, 8)), (16, 32), (8, 8), 1_000_000 + seed, args)
    res, _ = run_client(run_http(warm, url, make_workload(warm, vocab), model))
    if not all(r.ok for r in res):
        raise RuntimeError(f"the warm-up failed at {url}: {next(r.error for r in res if not r.ok)}")
    ca = client_args(case.concurrency, case.requests, case.prompt_len, case.output_len, seed, args)
    items = make_workload(ca, vocab)
    res, elapsed = run_client(run_http(ca, url, items, model))
    s = summarize_results(res, elapsed)
    ok = [r for r in res if r.ok]
    s["expected_tokens"] = sum(i.max_tokens for i in items)
    # every request must produce exactly its max_tokens (EOS ignored): without it the figures compare nothing
    s["tokens_ok"] = s["failed"] == 0 and s["output_tokens"] == s["expected_tokens"] and (
        case.output_len[0] != case.output_len[1] or all(r.output_tokens == case.output_len[0] for r in ok))
    # SSE events that carried text: fewer than tokens where a server holds back an incomplete UTF-8 character
    s["token_events"] = sum(len(r.itl) + 1 for r in ok)
    s["prompt_tokens"] = sum(len(i.prompt) for i in items)
    return s


def gguf_facts(path: Path, shape: str | None = None) -> dict[str, Any]:
    """The file, its shape (named by shape: SHAPE of a SHAPE:QTYPE file, FILE_SHAPES; else its general.name) and quant
    type (its general.file_type: the type llama-quantize was asked for; tensor_types: what each tensor got)."""
    import gguf

    from llmserve_torch.gguf_file import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    r = gguf.GGUFReader(path)
    arch = ck.arch_name

    def kv(key: str) -> Any:
        f = r.get_field(key)
        return f.contents() if f is not None else None

    ftype = kv("general.file_type")
    try:
        quant = re.sub(r"^(MOSTLY|ALL)_", "", gguf.LlamaFileType(ftype).name) if ftype is not None else None
    except ValueError:
        quant = f"file_type {ftype}"
    vocab = int(ck.tensors["token_embd.weight"].shape[-1])
    dims = {"layers": kv(f"{arch}.block_count"), "hidden": kv(f"{arch}.embedding_length"),
            "ffn": kv(f"{arch}.feed_forward_length"), "heads": kv(f"{arch}.attention.head_count"),
            "kv_heads": kv(f"{arch}.attention.head_count_kv") or kv(f"{arch}.attention.head_count"),
            "vocab": vocab, "params": sum(int(t.n_elements) for t in r.tensors)}
    return {"path": str(path), "arch": arch, "bytes": path.stat().st_size, "vocab_size": vocab,
            "shape": {"name": shape or kv("general.name") or path.name.split(".")[0], **dims}, "quant": quant,
            "tensor_types": dict(ck.type_counts())}


def run_case(name: str, gguf: Path, case: Case, server_bin: Path | None, args, logdir: Path) -> dict[str, Any]:
    shaped = parse_shaped(name)
    facts = gguf_facts(gguf, shaped[0] if shaped else FILE_SHAPES.get(name))
    vocab = facts["vocab_size"]
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    cmds: dict[str, Any] = {}
    for k in range(args.rounds):
        seed = args.seed + k  # a fresh seed per round, the same for both servers
        for system in args.systems:
            log(f"{name}/{case.name} round {k + 1}/{args.rounds}: {system}")
            if system == "llmserve":
                env = AVX2_ENV if args.avx2_only else {}
                srv = LLMServe(gguf, case, args.threads, [*(AVX2_FLAGS if args.avx2_only else []),
                                                          *args.llmserve_flag], env)
                cmds[system] = [f"{var}={val}" for var, val in env.items()] + ["llmserve", "serve", *srv.flags]
            else:
                srv = LlamaServer(server_bin, gguf, case, args.threads, logdir)
                cmds[system] = srv.cmd
            with srv:
                r = measure(srv.url, case, vocab, seed, args)
            r["round"], r["workload_seed"] = k, seed
            per[system].append(r)
            if not r["tokens_ok"]:
                log(f"WARNING {system}: {r['output_tokens']} output tokens of {r['expected_tokens']} expected, "
                    f"{r['failed']} failed {r['errors']}")
    out: dict[str, Any] = {"file": name, "case": case.name, "what": case.what, "gguf": facts,
                           "workload": {"concurrency": case.concurrency, "requests": case.requests,
                                        "prompt_len": list(case.prompt_len), "output_len": list(case.output_len),
                                        "seeds": [args.seed + k for k in range(args.rounds)], "greedy": True,
                                        "ignore_eos": True, "prompts": "token ids"},
                           "commands": cmds, "systems": {}}
    for system, rounds in per.items():
        out["systems"][system] = combine(rounds)
    if len(per) == 2:
        a, b = (out["systems"][s] for s in SYSTEMS)
        out["ratio"] = {k: (a[k] / b[k] if a[k] and b[k] else None) for k in ("tok_s", "ttft_p50_ms", "itl_p50_ms",
                                                                              "tpot_p50_ms")}
        out["ratio_per_round"] = [x["output_token_throughput"] / y["output_token_throughput"]
                                  if y["output_token_throughput"] else None
                                  for x, y in zip(per[SYSTEMS[0]], per[SYSTEMS[1]])]
    return out


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one system as one run: throughput over the summed time, percentiles of the rounds' medians
    (a median of medians: each round's p50 from its summary; the spread shows in per_round)."""
    import statistics

    elapsed = sum(r["elapsed_s"] for r in rounds)
    tokens = sum(r["output_tokens"] for r in rounds)
    med = lambda key, q: statistics.median(r["latency_ms"][key][q] for r in rounds  # noqa: E731
                                           if r["latency_ms"][key][q] is not None) if any(
        r["latency_ms"][key][q] is not None for r in rounds) else None
    return {
        "tok_s": tokens / elapsed if elapsed else 0.0,
        "ttft_p50_ms": med("ttft", "p50"), "itl_p50_ms": med("itl", "p50"), "tpot_p50_ms": med("tpot", "p50"),
        "ttft_p90_ms": med("ttft", "p90"), "itl_p90_ms": med("itl", "p90"),
        "completed": sum(r["completed"] for r in rounds), "failed": sum(r["failed"] for r in rounds),
        "output_tokens": tokens, "expected_tokens": sum(r["expected_tokens"] for r in rounds),
        "token_events": sum(r["token_events"] for r in rounds),
        "tokens_ok": all(r["tokens_ok"] for r in rounds),
        "per_round": [{"workload_seed": r["workload_seed"], "tok_s": r["output_token_throughput"],
                       "ttft_p50_ms": r["latency_ms"]["ttft"]["p50"], "itl_p50_ms": r["latency_ms"]["itl"]["p50"],
                       "elapsed_s": r["elapsed_s"], "errors": r["errors"]} for r in rounds],
    }


# ---------------------------------------------------------------- the machine and the report


def machine(threads: int, llama: dict[str, Any] | None, avx2_only: bool = False) -> dict[str, Any]:
    from importlib.metadata import version

    from llmserve_bench.report import machine_info

    info = machine_info()
    info["threads"] = threads
    info["torch"] = version("torch")
    info["llama_cpp"] = llama
    # --avx2-only: both run as on an AVX2-only CPU (x86-64-v3): llmserve's server with these variables, llama.cpp as
    # built with llama_cpp.cmake_flags (BUILDS["avx2"])
    info["avx2_only"] = avx2_only
    info["llmserve_env"] = dict(AVX2_ENV) if avx2_only else {}
    return info


def fmt(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def print_report(rep: dict[str, Any]) -> None:
    m = rep["machine"]
    flags = " ".join(m["flags"]) or "-"
    print(f"machine: {m.get('cpu', '?')}, {m['cpus']} cpus ({flags}), threads {m['threads']}, python {m['python']}, "
          f"torch {m['torch']}")
    if m.get("llama_cpp"):
        lc = m["llama_cpp"]
        ver = re.sub(r"^version:\s*", "", lc.get("version") or "?")
        print(f"llama.cpp: {ver}" + (f" (vendored by llama-cpp-python {lc['llama_cpp_python']})"
                                     if lc.get("llama_cpp_python") else "") + f"; {lc['binary']}"
              + (f"; cmake {' '.join(lc['cmake_flags'])}" if lc.get("cmake_flags") else ""))
    if m.get("avx2_only"):
        built = (m.get("llama_cpp") or {}).get("variant") == "avx2"
        print(f"avx2-only: llmserve with {' '.join(f'{k}={v}' for k, v in m['llmserve_env'].items())}; llama.cpp "
              + ("built for AVX2 (its cmake flags above)" if built else "as given (--llama-server)"))
    print(f"rounds {rep['rounds']} (alternated {' / '.join(rep['systems'])}), greedy, EOS ignored, token-id prompts")
    for c in rep["cases"]:
        w, g = c["workload"], c["gguf"]
        types = ", ".join(f"{k}×{v}" for k, v in sorted(g["tensor_types"].items()))
        sh = g["shape"]
        print(f"\n## {c['file']} / {c['case']}: {c['what']}")
        print(f"   {Path(g['path']).name}: shape {sh['name']} ({g['arch']}, {sh['layers']} layers, hidden "
              f"{sh['hidden']}, ffn {sh['ffn']}, heads {sh['heads']}/{sh['kv_heads']} kv, vocab {sh['vocab']}, "
              f"{sh['params'] / 1e6:.0f}M params), {g['quant']}, {g['bytes'] / 1e6:.0f} MB ({types})")
        print(f"   c={w['concurrency']}, {w['requests']} requests/round, prompt "
              f"{w['prompt_len'][0]}–{w['prompt_len'][1]}, output {w['output_len'][0]}–{w['output_len'][1]}, "
              f"seeds {w['seeds']}")
        print(f"   {'system':<16}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}{'TPOT p50':>10}  {'tokens':<18}")
        for s, d in c["systems"].items():
            tok = f"{d['output_tokens']}/{d['expected_tokens']}" + ("" if d["tokens_ok"] else " MISMATCH")
            print(f"   {s:<16}{fmt(d['tok_s']):>9}{fmt(d['ttft_p50_ms']):>10}{fmt(d['itl_p50_ms'], 2):>9}"
                  f"{fmt(d['tpot_p50_ms'], 2):>10}  {tok:<18}")
        if "ratio" in c:
            r = c["ratio"]
            print(f"   {'llmserve/llama':<16}{fmt(r['tok_s'], 3):>9}{fmt(r['ttft_p50_ms'], 3):>10}"
                  f"{fmt(r['itl_p50_ms'], 3):>9}{fmt(r['tpot_p50_ms'], 3):>10}  "
                  f"(tok/s per round: {', '.join(fmt(x, 3) for x in c['ratio_per_round'])})")
    print("\ntok/s: output tokens over the wall time of the runs; TTFT/ITL/TPOT p50 in ms (median over rounds); "
          "tok/s ratio > 1 and latency ratios < 1 favour llmserve")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp into the cache and stop")
    ap.add_argument("--make-only", action="store_true",
                    help="make the --files (building llama.cpp when one needs llama-quantize), print their paths and "
                         "stop")
    ap.add_argument("--avx2-only", action="store_true",
                    help="run both as on an AVX2-only CPU (x86-64-v3): llama.cpp built without AVX-512 (a second "
                         "cached build, " + " ".join(BUILDS["avx2"][2]) + "), llmserve's server with "
                         + " ".join(f"{k}={v}" for k, v in AVX2_ENV.items()))
    ap.add_argument("--llama-server", type=Path,
                    help="use this llama-server binary (no build); Q8_0 is made with the llama-quantize beside it, "
                         "else with gguf-py")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="build parallelism (default: cores)")
    ap.add_argument("--files", nargs="+", default=list(FILES),
                    help=f"GGUF files: {'; '.join(f'{k}: {v}' for k, v in FILES.items())}; {SHAPED_HELP}; or "
                         f"PATH.gguf (default: the first three); made files are kept in "
                         f"<cache root>/llama.cpp/models")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                    help="; ".join(f"{c.name}: c={c.concurrency}, {c.requests} requests, prompt "
                                   f"{c.prompt_len[0]}-{c.prompt_len[1]}, output {c.output_len[0]}"
                                   for c in CASES.values()) + " (default: all)")
    ap.add_argument("--requests", type=int, help="requests per round in every case (default: the case's)")
    ap.add_argument("--output-len", type=int, help="new tokens per request in every case (default: the case's)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case, servers alternated (default 2)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                    help="run one side only (debugging): no ratio")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both servers (default: cores)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed of round 0 (round k: seed + k)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-request client timeout (s)")
    ap.add_argument("--llmserve-flag", action="append", default=[], metavar="FLAG",
                    help="an extra `llmserve serve` flag, repeatable (e.g. --llmserve-flag=--quantization=none)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SHAPE:QTYPE names checked (before any build) and written one way: qwen2.5-0.5b:Q4_K_M
    args.files = [f"{sh[0]}:{sh[1]}" if (sh := parse_shaped(f)) else f for f in args.files]
    shaped = [sh for f in args.files if (sh := parse_shaped(f))]

    server_bin = quantize = None
    needs_llama = "llama-server" in args.systems and not args.make_only
    if needs_llama or args.build_only or "q8_0" in args.files or any(q not in CONVERTER_TYPES for _, q in shaped):
        if args.llama_server:
            server_bin = args.llama_server.expanduser().resolve()
            if not server_bin.is_file():
                raise SystemExit(f"--llama-server: no such file {server_bin}")
            quantize = server_bin.parent / "llama-quantize"
            if args.avx2_only:
                log(f"--avx2-only with --llama-server: {server_bin} runs as it was built")
        else:
            bindir = build_llama_cpp(jobs=args.jobs, variant="avx2" if args.avx2_only else native_variant())
            server_bin, quantize = bindir / "llama-server", bindir / "llama-quantize"
    if args.build_only:
        print(server_bin.parent)
        return 0
    if "llama-server" not in args.systems:
        server_bin = None

    files = resolve_files(args.files, quantize)
    if args.make_only:
        for name, path in files:
            print(f"{name}\t{path}")
        return 0
    if "llmserve" in args.systems:
        for _, path in files:
            prepare_llmserve(path)
    report: dict[str, Any] = {
        "benchmark": "vs_llama_cpp", "rounds": args.rounds, "systems": args.systems,
        "machine": machine(args.threads, llama_version(server_bin) if server_bin else None, args.avx2_only),
        "cases": []}
    ok = True
    with tempfile.TemporaryDirectory(prefix="vs_llama_cpp-") as logdir:
        for fname, path in files:
            for cname in args.cases:
                c = CASES[cname]
                case = Case(c.name, c.concurrency, args.requests or c.requests, c.prompt_len,
                            (args.output_len, args.output_len) if args.output_len else c.output_len, c.what)
                res = run_case(fname, path, case, server_bin, args, Path(logdir))
                ok &= all(d["tokens_ok"] for d in res["systems"].values())
                report["cases"].append(res)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
