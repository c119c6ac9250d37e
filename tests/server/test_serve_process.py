"""`llmserve serve` as a real process: it serves, and on SIGTERM drains in-flight streams and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_in_flight_streams_and_exits_zero():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    env.pop("LLMSERVE_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--backend", "fake",
         "--port", str(port), "--set", "backend.options.step_cost_s=0.01", "--set", "server.drain_timeout=20"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)

        lines: list[str] = []
        first = threading.Event()

        def stream():
            body = {"prompt": "drain me", "max_tokens": 300, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)  # about 3 s of generation is still ahead
        time.sleep(0.3)
        try:  # no longer admitting: the listener is closed (or, on a kept-alive connection, 503)
            late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=2)
            status = late.status_code
        except httpx.TransportError:
            status = "refused"
        assert status in (503, "refused")
        assert t.is_alive()  # the stream is still running
        t.join(30)
        assert proc.wait(30) == 0, proc.stdout.read()
        # the stream ran to its end: every token, the finish reason, then [DONE]
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in lines[-2]
        # and the port is closed now
        try:
            httpx.get(url + "/health", timeout=1)
            raise AssertionError("the server still answers after exiting")
        except httpx.TransportError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
