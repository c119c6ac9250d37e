"""The CPU kernel library (csrc/): what it declares, how it is built, where the builds live, and loading it.

csrc/llmserve.h is the one statement of the library's interface; the ctypes signatures, struct layouts and limits
here are read from it (`api()`), never restated. A package build (setup.py) compiles the library for each of a few
CPU levels (`VARIANTS`, as ggml builds its CPU variants) into prebuilt/, so an installed wheel needs no compiler:
`load()` takes the best variant this CPU runs. Elsewhere (a source tree, another CPU, $LLMSERVE_KERNEL_MARCH set) it
is compiled once per source, compiler and CPU with the system's C++ compiler (-O3 -march=native) and cached on disk
(`cache_dir()`). Where neither can be had, `load()` raises and every caller runs torch's kernels instead, at a cost
the warning names.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llmserve.torch")

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "llmserve.h"
# one library (the longest to compile first: the sources compile side by side)
SOURCES = ("quant_matmul.cpp", "decode_layers.cpp", "paged_attention.cpp", "decoder_ops.cpp", "race.cpp",
           "gguf_unpack.cpp")


def _library_files() -> list[Path]:
    """The sources and headers a build is made of (the tests' drivers are not)."""
    return [f for f in sorted(CSRC.rglob("*")) if f.suffix in (".cpp", ".h") and f.relative_to(CSRC).parts[0] != "tests"]


# --- the interface, read from the header ---------------------------------------------------------------------------

_SCALARS = {"void": None, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
            "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int32_t": ctypes.c_int32,
            "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64}


@dataclass(frozen=True)
class Api:
    """The library's interface as csrc/llmserve.h declares it."""

    limits: dict[str, int]  # LLMSERVE_X → its value, as "X"
    structs: dict[str, type[ctypes.Structure]]  # llmserve_x → its ctypes layout, as "x"
    functions: dict[str, tuple]  # llmserve_f → (restype, argtypes)


def _ctype(decl: str, structs: dict):
    """The ctypes type of a C type (`const float*`, `struct llmserve_layer`, `int64_t`)."""
    t = re.sub(r"\b(const|struct)\b", " ", decl).strip()
    if t.endswith("*"):
        base = t.rstrip("* ").strip()
        return ctypes.c_char_p if base == "char" else ctypes.c_void_p
    if t.startswith("llmserve_"):
        return structs[t.removeprefix("llmserve_")]
    return _SCALARS[t]


def _split_decl(decl: str) -> tuple[str, str]:
    """`const float* scale` → (`const float*`, `scale`)."""
    m = re.fullmatch(r"(.*?[\s*])(\w+)", decl.strip())
    if m is None:
        raise ValueError(f"llmserve.h: cannot read the declaration {decl!r}")
    return m.group(1).strip(), m.group(2)


@functools.cache
def api() -> Api:
    """The header's limits, structs and functions (read once)."""
    text = re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.S)
    limits = {m.group(1): int(m.group(2), 0) for m in re.finditer(r"#define LLMSERVE_(\w+) (0x[0-9a-fA-F]+|\d+)", text)}
    structs: dict[str, type[ctypes.Structure]] = {}
    for m in re.finditer(r"struct llmserve_(\w+) \{(.*?)\};", text, flags=re.S):
        fields = [_split_decl(f) for f in m.group(2).split(";") if f.strip()]
        structs[m.group(1)] = type(m.group(1), (ctypes.Structure,),
                                   {"_fields_": [(name, _ctype(t, structs)) for t, name in fields]})
    functions = {}
    for m in re.finditer(r"LLMSERVE_API ([^;(]+?)\s*\b(llmserve_\w+)\((.*?)\);", text, flags=re.S):
        params = [] if m.group(3).strip() in ("", "void") else [_split_decl(p)[0] for p in m.group(3).split(",")]
        functions[m.group(2)] = (_ctype(m.group(1), structs), [_ctype(p, structs) for p in params])
    return Api(limits, structs, functions)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every function the header declares given its signature on `lib` (an AttributeError names one it lacks)."""
    for name, (restype, argtypes) in api().functions.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


# --- building ------------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where built kernels live: $LLMSERVE_CACHE_DIR, else kernels/ in llmserve's cache root, else the temp dir."""
    # imported here, not above: setup.py runs this module alone, where llmserve_torch cannot be imported
    from llmserve_torch.cache_paths import cache_root

    if os.environ.get("LLMSERVE_CACHE_DIR"):
        return Path(os.environ["LLMSERVE_CACHE_DIR"])
    base = cache_root() / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"llmserve-kernels-{os.getuid()}"


def cpu_id() -> str:
    """The CPU's model name and flags (what a -march=native build and a kernel measurement depend on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def cxx_flags(march: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The library's compiler flags for one target (`native` here; a variant's level; tests build other ISAs' paths)."""
    return ["-O3", f"-march={march}", *extra, "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


@dataclass(frozen=True)
class Variant:
    """A prebuilt build of the library for one CPU level: its -march (and extra flags), and the CPU features
    (/proc/cpuinfo's flags, or Features on ARM) a CPU needs to run it."""

    name: str
    march: str
    extra: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()


_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})  # x86-64-v3: Haswell, Zen 1, Alder Lake on
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4: Skylake-X on, Zen 4 on
# per machine architecture, best first: each level the kernels have a path for (AVX-512 tiles with VNNI and BF16 and
# AMX's for many rows, without AMX, without VNNI and BF16, AVX2 tiles with AVX-VNNI and without, scalar; NEON with and
# without the dot product)
_VNNI_BF16 = ("-mavx512vnni", "-mavx512bf16")
VARIANTS = {
    "x86_64": (Variant("avx512-amx", "x86-64-v4", (*_VNNI_BF16, "-mamx-tile", "-mamx-bf16"),
                       _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}),
               Variant("avx512-vnni-bf16", "x86-64-v4", _VNNI_BF16, _V4 | {"avx512_vnni", "avx512_bf16"}),
               Variant("avx512-vnni", "x86-64-v4", ("-mavx512vnni",), _V4 | {"avx512_vnni"}),
               Variant("avx512", "x86-64-v4", (), _V4),
               Variant("avx2-vnni", "x86-64-v3", ("-mavxvnni",), _V3 | {"avx_vnni"}),
               Variant("avx2", "x86-64-v3", (), _V3),
               Variant("x86-64", "x86-64")),
    "aarch64": (Variant("armv8.2-dotprod", "armv8.2-a+dotprod", (), frozenset({"asimddp"})),
                Variant("armv8", "armv8-a")),
}
PREBUILT = Path(__file__).with_name("prebuilt")
_MANIFEST = "manifest.json"


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them ("flags" on x86, "Features" on ARM; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for ln in text.splitlines():
        if ln.startswith(("flags", "Features")):
            return frozenset(ln.partition(":")[2].split())
    return frozenset()


def sources_hash() -> str:
    """What a build is made of: every source and header (a prebuilt library of other sources is never loaded)."""
    return hashlib.sha256(b"".join(f.read_bytes() for f in _library_files())).hexdigest()[:16]


def prebuild(out: Path, names: tuple[str, ...] | None = None) -> list[str]:
    """Compile every variant of this machine architecture (or those named) into `out` with a manifest of the sources
    they were built from (setup.py, at a package build); the variants built (none without a compiler: warned)."""
    cxx = os.environ.get("CXX", "g++")
    out.mkdir(parents=True, exist_ok=True)
    wanted = [v for v in VARIANTS.get(platform.machine(), ()) if names is None or v.name in names]
    builds = {out / f"llmserve_kernels-{v.name}.so": cxx_flags(v.march, v.extra) for v in wanted}
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        failed = compile_libraries(cxx, builds, Path(tmp))
    built = {}
    for v, so in zip(wanted, builds):
        if so in failed:
            log.warning("the %s variant of the CPU kernel library was not prebuilt: %s", v.name, failed[so])
        else:
            built[v.name] = so.name
    (out / _MANIFEST).write_text(json.dumps({"sources": sources_hash(), "variants": built}, indent=1))
    return list(built)


def _prebuilt() -> tuple[Path, str] | None:
    """The best prebuilt variant this CPU runs (or $LLMSERVE_KERNEL_VARIANT, where this CPU runs it), built from
    these sources (None: none)."""
    try:
        manifest = json.loads((PREBUILT / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("sources") != sources_hash():
        return None
    have, only = cpu_features(), os.environ.get("LLMSERVE_KERNEL_VARIANT")
    for v in VARIANTS.get(platform.machine(), ()):
        if v.name in manifest.get("variants", {}) and v.needs <= have and only in (None, v.name):
            return PREBUILT / manifest["variants"][v.name], f"prebuilt {v.name} (-march={v.march})"
    return None


def kernel_march() -> str:
    """The -march the library is built for: $LLMSERVE_KERNEL_MARCH (e.g. x86-64-v3, to run as an AVX2-only CPU
    would; benchmarks/vs_llama_cpp.py --avx2-only), else native."""
    return os.environ.get("LLMSERVE_KERNEL_MARCH") or "native"


def compile_library(cxx: str, flags: list[str], tmp: Path, out: Path) -> None:
    """One library from its sources (a RuntimeError with the compiler's error where it fails)."""
    failed = compile_libraries(cxx, {out: flags}, tmp)
    if failed:
        raise RuntimeError(failed[out])


def compile_libraries(cxx: str, builds: dict[Path, list[str]], tmp: Path) -> dict[Path, str]:
    """Each library `out` of `builds` from its flags, every source of every build side by side (one compiler a CPU,
    the longest sources first: the group kernel's formats take the longest, in every build), each moved into place
    atomically (concurrent builders never load a half-written file); those that failed, with the compiler's error."""
    jobs = sorted(((SOURCES.index(f), out, [cxx, *(x for x in flags if x != "-shared"), "-c", f"-I{CSRC}",
                                             str(CSRC / f), "-o", str(tmp / f"{i}-{Path(f).stem}.o")])
                   for i, (out, flags) in enumerate(builds.items()) for f in SOURCES), key=lambda j: j[0])

    def run(cmd: list[str]) -> str | None:
        try:
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cxx} could not run: {e}"
        return None if r.returncode == 0 else f"{cxx} failed: {r.stderr.strip()[-400:]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = list(pool.map(run, [cmd for _, _, cmd in jobs]))
    failed: dict[Path, str] = {}
    for (_, out, _), err in zip(jobs, errors):
        if err is not None:
            failed.setdefault(out, err)
    for i, (out, flags) in enumerate(builds.items()):
        if out in failed:
            continue
        objs = [cmd[-1] for _, o, cmd in jobs if o == out]
        tmp_so = tmp / f"{i}-{out.name}"
        err = run([cxx, *flags, *objs, "-o", str(tmp_so)])
        if err is not None:
            failed[out] = err
        else:
            os.replace(tmp_so, out)
    return failed


# --- loading -------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_build = ""  # how the loaded library was had (describe)
_error: str | None = None

# what runs where the library cannot be had, and what that costs (the one statement of it: the warning, /stats)
WITHOUT = ("torch's kernels run instead: decoding a quantized model is many times slower (the default model: 6x "
           "with bfloat16 activations, 35x with float32); install a C++ compiler (g++ or clang++, with OpenMP) and "
           "restart, or install llmserve from a wheel (it carries the library prebuilt)")


def _compiled() -> tuple[Path, str]:
    """This machine's own build (-march=native, or $LLMSERVE_KERNEL_MARCH), compiled once and cached."""
    cxx = os.environ.get("CXX", "g++")
    march = kernel_march()
    flags = cxx_flags(march)
    # -march=native: the binary is only valid on this kind of CPU, so the CPU is part of the key
    key = hashlib.sha256(" ".join([sources_hash(), cxx, *flags, sys.platform, cpu_id()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"llmserve_kernels_{key}.so"
    if not out.exists():
        # once per source/compiler/CPU: ten seconds or more of silence otherwise on a first start
        log.info("compiling the CPU kernels (csrc/*.cpp, %s -O3 -march=%s) into %s; once per machine", cxx, march,
                 out.parent)
        t0 = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            compile_library(cxx, flags, Path(tmp), out)
        log.info("compiled the CPU kernels in %.1fs", time.perf_counter() - t0)
    return out, f"compiled here ({cxx} -march={march})"


def load() -> ctypes.CDLL:
    """The library: the best prebuilt variant this CPU runs, else this machine's own build (compiled first where none
    is cached); a RuntimeError (the same one each call, warned about once) where neither can be had."""
    global _lib, _build, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        try:
            found = None if os.environ.get("LLMSERVE_KERNEL_MARCH") else _prebuilt()
            path, build = found or _compiled()
            _lib, _build = bind(ctypes.CDLL(str(path))), build
            if os.environ.get("LLMSERVE_AMX") == "0":  # int8 products for many decodes too (an A/B, a suspect)
                _lib.llmserve_quant_amx(0)
            if os.environ.get("LLMSERVE_FMA") == "0":  # many rows on AVX2's integer tiles, no panels (an A/B, a suspect)
                _lib.llmserve_quant_fma(0)
            return _lib
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _error = f"llmserve's CPU kernel library could not be built ({e})"
            log.warning("%s; %s", _error, WITHOUT)
            raise RuntimeError(_error) from None


def describe() -> dict:
    """For /stats: which build runs and on which SIMD path, or why none does and what that costs."""
    try:
        lib = load()
    except RuntimeError as e:
        return {"unavailable": str(e), "instead": WITHOUT}
    return {"build": _build, "isa": lib.llmserve_quant_isa().decode(), "file": Path(lib._name).name,
            "amx_rows": AMX_MIN_ROWS if amx(lib) else None,
            "fma_rows": FMA_MIN_ROWS if lib.llmserve_quant_fma(-1) == 1 else None}


AMX_MIN_ROWS = api().limits["AMX_MIN_ROWS"]  # the fewest decodes (a bf16 model's rows) in a step AMX runs
FMA_MIN_ROWS = api().limits["FMA_MIN_ROWS"]  # the fewest rows AVX2 without VNNI runs on panels (float32 or bytes)


def amx(lib: ctypes.CDLL) -> bool:
    """Whether a batch of many decodes (and a bf16 model's prompt) runs its quantized matmuls in bf16 on AMX tiles."""
    return lib.llmserve_quant_amx(-1) == 1


def int8_decode_rows(lib: ctypes.CDLL) -> int:
    """The fewest decodes in a step whose activations the group kernels round to int8 by default
    (backend.options.int8_decode_rows auto)."""
    # AVX2 without VNNI multiplies an int16 activation as two bytes in vpmaddubsw: twice int8's products, which bind
    # even one row (Zen 3, Qwen2.5-0.5B Q4_K_M: a one-decode step 1.07x faster on int8; served, SmolLM2 Q4_1 1.02-1.15x).
    # Elsewhere int16 keeps a lone request's answer as the dequantized weights give it, and 16 decodes are where
    # int8 ran 1.4-1.5x faster with AVX-512 (docs/configuration.md)
    return 1 if lib.llmserve_quant_isa() == b"avx2" else 16


def unavailable() -> str | None:
    """Why the library cannot be had (None where it loads)."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None


def library_id() -> str:
    """The built library's file name (it carries the hash of its sources, flags and CPU), or "none"."""
    try:
        return Path(load()._name).name
    except RuntimeError:
        return "none"
