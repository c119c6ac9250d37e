"""`llmserve serve` as a real process: it serves, and on SIGTERM drains in-flight streams and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def start_serve(*settings: str, **popen: object) -> tuple[subprocess.Popen, str]:
    """`llmserve serve` on the fake backend (10 ms a step) as a process; wait until /health says ok."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    env.pop("LLMSERVE_API_KEY", None)
    args = [a for kv in ("backend.options.step_cost_s=0.01",) + settings for a in ("--set", kv)]
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--backend", "fake",
                             "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


ENGINE_CORES = pytest.mark.parametrize("core", ["thread", "process"])


def stream_in_background(url: str, prompt: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streaming completion read on a thread into a list of SSE lines; returns once its first line is in."""
    lines: list[str] = []
    first = threading.Event()

    def stream():
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(10), "no first chunk within 10 s"
    return t, lines


@ENGINE_CORES
def test_sigterm_drains_in_flight_streams_and_exits_zero(core):
    proc, url = start_serve("server.drain_timeout=20", f"server.engine_core={core}")
    try:
        t, lines = stream_in_background(url, "drain me", 300)
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


@ENGINE_CORES
def test_sigterm_under_load_answers_everyone_in_our_shape_and_exits_within_drain_timeout(core):
    drain = 1.5  # a float: it is not truncated to 1
    proc, url = start_serve(f"server.drain_timeout={drain}", "scheduler.max_num_seqs=2", f"server.engine_core={core}")
    answers: dict[str, object] = {}
    started = threading.Barrier(3)

    def stream(name: str, max_tokens: int):
        body = {"prompt": name, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            if r.status_code != 200:
                answers[name] = (r.status_code, json.loads(r.read()))
                return
            lines = [ln for ln in r.iter_lines() if ln]
            answers[name] = lines

    def whole(name: str):
        r = httpx.post(url + "/v1/completions", json={"prompt": name, "max_tokens": 3000, "ignore_eos": True},
                       timeout=30)
        answers[name] = (r.status_code, r.json())

    with httpx.Client(timeout=30) as kept:  # a kept-alive connection: its next request is refused in our shape
        assert kept.get(url + "/health").status_code == 200
        work = [threading.Thread(target=stream, args=("short", 40)), threading.Thread(target=stream, args=("long", 3000))]
        work += [threading.Thread(target=whole, args=(f"whole{i}",)) for i in range(2)]
        work += [threading.Thread(target=stream, args=(f"queued{i}", 3000)) for i in range(2)]
        for t in work:
            t.start()
            time.sleep(0.05)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        try:
            late = kept.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        except httpx.TransportError:
            pass  # the connection was closed first: refused all the same
        assert proc.wait(drain + 5) == 0, proc.stdout.read()
        took = time.monotonic() - t0
        for t in work:
            t.join(10)
    assert took < drain + 1, f"exit {took:.2f} s after SIGTERM"
    assert answers["short"][-1] == "data: [DONE]" and '"finish_reason":"length"' in answers["short"][-2]
    for name in ("long", "queued0", "queued1", "whole0", "whole1"):
        got = answers[name]
        if isinstance(got, tuple):  # not started: a 503 in our shape
            status, body = got
            assert status == 503 and set(body["error"]) == {"message", "type", "param", "code"}, (name, got)
        else:  # started: an error event, then [DONE]
            assert got[-1] == "data: [DONE]", (name, got[-3:])
            err = json.loads(got[-2].removeprefix("data: "))["error"]
            assert err["code"] == "engine_unavailable" and "shutting down" in err["message"], (name, err)
