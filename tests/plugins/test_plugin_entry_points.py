"""The real entry-point path: the pip-installed example plugin, and how broken plugins are handled."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

from llmserve.config import load_config
from llmserve.engine import Engine
from llmserve.errors import ConfigError, PluginError
from llmserve.plugins import load_plugins
from llmserve.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "configs" / "example-plugin.yaml"

# (prompt length, max_tokens) in arrival order: the longest job arrives first
WORKLOAD = [(30, 20), (4, 2), (8, 4), (2, 1)]


def _plugin(ps, name):
    return next(p for p in ps.describe() if p["name"] == name)


def test_example_plugin_is_listed_with_its_components(installed_example):
    ps = load_plugins()
    info = _plugin(ps, "example")
    assert info["source"] == "entry point (llmserve-example-plugin 0.1.0)"
    assert info["components"] == {"scheduler": ["sjf"], "cache": ["simple"], "metric_sink": ["csv"]}
    assert info["hooks"] == ["register_cache_allocators", "register_commands", "register_metric_sinks",
                             "register_schedulers"]
    assert "error" not in info
    assert ps.get("scheduler", "sjf").plugin == "example"
    # the defaults are still there beside it
    assert ps.get("scheduler", "continuous").plugin == "llmserve_scheduler"


def test_example_plugin_is_absent_when_not_installed():
    # the control for the test above: the listing comes from the installation, not from the source tree
    ps = load_plugins()
    assert "example" not in {p["name"] for p in ps.describe()}
    with pytest.raises(PluginError, match="no scheduler named 'sjf'.*available: continuous"):
        ps.get("scheduler", "sjf")


def _run_workload(config) -> tuple[Engine, list[str]]:
    """Add WORKLOAD in order, step to completion, return the engine and the ids in finishing order."""
    engine = Engine.from_config(config)
    ids = []
    for i, (plen, max_tokens) in enumerate(WORKLOAD):
        prompt = [(7 * i + j) % 200 + 1 for j in range(plen)]
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      request_id=f"job{i}-{plen}+{max_tokens}"))
    finished = []
    for _ in range(500):
        if not engine.has_unfinished:
            break
        for o in engine.step().outputs:
            if o.finished:
                assert o.finish_reason.value == "length", o
                finished.append(o.request_id)
    assert sorted(finished) == sorted(ids)
    return engine, finished


def test_config_selecting_sjf_and_csv_serves_through_them(installed_example, tmp_path):
    out = tmp_path / "requests.csv"
    cfg = load_config(EXAMPLE_CONFIG, {
        "scheduler.max_num_seqs": 1,  # one seat: the queue order is the finishing order
        "metrics.sinks": [{"name": "csv", "options": {"path": str(out), "flush_every": 1}}],
    })
    engine, sjf_order = _run_workload(cfg)
    assert type(engine.scheduler).__name__ == "ShortestJobFirstScheduler"
    assert engine.plugins.sources["example"].startswith("entry point (llmserve-example-plugin")
    assert type(engine.metric_sinks[0]).__name__ == "CsvSink"
    assert engine.scheduler_stats().policy == "sjf"
    engine.shutdown()

    fcfs = load_config(EXAMPLE_CONFIG, {"scheduler.name": "continuous", "scheduler.options": {},
                                        "scheduler.max_num_seqs": 1, "metrics.sinks": []})
    engine, fcfs_order = _run_workload(fcfs)
    engine.shutdown()

    assert fcfs_order == ["job0-30+20", "job1-4+2", "job2-8+4", "job3-2+1"]
    # smallest prompt + max_tokens first: 3, 6, 12, 50 tokens
    assert sjf_order == ["job3-2+1", "job1-4+2", "job2-8+4", "job0-30+20"]

    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["request_id"] for r in rows] == sjf_order
    by_id = {r["request_id"]: r for r in rows}
    for i, (plen, max_tokens) in enumerate(WORKLOAD):
        r = by_id[f"job{i}-{plen}+{max_tokens}"]
        assert (int(r["num_prompt_tokens"]), int(r["num_output_tokens"])) == (plen, max_tokens)
        assert r["finish_reason"] == "length" and r["error"] == ""
        assert float(r["e2e_seconds"]) >= float(r["ttft_seconds"]) >= float(r["queue_seconds"]) >= 0
    # the long job waited for all three short ones under SJF
    assert float(by_id["job0-30+20"]["queue_seconds"]) > float(by_id["job3-2+1"]["queue_seconds"])


def test_example_plugin_options_are_checked(installed_example, tmp_path):
    cfg = load_config(EXAMPLE_CONFIG, {"scheduler.options": {"respect_priorty": True},
                                       "metrics.sinks": []})
    with pytest.raises(ConfigError, match=r"scheduler.options \(sjf\): unknown option\(s\) 'respect_priorty'"):
        Engine.from_config(cfg)
    cfg = load_config(EXAMPLE_CONFIG, {"metrics.sinks": [{"name": "csv", "options": {"file": "x.csv"}}]})
    with pytest.raises(ConfigError, match=r"metrics.sinks\[csv\].options: unknown option\(s\) 'file'.*known: append, flush_every, path"):
        Engine.from_config(cfg)


def test_sjf_respect_priority_orders_by_priority_first(installed_example, tmp_path):
    cfg = load_config(EXAMPLE_CONFIG, {"scheduler.max_num_seqs": 1, "metrics.sinks": [],
                                       "scheduler.options": {"respect_priority": True}})
    engine = Engine.from_config(cfg)
    assert engine.scheduler_stats().policy == "sjf+priority"
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request([1] * 2, sp, request_id="short-low", priority=5)
    engine.add_request([1] * 40, sp, request_id="long-high", priority=0)
    engine.add_request([1] * 20, sp, request_id="mid-high", priority=0)
    order = []
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step().outputs if o.finished]
    assert order == ["mid-high", "long-high", "short-low"]


def test_the_example_packages_own_suite_runs_the_conformance_kit(subprocess_env):
    """The example's tests/ (a few lines calling llmserve.testing) pass against its sjf and simple cache."""
    import subprocess
    import sys

    suite = ROOT / "examples" / "llmserve-example-plugin" / "tests"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                       capture_output=True, text=True, env=subprocess_env, cwd=suite, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "3 passed" in p.stdout


