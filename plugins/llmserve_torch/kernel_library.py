"""The CPU kernel library (csrc/): what it declares, how it is built, where the builds live, and loading it.

csrc/llmserve.h is the one statement of the library's interface; the ctypes signatures, struct layouts and limits
here are read from it (`api()`), never restated. The library is compiled once per source, compiler and CPU with the
system's C++ compiler (-O3 -march=native, or $LLMSERVE_KERNEL_MARCH) and cached on disk (`cache_dir()`); where it
cannot be built, `load()` raises and every caller runs torch's kernels instead, at a cost the warning names.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llmserve.torch")

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "llmserve.h"
# one library (the longest to compile first: the sources compile side by side)
SOURCES = ("quant_matmul.cpp", "decode_layers.cpp", "paged_attention.cpp", "decoder_ops.cpp", "race.cpp")

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
    from llmserve_torch.gguf_cache import cache_root  # the one rule for where llmserve caches things

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


def cxx_flags(march: str) -> list[str]:
    """The library's compiler flags for one target (`native` here; tests build other ISAs' paths too)."""
    return ["-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def kernel_march() -> str:
    """The -march the library is built for: $LLMSERVE_KERNEL_MARCH (e.g. x86-64-v3, to run as an AVX2-only CPU
    would; benchmarks/vs_llama_cpp.py --avx2-only), else native."""
    return os.environ.get("LLMSERVE_KERNEL_MARCH") or "native"


def compile_library(cxx: str, flags: list[str], tmp: Path, out: Path) -> None:
    """Each source into an object at once (one compiler a CPU: the group kernel's formats take the longest), then one
    library moved into place atomically (concurrent builders never load a half-written file)."""
    objs = [tmp / f"{Path(f).stem}.o" for f in SOURCES]
    compile_flags = [f for f in flags if f != "-shared"]
    procs, running = [], []
    for f, o in zip(SOURCES, objs):
        if len(running) >= (os.cpu_count() or 1):
            running.pop(0).wait(timeout=120)
        p = subprocess.Popen([cxx, *compile_flags, "-c", f"-I{CSRC}", str(CSRC / f), "-o", str(o)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        running.append(p)
    for p in procs:
        err = p.communicate(timeout=120)[1]
        if p.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {err.strip()[-400:]}")
    tmp_so = tmp / out.name
    r = subprocess.run([cxx, *flags, *map(str, objs), "-o", str(tmp_so)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-400:]}")
    os.replace(tmp_so, out)


# --- loading -------------------------------------------------------------------------------------------------------

def _library_files() -> list[Path]:
    """The sources and headers a build is made of (the tests' drivers are not)."""
    return [f for f in sorted(CSRC.rglob("*")) if f.suffix in (".cpp", ".h") and f.relative_to(CSRC).parts[0] != "tests"]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

# what runs where the library cannot be had, and what that costs (the one statement of it: the warning, /stats)
WITHOUT = ("torch's kernels run instead: decoding a quantized model is many times slower (35-100x measured on the "
           "default model); install a C++ compiler (g++ or clang++, with OpenMP) and restart")


def load() -> ctypes.CDLL:
    """The library, built first where no build for these sources, this compiler and this CPU is cached; a
    RuntimeError (the same one each call, warned about once) where it cannot be built or loaded."""
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        try:
            src = b"".join(f.read_bytes() for f in _library_files())
            cxx = os.environ.get("CXX", "g++")
            march = kernel_march()
            flags = cxx_flags(march)
            # -march=native: the binary is only valid on this kind of CPU, so the CPU is part of the key
            key = hashlib.sha256(src + " ".join([cxx, *flags, sys.platform, cpu_id()]).encode()).hexdigest()[:16]
            out = cache_dir() / f"llmserve_kernels_{key}.so"
            if not out.exists():
                # once per source/compiler/CPU: ten seconds or more of silence otherwise on a first start
                log.info("compiling the CPU kernels (csrc/*.cpp, %s -O3 -march=%s) into %s; once per machine",
                         cxx, march, out.parent)
                t0 = time.perf_counter()
                out.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                    compile_library(cxx, flags, Path(tmp), out)
                log.info("compiled the CPU kernels in %.1fs", time.perf_counter() - t0)
            _lib = bind(ctypes.CDLL(str(out)))
            return _lib
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _error = f"llmserve's CPU kernel library could not be built ({e})"
            log.warning("%s; %s", _error, WITHOUT)
            raise RuntimeError(_error) from None


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
