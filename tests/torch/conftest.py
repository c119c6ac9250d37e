"""Fixtures for the torch backend tests: tiny HF models saved to temp dirs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
for p in (str(_ROOT), str(_ROOT / "plugins"), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch_helpers import make_gpt2, make_qwen2  # noqa: E402


def _saved(tmp_path_factory, name, model):
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 saved as one safetensors file; yields (dir, hf_model)."""
    return _saved(tmp_path_factory, "gpt2", make_gpt2())


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    """A tiny Qwen2 with untied embeddings; yields (dir, hf_model)."""
    return _saved(tmp_path_factory, "qwen2", make_qwen2())


@pytest.fixture(scope="session")
def qwen2_tied_dir(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings; yields (dir, hf_model)."""
    return _saved(tmp_path_factory, "qwen2tied", make_qwen2(seed=1, tie=True))


@pytest.fixture(scope="session")
def x86_variants(tmp_path_factory):
    """The avx2 and scalar x86-64 variants of the kernel library, built once as setup.py builds a wheel's (the
    prebuilt-variant tests load them; the SIMD-path tests run their group kernel)."""
    import platform
    import shutil

    from llmserve_torch import kernel_library

    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        pytest.skip("prebuilds x86-64 variants: needs an x86-64 host with g++")
    out = tmp_path_factory.mktemp("prebuilt")
    assert kernel_library.prebuild(out, names=("avx2", "x86-64")) == ["avx2", "x86-64"]
    return out
