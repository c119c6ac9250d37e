"""Fixtures for the grpc and onnx backend tests: tiny checkpoints (built once), a worker process, the ONNX cache."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("onnxruntime")

from tests.server.tool_helpers import save_byte_tokenizer  # noqa: E402
from tests.torch.torch_helpers import make_gpt2, make_qwen2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def qwen2_chat(tmp_path_factory) -> Path:
    """A tiny Qwen2 with a byte-level tokenizer; weights large enough that greedy text varies."""
    d = tmp_path_factory.mktemp("qwen2chat")
    tok = save_byte_tokenizer(d)
    make_qwen2(seed=3, vocab_size=len(tok), initializer_range=0.2).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2 (no tokenizer: the tests send token ids)."""
    d = tmp_path_factory.mktemp("gpt2")
    make_gpt2(seed=2, initializer_range=0.2).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def onnx_env(tmp_path_factory) -> dict[str, str]:
    """Environment for one ONNX export cache per test session (the built CPU kernels stay where they are)."""
    from llmserve_torch import kernel_library

    return {"LLMSERVE_CACHE": str(tmp_path_factory.mktemp("llmserve-cache")),
            "LLMSERVE_CACHE_DIR": str(kernel_library.cache_dir())}


@pytest.fixture(scope="module")
def onnx_cache(onnx_env):
    """The session's ONNX cache for this module's in-process engines."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in onnx_env.items():
            mp.setenv(k, v)
        yield onnx_env


def start_worker(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`llmserve worker ARGS --port 0` in a subprocess; (process, its host:port) once it serves."""
    cmd = [sys.executable, "-m", "llmserve", "worker", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("llmserve worker: serving"):
            # its later log lines are read (and dropped) so a full pipe never stops it
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.rsplit(" on ", 1)[1].strip()
    proc.kill()
    raise RuntimeError("the worker did not start:\n" + "".join(lines[-30:]))
