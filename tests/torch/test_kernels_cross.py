"""The kernel library beyond this machine's own build: cross-compiled for aarch64 twice (NEON alone, and with the dot
product), its group-quantized matmul run under qemu-user against the dequantized reference in every format
(correctness only: nothing here says how fast the NEON paths run), and built with clang++ and without OpenMP (Apple
clang has none). Each builds the library from csrc/ (~10-20 s on 2 cores).

The tools (g++-aarch64-linux-gnu, qemu-user-static, clang, libomp-dev) come from Debian: `make test` apt-installs
them when missing and running as root (its `cross` target). Without them these tests fail under CI (CI=true), where
a silent skip would hide that the other builds went untested, and skip elsewhere."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_quant import _as_packed, _group_weights, _rounding_bound

from llmserve_torch import quant
from llmserve_torch.kernel_library import SOURCES, api, compile_library, cxx_flags

CSRC = Path(quant.__file__).with_name("csrc")
DRIVER = CSRC / "tests" / "quant_driver.cpp"
# The aarch64 builds and the path each must report (llmserve_quant_isa): NEON alone (any ARMv8-A core: vmull/vmlal
# on the values widened to int16), and with the dot product (ARMv8.2 cores such as Neoverse N1, Apple M1, Graviton 2:
# vdotq_s32 on each activation's two bytes). qemu runs both with -cpu max (every instruction it emulates)
ARM_BUILDS = {"armv8-a": "neon", "armv8.2-a+dotprod": "neon-dotprod"}
# distinct formats (quant_matmul.cpp's with_format) among _group_weights' weights, at the least: a check that the
# cases do not collapse into a few (12 when written: each GGUF type's and those fused rows meet in)
FORMATS = 10


def _unavailable(why: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the cross builds cannot be tested: {why}", pytrace=False)
    pytest.skip(why)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}"
    return r


def _bind(so: Path) -> ctypes.CDLL:
    """A kernel library loaded with the signatures llmserve.h declares (those it has: a part of it may be built)."""
    lib = ctypes.CDLL(str(so))
    for name, (restype, argtypes) in api().functions.items():
        if hasattr(lib, name):
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def _bound(x: torch.Tensor, held) -> torch.Tensor:
    """test_quant's bound for a build on another ISA: the activations' rounding, plus float32 sums in another order."""
    return _rounding_bound(x, held) + 2e-5 * (x.abs().sum(-1, keepdim=True) * held.dequantize().abs().amax())


def _run_all(cmds: list[list[str]]) -> list[str]:
    """Commands side by side, as many at once as there are CPUs (compiles, emulator runs); each must succeed. Their
    stdouts, in order."""
    running: list[tuple[list[str], subprocess.Popen]] = []
    outs: list[str] = []

    def finish(cmd, p):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}): {err.strip()[-2000:]}"
        outs.append(out)

    for cmd in cmds:
        if len(running) >= (os.cpu_count() or 1):
            finish(*running.pop(0))
        running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for cmd, p in running:
        finish(cmd, p)
    return outs


@pytest.mark.slow
def test_the_group_kernel_built_for_aarch64_matches_the_reference_under_qemu(tmp_path, monkeypatch):
    """Every group format at 1, 3 and 9 rows, packed for tile 1 as pack_own packs it for a build without AVX-512, run
    by quant_driver.cpp under qemu (one start a build for all of them), linked statically with the whole library built
    for aarch64 (every source, so an x86-only line anywhere fails the build): once for each of ARM_BUILDS, each
    reporting its own path (a build that fell back to the scalar loop would pass the reference, not this)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        _unavailable("needs aarch64-linux-gnu-g++ and qemu-aarch64(-static): apt-get install g++-aarch64-linux-gnu "
                     "qemu-user-static (make test does, as root)")
    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        pytest.skip("packs the weights with an x86-64 scalar build of the kernel: needs an x86-64 host with g++")
    # pack_own asks the group kernel built for plain x86-64 (its scalar path, rows in order: tile 1) for the layout
    packer_so = tmp_path / "quant_x86-64.so"
    sources = [CSRC / f for f in SOURCES] + [DRIVER]
    compiles = [["g++", *cxx_flags("x86-64"), f"-I{CSRC}", str(CSRC / "quant_matmul.cpp"), "-o", str(packer_so)]]
    links, drivers = [], {}
    for march in ARM_BUILDS:
        flags = [f for f in cxx_flags(march) if f not in ("-shared", "-fPIC")]
        build = tmp_path / march.replace("+", "_")
        build.mkdir()
        objs = [build / f"{f.stem}.o" for f in sources]
        compiles += [[cxx, *flags, "-c", f"-I{CSRC}", str(f), "-o", str(o)] for f, o in zip(sources, objs)]
        drivers[march] = build / "quant_driver"
        links.append([cxx, *flags, "-static", *map(str, objs), "-o", str(drivers[march])])
    _run_all(compiles)
    _run_all(links)
    packer = _bind(packer_so)
    assert packer.llmserve_quant_tile() == 1
    monkeypatch.setattr(quant, "_own_kernels", lambda: packer)

    cases, inputs = [], []
    for rows, n, k in [(1, 40, 512), (3, 37, 256), (9, 24, 768)]:
        x = torch.randn(rows, k)
        qws = {name: quant.kernel_form(qw) for name, qw in _group_weights(n, k, rows).items()}
        formats = {quant.weight_format(qw) for qw in qws.values()}
        assert None not in formats and len(formats) >= FORMATS, formats
        for name, qw in qws.items():
            fmt, packed = quant.weight_format(qw), quant.pack_own(qw).numpy().tobytes()
            assert len(packed) == packer.llmserve_quant_bytes(fmt, n, k), name
            src = tmp_path / f"{name}_{rows}.in"
            head = np.array([fmt, rows, n, k], np.int32).tobytes() + np.array([len(packed)], np.int64).tobytes()
            src.write_bytes(head + packed + x.numpy().astype(np.float32).tobytes())
            cases.append((name, x, qw))
            inputs.append(src)
    # both builds read the same inputs (one packing: rows in order), side by side
    outs = {march: [driver.parent / f"{src.stem}.out" for src in inputs] for march, driver in drivers.items()}
    ran = _run_all([[qemu, "-cpu", "max", str(driver), *[str(p) for pair in zip(inputs, outs[march]) for p in pair]]
                    for march, driver in drivers.items()])

    for (march, isa), stdout in zip(ARM_BUILDS.items(), ran):
        assert stdout.split() == [isa, "1"], (march, stdout)  # its NEON path, rows in order
        for (name, x, qw), out in zip(cases, outs[march]):
            rows, (n, _) = x.shape[0], qw.shape
            y = torch.from_numpy(np.fromfile(out, np.float32)).view(rows, n)
            held = _as_packed(qw)
            err = (y - F.linear(x, held.dequantize())).abs()
            assert (err <= _bound(x, held)).all(), (march, name, rows, err.max().item())


