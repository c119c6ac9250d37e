"""The runnable scripts under examples/clients/ work as documented."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from llmserve.engine import Engine
from llmserve.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "examples" / "clients"


def _script(name, *args, env=None, cwd=None):
    return subprocess.run([sys.executable, str(CLIENTS / name), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def test_offline_engine_script_runs_and_matches_the_engine(tmp_path):
    # run from elsewhere: the script must find llmserve by itself
    proc = _script("offline_engine.py", "--json", "--max-tokens", "12", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["request_id"] for o in lines] == ["req-0", "req-1", "req-2"]

    # the same prompts through the Engine API here give the same completions
    engine = Engine.from_config({"backend": {"name": "fake"}, "tokenizer": {"name": "auto"}})
    prompts = [o["prompt"] for o in lines]
    outs = engine.generate([engine.tokenizer.encode(p) for p in prompts],
                           SamplingParams(max_tokens=12, temperature=0.0, seed=0))
    for o, ids in zip(lines, outs):
        assert o["num_tokens"] == len(ids) and 1 <= len(ids) <= 12
        assert o["finish_reason"] == ("length" if len(ids) == 12 else "stop")
        assert o["text"] == engine.tokenizer.decode(ids)


def test_offline_engine_script_streams_text(tmp_path):
    proc = _script("offline_engine.py", "--max-tokens", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("[req-0] 'The capital of France is' → ")
    assert out[1].startswith("[req-1] 'def fibonacci(n):' → ")
    assert " tokens in " in out[-1] and "TTFT p50" in out[-1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the with-block ends: nothing listens there


def test_openai_sdk_script_says_when_no_server_listens():
    proc = _script("openai_sdk.py", "--base-url", f"http://127.0.0.1:{_closed_port()}/v1", "--model", "x")
    assert proc.returncode == 1
    assert "is `llmserve` running?" in proc.stderr
    assert "Traceback" not in proc.stderr
