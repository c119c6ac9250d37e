"""The page's routes without a browser: the files, server.ui, the API key and CORS rules, and /stats/stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.server import create_app
from tests.server.conftest import FAKE, free_port, start_server
from tests.ui.conftest import ROOT, frames


@pytest.fixture(scope="module")
def keyed_server():
    """The fake backend behind an API key, with one CORS origin allowed."""
    s = start_server(FAKE | {"server": {"api_key": "sesame", "cors_origins": ["http://ui.test"]}})
    yield s
    s.stop()


def test_the_page_and_its_files_are_served(fake_server):
    r = httpx.get(fake_server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/app.js"' in r.text and 'href="/ui/style.css"' in r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]  # no inline or foreign script runs
    for path, kind in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        f = httpx.get(fake_server.url + path)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind) and len(f.content) > 1000


def test_ui_false_serves_neither_the_page_nor_its_feed():
    s = start_server(FAKE | {"server": {"ui": False}})
    try:
        for path in ("/", "/ui/app.js", "/stats/stream"):
            r = httpx.get(s.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.get(s.url + "/stats").status_code == 200
    finally:
        s.stop()


def test_stats_stream_counts_a_request_while_it_runs_and_after(fake_server):
    client = fake_server.client()
    first = frames(fake_server.url, 1)[0]
    assert first["output_tok_s"] is None and first["prefill_per_step"] is None  # no interval yet
    assert first["model"] == "embedded" and first["ready"] and first["kv_num_blocks"] > 0
    done = threading.Event()

    def chat():
        client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=20, extra_body={"ignore_eos": True})
        done.set()

    threading.Thread(target=chat).start()
    assert done.wait(10)
    later = frames(fake_server.url, 2, interval=0.2)[-1]
    assert later["requests_finished"] == first["requests_finished"] + 1
    assert later["output_tokens"] == first["output_tokens"] + 20
    assert later["ttft"]["p50"] is not None and later["itl"]["p99"] is not None
    assert later["running"] == 0 and later["waiting"] == 0 and later["preemptions"] == 0


def test_stats_stream_rates_cover_the_interval():
    # a slow fake step: the request is still running across frames, so the rates are positive meanwhile
    s = start_server(FAKE | {"backend": {"name": "fake", "options": {"step_cost_s": 0.02}}})
    try:
        client = s.client()
        t = threading.Thread(target=lambda: client.completions.create(
            model="embedded", prompt="x" * 40, max_tokens=60, extra_body={"ignore_eos": True}))
        t.start()
        seen = frames(s.url, 6, interval=0.2)
        t.join(10)
        busy = [f for f in seen if f["output_tok_s"]]
        assert busy, seen
        assert 2 < max(f["output_tok_s"] for f in busy) < 60  # at most 1 token per 20 ms step, however loaded the CPU
        assert any(f["running"] == 1 for f in seen)
        assert any(f["decode_per_step"] == 1 for f in busy)
    finally:
        s.stop()


@pytest.mark.parametrize("interval", ["0", "fast", "nan", "1e9"])
def test_stats_stream_refuses_a_bad_interval(fake_server, interval):
    r = httpx.get(fake_server.url + "/stats/stream", params={"interval": interval})
    assert r.status_code == 400
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                   "param": "interval", "code": None}


def test_the_api_key_guards_v1_and_leaves_the_page_and_feeds_open(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert httpx.get(url + "/").status_code == 200  # the page holds no data; the user types the key into it
    assert frames(url, 1)[0]["model"] == "embedded"  # the same rule as /stats


def test_cors_applies_to_the_feed(keyed_server):
    with httpx.stream("GET", keyed_server.url + "/stats/stream", headers={"Origin": "http://ui.test"}) as r:
        assert r.headers["access-control-allow-origin"] == "http://ui.test"
    with httpx.stream("GET", keyed_server.url + "/stats/stream", headers={"Origin": "http://evil.test"}) as r:
        assert "access-control-allow-origin" not in r.headers


def test_the_page_is_503_while_the_model_loads_then_served():
    cfg = config_from_dict(FAKE, source="<test>")
    release = threading.Event()

    def slow_build():
        release.wait(10)
        return Engine.from_config(cfg)

    with TestClient(create_app(cfg, slow_build)) as client:  # a factory: the app serves while it builds
        r = client.get("/")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert r.headers["retry-after"] == "5"
        assert client.get("/no/such/route").status_code == 503  # it may be a plugin's: say why it is missing
        release.set()
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/").status_code == 200
        assert client.get("/no/such/route").status_code == 404


def test_sigterm_ends_an_open_feed_at_once():
    # `serve` drains connections on SIGTERM: an open dashboard must not hold the exit up to drain_timeout
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    env.pop("LLMSERVE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--backend", "fake",
                             "--port", str(port), "--set", "server.drain_timeout=30"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(url + "/health"):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        with httpx.stream("GET", url + "/stats/stream", params={"interval": 60}, timeout=40) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the server ends the stream
        assert proc.wait(30) == 0 and time.monotonic() - t0 < 5, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
