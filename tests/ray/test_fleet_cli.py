"""`llmserve serve --replicas 2` as a command: it serves, and SIGTERM lets an in-flight stream finish, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'llmserve[ray]')")

from tests.server.conftest import free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_replicas_and_exits_0():
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--replicas", "2", "--backend", "fake",
           "--model", "embedded", "--port", str(port), "--set", "distributed.num_cpus=0",
           "--set", "server.drain_timeout=20", "--set", "backend.options.step_cost_s=0.01"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=120)
        body = {"model": "embedded", "prompt": "drain me", "max_tokens": 200, "stream": True, "ignore_eos": True}
        tokens, last = 0, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if tokens == 0:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: ~2 s of steps are still to come
                if line == "data: [DONE]":
                    break
                last = json.loads(line[6:])
                tokens += 1
        assert last is not None and last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
