"""What a new user meets first: the names the fake backend serves under, the request log, Ctrl-C on the server."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import FAKE, free_port, start_server, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def test_the_fake_backend_serves_as_fake_unless_a_model_is_named():
    for config, name, root in (({"backend": {"name": "fake"}}, "fake", "fake"), (FAKE, "embedded", "embedded"),
                               ({"backend": {"name": "fake"}, "model": {"served_model_name": "mine"}}, "mine", "fake")):
        s = start_server(config)
        try:
            # (root: what is loaded; the fake backend loads no model, so never the default model's name)
            assert [(m["id"], m["root"]) for m in httpx.get(s.url + "/v1/models").json()["data"]] == [(name, root)]
            wrong = httpx.post(s.url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi"})
            assert wrong.status_code == 404
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name
            assert s.stats()["model"] == name
        finally:
            s.stop()


SECRET_KEY, SECRET_PROMPT = "sk-do-not-log-me", "my private prompt text"


@pytest.fixture(scope="module")
def logged_server():
    # a step cost, so a long stream is still running when its client hangs up
    s = start_server({**FAKE, "backend": {"name": "fake", "options": {"step_cost_s": 0.01}},
                      "server": {"log_requests": True, "api_key": SECRET_KEY}})
    yield s
    s.stop()


def test_log_requests_writes_one_line_per_request_without_the_prompt_or_key(logged_server, caplog):
    auth = {"Authorization": f"Bearer {SECRET_KEY}"}
    url = logged_server.url
    with caplog.at_level(logging.INFO, logger="llmserve.requests"):
        ok = httpx.post(url + "/v1/completions", headers=auth,
                        json={"prompt": SECRET_PROMPT, "max_tokens": 5, "ignore_eos": True}).json()
        with httpx.stream("POST", url + "/v1/chat/completions", headers=auth,
                          json={"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4,
                                "ignore_eos": True, "stream": True}) as r:
            events = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
        chat_id = events[0][len('data: {"id":"'):].split('"')[0]
        bad = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": -1})
        unauthorized = httpx.post(url + "/v1/completions", json={"prompt": SECRET_PROMPT})
        deadline = time.monotonic() + 5  # the stream's line comes once its last body part is sent
        while len([r for r in caplog.records if r.name == "llmserve.requests"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "llmserve.requests"]
    assert bad.status_code == 400 and unauthorized.status_code == 401
    assert len(lines) == 4, lines
    first, chat, four_hundred, four_oh_one = lines
    prompt_tokens = len(SECRET_PROMPT.encode())  # the byte tokenizer
    assert first.startswith(f"{ok['id']} POST /v1/completions 200 prompt_tokens={prompt_tokens} completion_tokens=5 ")
    assert chat.startswith(f"{chat_id} POST /v1/chat/completions 200 ") and "completion_tokens=4" in chat
    assert four_hundred.startswith("- POST /v1/completions 400 prompt_tokens=- completion_tokens=-")
    assert four_oh_one.startswith("- POST /v1/completions 401 ")
    for line in lines:
        assert float(line.rsplit("latency_ms=", 1)[1]) > 0
        assert SECRET_KEY not in line and SECRET_PROMPT not in line and "private" not in line


def test_a_stream_the_client_leaves_is_logged_too(logged_server, caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.requests"):
        with httpx.stream("POST", logged_server.url + "/v1/completions",
                          headers={"Authorization": f"Bearer {SECRET_KEY}"},
                          json={"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # the first event, then hang up
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if r.name == "llmserve.requests"] and time.monotonic() < deadline:
            time.sleep(0.02)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "llmserve.requests"]
    assert line.startswith("cmpl-") and " POST /v1/completions 200 prompt_tokens=1 " in line
    assert int(line.split("completion_tokens=")[1].split()[0]) < 400  # logged when the client left, not at the end
    assert logged_server.wait_idle()["running"] == 0  # and it was aborted, as any stream the client leaves


def test_no_request_lines_by_default(fake_server, caplog):
    with caplog.at_level(logging.INFO):
        assert httpx.post(fake_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if r.name in ("llmserve.requests", "uvicorn.access")]


def _serve(*flags: str, backend: tuple[str, ...] = ("--backend", "fake")) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    env.pop("LLMSERVE_API_KEY", None)
    # the command `make serve` runs, as a terminal's Ctrl-C reaches it: SIGINT to its process, whose SIGINT is
    # the default one as in a terminal's foreground (a suite run in the background, nohup'd, would hand it ignored)
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", *backend, "--port", str(port), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, f"http://127.0.0.1:{port}"


def _ctrl_c(proc: subprocess.Popen, before) -> str:
    """Run `before()`, send SIGINT (a terminal's Ctrl-C), return the output; never leave the process behind."""
    try:
        before()
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_stops_the_server_with_130_and_no_traceback_and_the_access_log_is_on_when_asked():
    proc, url = _serve("--access-log", "--log-requests")

    def one_request():
        wait_healthy(proc, url)
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200

    out = _ctrl_c(proc, one_request)
    assert proc.returncode == 130, out  # the shell's convention for Ctrl-C, as `llmserve` returns it everywhere
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert '"POST /v1/completions HTTP/1.1" 200' in out  # uvicorn's access log
    assert "POST /v1/completions 200 prompt_tokens=2 completion_tokens=3 latency_ms=" in out  # llmserve's line


def test_ctrl_c_while_starting_exits_130_without_a_traceback():
    proc, _ = _serve(backend=("--model", "embedded"))
    out = _ctrl_c(proc, lambda: time.sleep(1.0))  # still importing torch and building the engine
    # 130, or killed by SIGINT when it came before Python's handler was up (a loaded machine starts slowly):
    # a shell reports both as 130
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in out, out


def test_the_served_process_exits_without_leak_reports_from_extension_modules():
    """serve() freezes what start-up made (gc.freeze); `llmserve serve` then ends without the interpreter's
    teardown, in which Triton's nanobind bindings (imported whenever transformers is, for a served HF model or
    tokenizer) printed pages of "nanobind: leaked ..." after every Ctrl-C."""
    code = (
        "import sys, triton, uvicorn\n"  # what serving a model with transformers imports
        "uvicorn.Server.run = lambda self, sockets=None: None\n"  # start-up and the exit, no serving between
        "from llmserve.cli import main\n"
        f"sys.exit(main(['serve', '--backend', 'fake', '--port', '{free_port()}']))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "serving fake on http://127.0.0.1" in p.stderr  # (it did start: logged before the server runs)
    assert "leaked" not in p.stderr, p.stderr[-2000:]
