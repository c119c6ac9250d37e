"""docs/writing-a-plugin.md works as written: its files are built, pip-installed and run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "writing-a-plugin.md"


def tutorial_files() -> dict[str, str]:
    """path → content of every fenced block whose first line is `# file: <path>`."""
    files = {}
    for block in re.findall(r"^```\w*\n(.*?)^```", TUTORIAL.read_text(), flags=re.M | re.S):
        first, _, rest = block.partition("\n")
        m = re.fullmatch(r"# file: (\S+)", first.strip())
        if m:
            files[m.group(1)] = rest if m.group(1).endswith((".py", ".yaml")) else block
    return files


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory, installer):
    """The tutorial's folder written out, and the plugin installed into a site folder of its own."""
    work = tmp_path_factory.mktemp("tutorial")
    for rel, content in tutorial_files().items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(content)
    site = tmp_path_factory.mktemp("tutorial-site")
    installer(work / "llmserve-slowlog", site)
    env = dict(os.environ)
    for k in ("LLMSERVE_PLUGINS", "LLMSERVE_STRICT_PLUGINS"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), str(site)])
    return work, site, env


def test_tutorial_has_every_file_it_talks_about():
    assert set(tutorial_files()) == {
        "llmserve-slowlog/pyproject.toml", "llmserve-slowlog/llmserve_slowlog/sink.py",
        "llmserve-slowlog/llmserve_slowlog/__init__.py", "slowlog.yaml", "run_offline.py",
        "llmserve-slowlog/test_slowlog.py"}


def test_tutorial_plugin_is_listed_after_install(tutorial, monkeypatch):
    _, site, _ = tutorial
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("LLMSERVE_STRICT_PLUGINS", "1")  # the checklist's strict check
    try:
        info = {p["name"]: p for p in load_plugins().describe()}["slowlog"]
    finally:
        sys.modules.pop("llmserve_slowlog", None)
        sys.modules.pop("llmserve_slowlog.sink", None)
    assert info["source"] == "entry point (llmserve-slowlog 0.1.0)"
    assert info["components"] == {"metric_sink": ["slowlog"]}
    assert info["hooks"] == ["register_metric_sinks"]


def test_tutorial_offline_run_logs_requests(tutorial):
    work, _, env = tutorial
    proc = subprocess.run([sys.executable, "run_offline.py"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(line["prompt_tokens"] for line in lines) == [3, 4]
    assert all(1 <= line["output_tokens"] <= 5 and line["e2e_seconds"] >= 0 for line in lines)


def test_tutorial_test_file_passes(tutorial):
    work, _, env = tutorial
    env = {**env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(work / "llmserve-slowlog")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_slowlog.py"],
                          cwd=work / "llmserve-slowlog", env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