def test_the_example_cache_reports_prefix_hits_in_metrics(installed_example):
    """An allocator written from docs/plugins.md alone: its hits reach /metrics through CacheStats."""
    import httpx

    from tests.server.conftest import start_server

    s = start_server({"backend": {"name": "fake"}, "model": {"model": "embedded"},
                      "cache": {"name": "simple", "num_blocks": 64, "block_size": 4}})
    try:
        system = "You are a helpful assistant. " * 3
        for q in ("hi", "hello"):
            s.client().completions.create(model="embedded", prompt=system + q, max_tokens=2)
        s.wait_idle()
        text = httpx.get(s.url + "/metrics").text
        hits = next(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                    if x.startswith("llmserve_prefix_cache_hits_total{"))
        assert hits >= 80  # the second prompt reused the first's full blocks of the shared system text
        assert type(s.state.client.engine.scheduler.allocator).__name__ == "SimplePrefixCache"
    finally:
        s.stop()


# --- plugins that fail --------------------------------------------------------------------------

BROKEN = """
raise RuntimeError("boom: this plugin cannot import")
"""

GOOD = """
from llmserve.hookspecs import hookimpl

@hookimpl
def register_metric_sinks(register):
    register("{sink}", lambda config, options: None)
"""


def test_plugin_raising_at_import_is_reported_by_name_and_skipped(site, caplog):
    site.add("broken", BROKEN)
    site.add("fine", GOOD.format(sink="fine-sink"))
    with caplog.at_level(logging.ERROR, logger="llmserve.plugins"):
        ps = load_plugins()
    assert ps.failed == {"broken": "RuntimeError: boom: this plugin cannot import"}
    assert not ps.pm.has_plugin("broken")
    # the other plugins, third-party and default, are unaffected
    assert ps.get("metric_sink", "fine-sink").plugin == "fine"
    assert ps.get("scheduler", "continuous").plugin == "llmserve_scheduler"
    assert "plugin 'broken' (plugin_broken) failed to load: RuntimeError: boom" in caplog.text
    assert "LLMSERVE_STRICT_PLUGINS=1" in caplog.text
    listed = _plugin(ps, "broken")
    assert listed["error"] == "RuntimeError: boom: this plugin cannot import"
    assert listed["source"] == "entry point (llmserve-test-broken 0.1)"


def test_plugin_raising_at_import_is_fatal_when_strict(site, monkeypatch):
    site.add("broken", BROKEN)
    monkeypatch.setenv("LLMSERVE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"plugin 'broken' \(plugin_broken\) failed to load: RuntimeError: boom.*"
                                          r"LLMSERVE_STRICT_PLUGINS is set"):
        load_plugins()
    # and an engine does not start either
    with pytest.raises(PluginError, match="'broken'"):
        Engine.from_config({"backend": {"name": "fake"}})


@pytest.mark.parametrize("strict", ["0", ""])
def test_strict_mode_off_values(site, monkeypatch, strict):
    site.add("broken", BROKEN)
    monkeypatch.setenv("LLMSERVE_STRICT_PLUGINS", strict)
    assert "broken" in load_plugins().failed


DUP = """
from llmserve.hookspecs import hookimpl

@hookimpl
def register_schedulers(register):
    from llmserve_scheduler import ContinuousScheduler
    register("{name}", lambda config, allocator: ContinuousScheduler(allocator))
"""


def test_two_plugins_registering_one_name_fail_naming_both(site):
    site.add("alpha", DUP.format(name="twin"))
    site.add("beta", DUP.format(name="twin"))
    with pytest.raises(PluginError) as e:
        load_plugins()
    msg = str(e.value)
    assert "two plugins register a scheduler named 'twin'" in msg
    assert "'alpha'" in msg and "'beta'" in msg
    assert "LLMSERVE_PLUGINS" in msg  # says how to get out of it
    # so an engine fails at start-up, before any request
    with pytest.raises(PluginError, match="'twin'"):
        Engine.from_config({"backend": {"name": "fake"}})


