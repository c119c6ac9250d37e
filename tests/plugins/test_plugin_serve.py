"""`llmserve --config configs/example-plugin.yaml` serves through the installed plugin's scheduler and sink.

One real server process (uvicorn on a free port), driven by the client scripts in examples/clients.
"""

from __future__ import annotations

import csv
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "examples" / "clients"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


@pytest.fixture
def server(subprocess_env, tmp_path):
    """The example config served from tmp_path (where its CSV lands); yields (base url, process, csv path)."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve", "--config", str(ROOT / "configs" / "example-plugin.yaml"),
         "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path, env=subprocess_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy in 60s"
            time.sleep(0.1)
        yield base, proc, tmp_path / "llmserve-requests.csv"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def test_example_config_serves_through_sjf_and_csv(server, subprocess_env):
    base, proc, csv_path = server
    status, stats = _get(base + "/stats")
    assert status == 200 and stats["scheduler"]["policy"] == "sjf"

    # the OpenAI SDK script: a completion, a chat, and both streamed = 4 requests
    sdk = subprocess.run([sys.executable, str(CLIENTS / "openai_sdk.py"), "--base-url", base + "/v1",
                          "--max-tokens", "8"], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert sdk.returncode == 0, sdk.stdout + sdk.stderr
    assert "model: example" in sdk.stdout
    assert "completion (length, 8 tokens)" in sdk.stdout or "completion (stop" in sdk.stdout
    assert "usage: " in sdk.stdout
    expected, chats = 4, 2

    if shutil.which("curl"):  # curl.sh: completion, chat, streamed completion, one bad request (not queued)
        sh = subprocess.run(["bash", str(CLIENTS / "curl.sh"), base], capture_output=True, text=True, timeout=120)
        assert sh.returncode == 0, sh.stdout + sh.stderr
        assert "data: [DONE]" in sh.stdout
        assert '"type": "invalid_request_error"' in sh.stdout and '"param": "max_tokens"' in sh.stdout
        expected, chats = expected + 3, chats + 1

    proc.send_signal(signal.SIGTERM)  # a clean drain closes the sinks, flushing the CSV
    assert proc.wait(timeout=30) == 0
    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == expected
    assert {r["finish_reason"] for r in rows} <= {"length", "stop"}
    assert all(int(r["num_output_tokens"]) >= 1 for r in rows)
    assert sum(r["request_id"].startswith("chatcmpl-") for r in rows) == chats