def _check_library(so: Path, threads: int) -> None:
    """A whole kernel library: it loads with every entry point, and its group kernel matches the reference on a
    Q4_K weight (4 bits with offsets) on `threads` threads."""
    lib = _bind(so)
    missing = [name for name in api().functions if not hasattr(lib, name)]
    assert not missing, missing
    n, k, rows = 48, 512, 5
    x = torch.randn(rows, k)
    # pack_own asks this library for its tile and format codes (16 with AVX-512, 8 with AVX2, else 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_own_kernels", lambda: lib)
        qw = quant.kernel_form(_group_weights(n, k, 0)["Q4_K"])
        fmt, packed = quant.weight_format(qw), quant.pack_own(qw)
    assert fmt is not None
    assert packed.numel() == lib.llmserve_quant_bytes(fmt, n, k)
    y = torch.full((rows, n), float("nan"))
    lib.llmserve_quant_matmul(fmt, x.data_ptr(), k, rows, packed.data_ptr(), y.data_ptr(), n, n, k, 4, 4, threads, 0)
    held = _as_packed(qw)
    err = (y - F.linear(x, held.dequantize())).abs()
    assert (err <= _bound(x, held)).all(), err.max().item()


@pytest.mark.slow
def test_the_library_builds_with_clang(tmp_path):
    """All five sources with clang++ and the library's own flags (OpenMP from libomp), as CXX=clang++ builds it."""
    if shutil.which("clang++") is None:
        _unavailable("needs clang++: apt-get install clang libomp-dev (make test does, as root)")
    probe = subprocess.run(["clang++", "-fopenmp", "-x", "c++", "-fsyntax-only", "-"], input="#include <omp.h>\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        _unavailable("clang++ has no OpenMP here: apt-get install libomp-dev (make test does, as root)")
    so = tmp_path / "kernels_clang.so"
    compile_library("clang++", cxx_flags("native"), tmp_path, so)
    _check_library(so, threads=2)


@pytest.mark.slow
def test_the_library_builds_and_runs_without_openmp(tmp_path):
    """All five sources without -fopenmp, with clang++ as Apple's (no OpenMP there), or g++ where clang++ is missing:
    no OpenMP symbol left to resolve, and a call asked for two threads runs on the calling thread (team.h's on_team)
    with the reference's results. At -O1 (a third of -O3's compile time): what is tested is the build, not its speed."""
    cxx = "clang++" if shutil.which("clang++") else "g++"
    if shutil.which(cxx) is None:
        _unavailable("needs clang++ (or g++): apt-get install clang (make test does, as root)")
    so = tmp_path / "kernels_no_openmp.so"
    flags = ["-O1" if f == "-O3" else f for f in cxx_flags("native") if f != "-fopenmp"]
    compile_library(cxx, flags, tmp_path, so)
    if shutil.which("nm") is not None:
        undefined = _run(["nm", "-D", "--undefined-only", str(so)]).stdout
        assert "omp_" not in undefined and "GOMP_" not in undefined, undefined
    _check_library(so, threads=2)
