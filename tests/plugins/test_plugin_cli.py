"""`llmserve plugins` and plugin subcommands, through the real command line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import httpx
import pytest

from llmserve import cli
from llmserve.engine import Engine
from llmserve.request import SamplingParams
from tests.core.test_config_cli import ENV, serving
from tests.server.conftest import free_port


def _run(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "llmserve", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_llmserve_plugins_json_lists_the_installed_example(subprocess_env, tmp_path):
    proc = _run(["plugins", "--json"], subprocess_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    ex = plugins["example"]
    assert ex["source"] == "entry point (llmserve-example-plugin 0.1.0)"
    assert ex["components"] == {"scheduler": ["sjf"], "cache": ["simple"], "metric_sink": ["csv"]}
    assert "register_commands" in ex["hooks"]
    assert plugins["llmserve_scheduler"]["source"] == "default"


def test_llmserve_plugins_text_and_plugin_limit(subprocess_env, tmp_path):
    proc = _run(["plugins"], subprocess_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "example  [entry point (llmserve-example-plugin 0.1.0)]" in proc.stdout
    assert "    scheduler: sjf" in proc.stdout
    # LLMSERVE_PLUGINS with another name hides it
    proc = _run(["plugins", "--json"], {**subprocess_env, "LLMSERVE_PLUGINS": "nothing"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "example" not in {p["name"] for p in json.loads(proc.stdout)["plugins"]}


@pytest.mark.parametrize("installed", [False, True])
def test_llmserve_plugins_lists_xgrammar_only_where_it_is_installed(installed, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (find_spec("json") if installed else None) if name == "xgrammar"
                        else find_spec(name, *a))
    assert cli.main(["plugins", "--json"]) == 0
    grammar = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}["llmserve_grammar"]
    assert grammar["components"]["grammar"] == (["llguidance", "xgrammar"] if installed else ["llguidance"])


def test_llmserve_plugins_reports_a_broken_plugin(site, capsys):
    site.add("broken", 'raise ImportError("needs a package that is not installed")')
    assert cli.main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["broken"]["error"] == "ImportError: needs a package that is not installed"
    assert plugins["broken"]["components"] == {}
    assert cli.main(["plugins"]) == 0
    assert "    FAILED: ImportError: needs a package that is not installed" in capsys.readouterr().out


def test_broken_plugin_is_reported_once_after_logging_is_configured(site):
    # the parser, the command and the engine (built on its own thread) share one load of the plugins
    site.add("broken", 'raise ImportError("needs a package that is not installed")')
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site.path), ENV["PYTHONPATH"]])}
    port = free_port()
    with serving(port, "serve", "--backend", "fake", "--port", str(port), env=env) as proc:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    err = proc.stderr.read()
    reports = [line for line in err.splitlines() if "plugin 'broken'" in line]
    assert len(reports) == 1, err
    # in the configured format, not the bare message of logging's last-resort handler
    assert " ERROR llmserve.plugins: plugin 'broken' (plugin_broken) failed to load: ImportError" in reports[0]


def test_plugin_commands_are_in_help_and_take_log_level(installed_example, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "csv-report" in capsys.readouterr().out
    assert cli.build_parser().parse_args(["csv-report", "r.csv", "--log-level", "debug"]).log_level == "debug"


def _csv_from_engine(path, n=5):
    engine = Engine.from_config({"backend": {"name": "fake"}, "scheduler": {"name": "sjf"},
                                 "metrics": {"sinks": [{"name": "csv", "options": {"path": str(path)}}]}})
    engine.generate([[1 + i] * (3 + i) for i in range(n)], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.shutdown()


def test_plugin_subcommand_csv_report(installed_example, tmp_path, capsys):
    path = tmp_path / "r.csv"
    _csv_from_engine(path)
    with open(path, newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 5
    assert cli.main(["csv-report", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 5
    assert report["finish_reasons"] == {"length": 5}
    assert report["prompt_tokens"] == 3 + 4 + 5 + 6 + 7 and report["output_tokens"] == 20
    assert report["latency_seconds"]["e2e"]["count"] == 5
    assert cli.main(["csv-report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"5 requests in {path}: 25 prompt tokens, 20 output tokens")
    assert "ttft" in out and "p95" in out
    # a missing file is a clear error, not a traceback
    assert cli.main(["csv-report", str(tmp_path / "missing.csv")]) == 2
    assert "csv-report: cannot read" in capsys.readouterr().err


def test_plugin_subcommand_through_python_m(subprocess_env, tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("finished_at,request_id,index,finish_reason,error,num_prompt_tokens,num_output_tokens,"
                    "num_cached_tokens,num_preemptions,queue_seconds,ttft_seconds,e2e_seconds,mean_itl_seconds\n"
                    "1.0,a,0,stop,,3,2,0,0,0.001,0.002,0.004,0.001\n")
    proc = _run(["csv-report", str(path), "--json"], subprocess_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["latency_seconds"]["ttft"]["p50"] == 0.002
