"""A real uvicorn server on 127.0.0.1 (random free port) in a background thread, one per test module."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.server import create_app
from llmserve.server.transport import uvicorn_config

# the fake backend with the byte tokenizer: deterministic and instant
FAKE = {"backend": {"name": "fake"}, "model": {"model": "embedded", "max_model_len": 512},
        "cache": {"num_blocks": 256, "block_size": 16}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout: float = 60) -> None:
    """Poll a server process's /health until 200; fail with its output if it exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, (proc.stdout or proc.stderr).read()
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


@dataclass
class LiveServer:
    """A running server: its base URL, app, engine and uvicorn handle."""

    url: str
    app: Any
    engine: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.llm

    def client(self, **kw):
        """An openai SDK client for this server (no retries, so each error surfaces once)."""
        import openai

        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 30)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """Poll /stats until nothing runs or waits and every KV block is free; return the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            c = s["cache"]
            idle = s["running"] == 0 and s["waiting"] == 0 and s["server"]["active_requests"] == 0
            if idle and c["used_blocks"] == 0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(config: dict, extra_plugins: list | None = None, build_engine: bool = True,
                 client: Any = None) -> LiveServer:
    """Build the engine (or let the app build it, or serve `client`, an EngineClient), start uvicorn in a thread,
    wait until it listens."""
    cfg = config_from_dict(config, source="<test>")
    engine = Engine.from_config(cfg, extra_plugins=extra_plugins) if build_engine and client is None else None
    app = create_app(cfg, client or engine)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, cfg.server, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    t = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, engine, server, t)


def start_default_server() -> LiveServer:
    """configs/default.yaml as `make serve` serves it (on a free port), returned once its model has loaded."""
    from pathlib import Path

    from llmserve.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.yaml").to_dict()
    cfg["server"]["port"] = 0
    s = start_server(cfg, build_engine=False)
    deadline = time.monotonic() + 600  # a first start dequantizes the GGUF once
    while (h := httpx.get(s.url + "/health")).status_code != 200:
        assert h.json().get("status") == "loading", h.text
        assert time.monotonic() < deadline, "the default model did not load in 10 minutes"
        time.sleep(0.5)
    return s


@pytest.fixture(scope="module")
def fake_server():
    """The default test server: fake backend, byte tokenizer."""
    s = start_server(FAKE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A server on a tiny random Qwen2 with the tools template (tool_helpers.start_tiny_qwen), one per module."""
    pytest.importorskip("torch")
    from tests.server.tool_helpers import start_tiny_qwen

    s = start_tiny_qwen(tmp_path_factory.mktemp("qwen"))
    yield s
    s.stop()
