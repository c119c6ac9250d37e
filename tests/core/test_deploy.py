"""The Dockerfile, compose.yaml and the CI workflow, checked as far as a machine without Docker can: the image's
command and health check run here as the image would run them, on the fake backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped) as (keyword, arguments)."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def _final_stage() -> list[tuple[str, str]]:
    ins = _instructions((ROOT / "Dockerfile").read_text())
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]


def test_the_image_runs_as_a_user_with_a_health_check_and_no_compiler():
    stage = dict(_final_stage())
    assert stage["USER"] not in ("root", "0")
    assert stage["EXPOSE"] == "8000"
    assert "g++" not in " ".join(a for k, a in _final_stage() if k == "RUN")  # the kernels come prebuilt
    assert "fetch-model" in " ".join(a for k, a in _final_stage() if k == "RUN")  # the model is in the image
    assert "/health" in stage["HEALTHCHECK"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_images_command_and_health_check_serve(tmp_path):
    """CMD with the config the image copies in (its port moved to a free one, the fake backend instead of the
    model), then HEALTHCHECK's command against it: healthy, and the API answers."""
    stage = _final_stage()
    cmd = json.loads(dict(stage)["CMD"])
    copies = {dst: src for src, dst in (a.split()[-2:] for k, a in stage if k == "COPY" and "--from" not in a)}
    config = yaml.safe_load((ROOT / copies[cmd[cmd.index("--config") + 1]]).read_text())
    assert config["server"]["host"] == "0.0.0.0" and config["server"]["port"] == 8000
    port = _free_port()
    config["server"]["port"] = port
    config["server"]["host"] = "127.0.0.1"
    (tmp_path / "docker.yaml").write_text(yaml.safe_dump(config))
    args = [sys.executable, "-m", "llmserve", *cmd[1:cmd.index("--config") + 1], str(tmp_path / "docker.yaml"),
            "--backend", "fake"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        health = json.loads(dict(stage)["HEALTHCHECK"].split("CMD", 1)[1])  # (its exec form)
        health = [sys.executable if a == "python" else a.replace(":8000/", f":{port}/") for a in health]
        deadline = time.monotonic() + 60
        while subprocess.run(health, capture_output=True).returncode != 0:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the image's command never became healthy"
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)
    assert subprocess.run(health, capture_output=True).returncode != 0  # and unhealthy once it is gone


def test_compose_serves_the_image_and_prometheus_scrapes_it():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    app, prom = compose["services"]["llmserve"], compose["services"]["prometheus"]
    assert app["build"] == "." and "8000:8000" in app["ports"]
    mount = next(v.split(":") for v in prom["volumes"] if v.endswith("prometheus.yml:ro"))
    scrape = yaml.safe_load((ROOT / mount[0]).read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == ["llmserve:8000"]


def test_the_workflow_runs_the_readmes_test_command():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = wf["jobs"]["test"]["steps"]
    assert any("bash .ci/run" in s.get("run", "") for s in steps)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert os.access(ROOT / ".ci" / "run", os.R_OK)
