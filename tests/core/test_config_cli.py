"""Config loading and validation, and the command line (run as a real subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from llmserve.cli import build_parser, main
from llmserve.config import ServerConfig, check_options, config_from_dict, load_config
from llmserve.errors import ConfigError
from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'plugins'}")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


@contextmanager
def serving(port: int, *args: str, env: dict[str, str] = ENV):
    """`python -m llmserve ARGS` as a process, yielded once 127.0.0.1:PORT answers /health; stopped after."""
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"nothing answers on port {port}"
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("scheduler:\n  max_num_seq: 8\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key 'scheduler\.max_num_seq'"):
        load_config(f)


def test_every_unknown_key_is_reported_at_once_each_with_the_closest_known_one(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text("scheduler:\n  max_num_seq: 8\nserver:\n  prot: 9000\n  colour: blue\n"
                 "metrics:\n  sinks:\n    - name: jsonl\n      optons: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).splitlines() == [
        f"{f}: 4 unknown keys:",
        "  'scheduler.max_num_seq' (did you mean 'scheduler.max_num_seqs'?)",
        "  'server.prot' (did you mean 'server.port'?)",
        "  'server.colour' (known: " + ", ".join(sorted(n for n in ServerConfig.__dataclass_fields__)) + ")",
        "  'metrics.sinks[0].optons' (did you mean 'metrics.sinks[0].options'?)"]
    with pytest.raises(ConfigError, match=r"<command line>: unknown key 'cache.blok_size' \(did you mean "
                                          r"'cache.block_size'\?\)$"):
        load_config(None, {"cache.blok_size": 32})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'pathh' \(did you mean 'path'\?\)$"):
        check_options({"pathh": "x"}, {"path": None, "append": False}, "metrics.sinks[jsonl].options")


def test_a_yaml_error_names_the_file_and_the_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model:\n  model: x\n dtype: auto\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}:3:2: not valid YAML: while parsing a block "
                                          "mapping expected <block end>"):
        load_config(f)


def test_bad_value_names_the_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("cache:\n  block_size: twelve\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: cache\.block_size: expected an integer"):
        load_config(f)
    f.write_text("cache:\n  block_size: 12\n")
    with pytest.raises(ConfigError, match=r"cache\.block_size: must be a power of two"):
        load_config(f)
    # a policy is the scheduler plugin's business: the plugin names the key and its choices
    f.write_text("scheduler:\n  policy: lifo\nbackend:\n  name: fake\n")
    cfg = load_config(f)
    from llmserve.engine import Engine

    with pytest.raises(ConfigError, match=r"bad\.yaml: scheduler\.policy: the continuous scheduler knows 'fcfs', "
                                          r"'priority', got 'lifo'"):
        Engine.from_config(cfg)


def test_overrides_beat_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("scheduler:\n  max_num_seqs: 8\n  max_num_batched_tokens: 64\n")
    cfg = load_config(f, {"scheduler.max_num_seqs": 16})
    assert cfg.scheduler.max_num_seqs == 16 and cfg.scheduler.max_num_batched_tokens == 64


def test_every_shipped_config_is_valid():
    for f in (ROOT / "configs").glob("*.yaml"):
        load_config(f)


def test_sinks_accept_plain_names():
    cfg = config_from_dict({"metrics": {"sinks": ["jsonl", {"name": "x", "options": {"a": 1}}]}})
    assert [s.name for s in cfg.metrics.sinks] == ["jsonl", "x"]


def test_cli_config_error_is_reported_not_a_traceback(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  dtype: float64\n")
    r = run_cli("config", "--config", str(f))
    assert r.returncode == 2
    assert "model.dtype" in r.stderr and "Traceback" not in r.stderr


def test_cli_plugins_json_lists_the_defaults():
    r = run_cli("plugins", "--json")
    assert r.returncode == 0, r.stderr
    plugins = {p["name"]: p for p in json.loads(r.stdout)["plugins"]}
    assert plugins["llmserve_scheduler"]["components"]["scheduler"] == ["continuous"]
    assert plugins["llmserve_paged_cache"]["components"]["cache"] == ["paged"]
    assert "fake" in plugins["llmserve_fake"]["components"]["backend"]
    assert "register_backends" in plugins["llmserve_fake"]["hooks"]


def test_bench_offline_json_completes_everything_and_frees_every_block():
    r = run_cli("bench", "offline", "--requests", "200", "--json", "--shared-prefix", "64",
                "--prompt-len", "8", "64", "--output-len", "4", "32", "--num-blocks", "400")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["completed"] == 200 and rep["failed"] == 0
    assert rep["kv_cache"]["all_blocks_free_at_end"]
    assert rep["batch_size"]["max"] == 64
    assert rep["prefix_cache"]["hit_rate"] > 0.3
    assert rep["prefix_cache"]["prefill_tokens_computed"] < rep["prefix_cache"]["prompt_tokens_total"]
    assert rep["engine_overhead_ms"]["all_steps"]["p50"] is not None


@pytest.mark.parametrize("flags_first", [True, False], ids=["flags-then-serve", "serve-then-flags"])
def test_config_flags_before_or_after_serve_are_the_ones_served(flags_first):
    port = free_port()
    flags = ["--port", str(port), "--served-model-name", "either-side", "--backend", "fake"]
    with serving(port, *([*flags, "serve"] if flags_first else ["serve", *flags])):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["either-side"]


def test_config_flags_and_sets_before_and_after_the_command_add_up(capsys):
    assert main(["--max-num-seqs", "3", "--set", "cache.block_size=32", "config", "--json",
                 "--set", "scheduler.max_num_batched_tokens=99", "--no-prefix-caching"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["scheduler"]["max_num_seqs"], cfg["scheduler"]["max_num_batched_tokens"]) == (3, 99)
    assert cfg["cache"]["block_size"] == 32 and cfg["cache"]["enable_prefix_caching"] is False
    # given on both sides, the later one wins, as a repeated flag does
    assert main(["--max-num-seqs", "3", "config", "--max-num-seqs", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scheduler"]["max_num_seqs"] == 5


@pytest.mark.parametrize("command", ["serve", "plugins", "config", "bench offline", "bench serve"])
def test_every_command_takes_log_level_before_or_after_it(command):
    parser = build_parser()
    assert parser.parse_args([*command.split(), "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "warning", *command.split()]).log_level == "warning"


def test_nothing_but_main_imports_the_command_line():
    importers = sorted(p.relative_to(ROOT).as_posix() for d in ("llmserve", "plugins") for p in (ROOT / d).rglob("*.py")
                       if "llmserve.cli" in p.read_text() or "from llmserve import cli" in p.read_text())
    assert importers == ["llmserve/__main__.py"]
