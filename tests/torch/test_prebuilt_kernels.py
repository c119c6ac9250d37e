"""A package build's prebuilt variants of the kernel library: the best one this CPU runs is loaded without a
compiler; one built from other sources never is."""

import json
import platform
import shutil

import pytest

from llmserve_torch import kernel_library

if platform.machine() != "x86_64" or shutil.which("g++") is None:
    pytest.skip("prebuilds x86-64 variants: needs an x86-64 host with g++", allow_module_level=True)

HAS_AVX2 = next(v for v in kernel_library.VARIANTS["x86_64"] if v.name == "avx2").needs <= kernel_library.cpu_features()


@pytest.fixture
def fresh(monkeypatch, tmp_path, x86_variants):
    """The library not loaded yet, no compiler, the prebuilt variants where a wheel puts them."""
    monkeypatch.setattr(kernel_library, "_lib", None)
    monkeypatch.setattr(kernel_library, "_error", None)
    monkeypatch.setattr(kernel_library, "PREBUILT", x86_variants)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("LLMSERVE_KERNEL_MARCH", raising=False)
    monkeypatch.delenv("LLMSERVE_KERNEL_VARIANT", raising=False)
    return monkeypatch


def test_without_a_compiler_the_best_prebuilt_variant_this_cpu_runs_is_loaded(fresh):
    d = kernel_library.describe()
    want = "avx2" if HAS_AVX2 else "x86-64"
    assert d["build"].startswith(f"prebuilt {want} "), d
    assert d["isa"] == ("avx2" if HAS_AVX2 else "scalar") and d["file"] == f"llmserve_kernels-{want}.so"
    # every entry point the header declares is there
    assert kernel_library.unavailable() is None


def test_a_cpu_without_avx2_gets_the_scalar_variant(fresh):
    fresh.setattr(kernel_library, "cpu_features", lambda: frozenset({"sse2", "avx"}))
    assert kernel_library.describe()["isa"] == "scalar"


def test_a_variant_can_be_asked_for_by_name(fresh):
    fresh.setenv("LLMSERVE_KERNEL_VARIANT", "x86-64")
    assert kernel_library.describe()["build"].startswith("prebuilt x86-64 ")


def test_variants_built_from_other_sources_are_never_loaded(fresh, x86_variants, tmp_path, caplog):
    stale = tmp_path / "stale"
    shutil.copytree(x86_variants, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    (stale / "manifest.json").write_text(json.dumps({**manifest, "sources": "0" * 16}))
    fresh.setattr(kernel_library, "PREBUILT", stale)
    d = kernel_library.describe()  # no compiler either: none at all, and /stats says what that costs
    assert "could not be built" in d["unavailable"] and "slower" in d["instead"]
    assert any(r.levelname == "WARNING" and "install a C++ compiler" in r.getMessage() for r in caplog.records)


def test_a_variant_the_compiler_refuses_is_warned_about_and_the_others_are_built(tmp_path, monkeypatch, caplog):
    """Every variant's sources compile side by side; one whose flags fail (an older compiler without -mamx-tile) is
    left out of the manifest with its error, and the rest still land. A stand-in compiler: the orchestration, not g++."""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\ncase "$*" in *-mamx-tile*) echo "unknown flag -mamx-tile" >&2; exit 1;; esac\n'
                   'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    out = tmp_path / "prebuilt"
    assert kernel_library.prebuild(out, names=("avx512-amx", "avx2", "x86-64")) == ["avx2", "x86-64"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["variants"] == {"avx2": "llmserve_kernels-avx2.so", "x86-64": "llmserve_kernels-x86-64.so"}
    assert (out / "llmserve_kernels-avx2.so").read_text() == "built\n"
    assert not (out / "llmserve_kernels-avx512-amx.so").exists()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "avx512-amx" in warned[0] and "unknown flag -mamx-tile" in warned[0], warned