def test_third_party_cannot_take_a_default_name(site):
    site.add("usurper", DUP.format(name="continuous"))
    with pytest.raises(PluginError, match="scheduler named 'continuous'") as e:
        load_plugins()
    assert "'llmserve_scheduler'" in str(e.value) and "'usurper'" in str(e.value)


def test_llmserve_plugins_limits_what_loads(site, installed_example, monkeypatch):
    site.add("broken", BROKEN)
    site.add("alpha", DUP.format(name="twin"))
    site.add("beta", DUP.format(name="twin"))

    monkeypatch.setenv("LLMSERVE_PLUGINS", "example")
    ps = load_plugins()
    third_party = {n for n, src in ps.sources.items() if src.startswith("entry point")}
    assert third_party == {"example"}
    assert ps.failed == {}  # the broken plugin was not even imported
    assert ps.get("scheduler", "sjf").plugin == "example"

    monkeypatch.setenv("LLMSERVE_PLUGINS", " alpha , broken ")  # spaces are ignored
    ps = load_plugins()
    assert set(ps.failed) == {"broken"}
    assert ps.get("scheduler", "twin").plugin == "alpha"  # beta not loaded: no clash
    assert not ps.pm.has_plugin("example") and not ps.pm.has_plugin("beta")

    # the defaults always load; an empty list means no third-party plugin at all
    monkeypatch.setenv("LLMSERVE_PLUGINS", "")
    ps = load_plugins()
    assert not any(src.startswith("entry point") for src in ps.sources.values())
    assert ps.get("scheduler", "continuous").plugin == "llmserve_scheduler"


MISSPELLED = """
from llmserve.hookspecs import hookimpl

@hookimpl
def register_scheduler(register):  # the spec is register_schedulers
    pass
"""

UNKNOWN_ARG = """
from llmserve.hookspecs import hookimpl

@hookimpl
def register_schedulers(register, config):  # the spec has no `config`
    pass
"""


def test_misspelled_hook_fails_at_startup_with_pluggys_message(site):
    site.add("typo", MISSPELLED)
    with pytest.raises(PluginError, match=r"unknown hook 'register_scheduler' in plugin <module 'plugin_typo'"):
        load_plugins()
    with pytest.raises(PluginError, match="register_scheduler"):
        Engine.from_config({"backend": {"name": "fake"}})


def test_unknown_hook_argument_fails_at_startup_with_pluggys_message(site):
    site.add("extra_arg", UNKNOWN_ARG)
    pluggy_says = r"Argument\(s\) \{'config'\} are declared in the hookimpl but can not be found in the hookspec"
    # a bug in the plugin, not a missing dependency: fatal even without LLMSERVE_STRICT_PLUGINS
    with pytest.raises(PluginError, match=r"(?s)plugin 'extra_arg'.*" + pluggy_says):
        load_plugins()
    with pytest.raises(PluginError, match=pluggy_says):
        Engine.from_config({"backend": {"name": "fake"}})


def test_unknown_hook_argument_in_an_extra_plugin_fails_the_same_way(monkeypatch):
    import types

    monkeypatch.setenv("LLMSERVE_PLUGINS", "")
    mod = types.ModuleType("handmade")
    exec(UNKNOWN_ARG, mod.__dict__)
    with pytest.raises(PluginError, match=r"(?s)plugin 'handmade'.*Argument\(s\) \{'config'\}"):
        Engine.from_config({"backend": {"name": "fake"}}, extra_plugins=[mod])


def test_installed_plugin_also_passed_as_extra_plugin_loads_once(installed_example):
    import llmserve_example_plugin

    ps = load_plugins(extra_plugins=[llmserve_example_plugin])
    assert ps.get("scheduler", "sjf").plugin == "example"


def test_hand_written_distribution_matches_what_pip_installs(tmp_path, example_site, write_dist_by_hand):
    # where pip cannot build offline (an old setuptools without wheel), the fixtures write the
    # dist-info by hand; it must look to importlib.metadata exactly like pip's
    from importlib import metadata

    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    write_dist_by_hand(ROOT / "examples" / "llmserve-example-plugin", by_hand)

    def seen(site):
        (dist,) = metadata.distributions(path=[str(site)])
        return (dist.metadata["Name"], dist.version,
                sorted((ep.group, ep.name, ep.value) for ep in dist.entry_points))

    assert seen(by_hand) == seen(example_site)
    assert seen(by_hand) == ("llmserve-example-plugin", "0.1.0",
                             [("llmserve", "example", "llmserve_example_plugin")])
    assert sorted(p.name for p in (by_hand / "llmserve_example_plugin").glob("*.py")) == \
        sorted(p.name for p in (example_site / "llmserve_example_plugin").glob("*.py"))
