"""The routers as plain objects (no Ray), the hooks that register them, and `--replicas` staying Ray-free when unused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmserve.config import config_from_dict
from llmserve.engine import Engine
from llmserve.errors import ConfigError, LLMServeError, PluginError
from llmserve.hookspecs import hookimpl
from llmserve.interfaces import ReplicaLoad, Router
from llmserve.plugins import load_plugins
from llmserve.request import SamplingParams
from llmserve_ray.metrics import merge_replica_metrics
from llmserve_ray.routers import PowerOfTwo, PrefixAware, RoundRobin, request_keys, short_key

FAKE = {"backend": {"name": "fake"}, "model": {"model": "embedded", "max_model_len": 512},
        "cache": {"num_blocks": 64, "block_size": 16}}


def test_request_keys_are_the_keys_the_allocator_holds():
    eng = Engine.from_config(FAKE)
    prompt = list(range(1, 70))  # 4 full blocks and a tail
    eng.generate([prompt], SamplingParams(max_tokens=1))
    held = {short_key(k) for k in eng.scheduler.allocator.held_block_keys()}
    assert set(request_keys(prompt, 16)) <= held and len(request_keys(prompt, 16)) == 4
    assert not set(request_keys(prompt, 16, salt="tenant-b")) & held  # a salted prompt shares no block


def test_round_robin_takes_turns():
    r = RoundRobin()
    reps = [ReplicaLoad("a"), ReplicaLoad("b"), ReplicaLoad("c")]
    assert [r.rank([], reps)[0][0] for _ in range(4)] == [0, 1, 2, 0]


def test_power_of_two_prefers_the_less_loaded_of_its_pair():
    r = PowerOfTwo({"seed": 0})
    reps = [ReplicaLoad("a", in_flight=9), ReplicaLoad("b", in_flight=1)]
    assert all(r.rank([], reps)[0] == [1] for _ in range(10))


def test_prefix_aware_prefers_the_longest_held_match_until_load_is_imbalanced():
    keys = [11, 12, 13, 14]
    reps = [ReplicaLoad("a", 0, frozenset({11})), ReplicaLoad("b", 2, frozenset({11, 12, 13})), ReplicaLoad("c", 0)]
    r = PrefixAware({"imbalance": 4, "seed": 0})
    assert r.rank(keys, reps)[0] == [1]
    reps[1].in_flight = 9  # past the threshold: load wins over the cached prefix
    assert r.rank(keys, reps)[0] != [1]
    # no report yet: keys it routed count as held by that replica for remember_s
    fresh = [ReplicaLoad("a"), ReplicaLoad("b")]
    r.routed([21, 22], "b")
    assert r.rank([21, 22, 23], fresh)[0] == [1]


def test_hook_register_routers():
    # a third-party router registered through register_routers is found by name, beside the built-ins
    class Sticky(Router):
        def rank(self, keys, replicas):
            return [[len(replicas) - 1]]

    class Plugin:
        @hookimpl
        def register_routers(self, register):
            register("sticky", lambda options: Sticky())

    ps = load_plugins(extra_plugins=[Plugin()])
    assert {"round-robin", "power-of-two", "prefix-aware", "sticky"} <= set(ps.registries["router"])
    router = ps.get("router", "sticky").factory({})
    assert router.rank([], [ReplicaLoad("a"), ReplicaLoad("b")]) == [[1]]
    with pytest.raises(PluginError, match="no router named 'nope'"):
        ps.get("router", "nope")


def test_hook_register_launchers(monkeypatch):
    # `llmserve serve --replicas N` hands the config to the launcher distributed.launcher names
    seen = []

    class Plugin:
        @hookimpl
        def register_launchers(self, register):
            register("record", lambda config: seen.append(config.distributed.replicas) or 0)

    from llmserve import cli, plugins

    real = plugins.load_plugins
    monkeypatch.setattr(cli, "load_plugins", lambda **kw: real(extra_plugins=[Plugin()]))
    assert cli.main(["serve", "--replicas", "3", "--set", "distributed.launcher=record", "--backend", "fake"]) == 0
    assert seen == [3]


def test_distributed_config_is_checked():
    with pytest.raises(ConfigError, match="distributed.replicas"):
        config_from_dict({"distributed": {"replicas": -1}})


def test_without_replicas_nothing_imports_ray():
    code = ("import sys\n"
            "from llmserve.cli import build_parser\n"
            "from llmserve.config_args import config_from_args\n"
            "from llmserve.server.app import create_app\n"
            "args = build_parser().parse_args(['serve', '--backend', 'fake', '--model', 'embedded'])\n"
            "create_app(config_from_args(args))\n"
            "from llmserve.plugins import load_plugins\n"
            "load_plugins().get('router', 'prefix-aware').factory({})\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_ray_is_a_clear_error(monkeypatch):
    from llmserve_ray.launch import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without the extra looks like
    with pytest.raises(LLMServeError, match=r"pip install 'llmserve\[ray\]'"):
        import_ray()


def test_fleet_metrics_keep_one_family_with_a_replica_label():
    text = ("# HELP x_total Things.\n# TYPE x_total counter\nx_total{model_name=\"m\"} 3.0\n"
            "# HELP y Gauge.\n# TYPE y gauge\ny 1.0\n")
    merged = merge_replica_metrics({"r2": text, "r1": text})
    assert merged.count("# TYPE x_total counter") == 1
    lines = merged.splitlines()
    assert lines.index('x_total{replica="r2",model_name="m"} 3.0') < lines.index("# HELP y Gauge.")
    assert 'y{replica="r1"} 1.0' in lines and 'y{replica="r2"} 1.0' in lines


def test_bench_router_prefix_aware_beats_the_blind_routers(capsys):
    # `llmserve bench router`, small: no Ray, the same router objects, --json
    import json

    from llmserve.cli import main

    assert main(["bench", "router", "--replicas", "4", "--users-per-replica", "3", "--turns", "3", "--json"]) == 0
    rows = {r["router"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(rows) == {"round-robin", "power-of-two", "prefix-aware"}
    pa = rows["prefix-aware"]
    for blind in ("round-robin", "power-of-two"):
        assert pa["prefix_hit_rate"] > rows[blind]["prefix_hit_rate"]
        assert pa["ttft_p50_ms"] <= rows[blind]["ttft_p50_ms"]
    assert all(r["requests"] == 4 * 3 * 3 and r["router_us_per_request"] > 0 for r in rows.values())
