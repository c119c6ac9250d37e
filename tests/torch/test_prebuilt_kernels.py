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
def prebuilt(x86_variants):
    """The avx2 and scalar x86-64 variants, built as setup.py builds a wheel's."""
    return x86_variants


@pytest.fixture
def fresh(monkeypatch, tmp_path, prebuilt):
    """The library not loaded yet, no compiler, the prebuilt variants where a wheel puts them."""
    monkeypatch.setattr(kernel_library, "_lib", None)
    monkeypatch.setattr(kernel_library, "_error", None)
    monkeypatch.setattr(kernel_library, "PREBUILT", prebuilt)
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


def test_variants_built_from_other_sources_are_never_loaded(fresh, prebuilt, tmp_path, caplog):
    stale = tmp_path / "stale"
    shutil.copytree(prebuilt, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    (stale / "manifest.json").write_text(json.dumps({**manifest, "sources": "0" * 16}))
    fresh.setattr(kernel_library, "PREBUILT", stale)
    d = kernel_library.describe()  # no compiler either: none at all, and /stats says what that costs
    assert "could not be built" in d["unavailable"] and "slower" in d["instead"]
    assert any(r.levelname == "WARNING" and "install a C++ compiler" in r.getMessage() for r in caplog.records)
