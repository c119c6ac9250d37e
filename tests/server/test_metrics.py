"""/metrics (Prometheus plugin, mounted through register_routes) and /stats on a live server."""

from __future__ import annotations

import os
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import FAKE, start_server

NAMES = [
    "llmserve_time_to_first_token_seconds", "llmserve_inter_token_latency_seconds",
    "llmserve_e2e_request_latency_seconds", "llmserve_request_queue_time_seconds", "llmserve_batch_size",
    "llmserve_num_requests_running", "llmserve_num_requests_waiting", "llmserve_kv_cache_usage_ratio",
    "llmserve_prompt_tokens", "llmserve_generation_tokens", "llmserve_request_success",
    "llmserve_prefix_cache_queries", "llmserve_prefix_cache_hits", "llmserve_preemptions",
    "llmserve_kv_cache_evictions",
]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_sink_is_on_by_default_and_counts_requests(fake_server):
    from llmserve_prometheus.sink import PrometheusSink

    assert any(isinstance(s, PrometheusSink) for s in fake_server.state.client.metric_sinks)
    client = fake_server.client()
    shared = "a shared system prompt that is long enough to fill two blocks. "
    for i in range(3):
        client.completions.create(model="embedded", prompt=shared + str(i), max_tokens=5,
                                  extra_body={"ignore_eos": True})
    r = httpx.get(fake_server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(r.text)}
    assert set(NAMES) <= families
    s = _samples(r.text)
    m = (("model_name", "embedded"),)
    assert s[("llmserve_generation_tokens_total", m)] == 15
    assert s[("llmserve_prompt_tokens_total", m)] == 3 * (len(shared) + 1)
    assert s[("llmserve_request_success_total", (("finished_reason", "length"), ("model_name", "embedded")))] == 3
    assert s[("llmserve_time_to_first_token_seconds_count", m)] == 3
    assert s[("llmserve_inter_token_latency_seconds_count", m)] == 3 * 4
    assert s[("llmserve_prefix_cache_hits_total", m)] > 0  # the 2nd and 3rd prompts reuse the prefix
    assert s[("llmserve_batch_size_count", m)] >= 5
    # every series carries the model_name label
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            assert sample.labels.get("model_name") == "embedded", sample


def test_each_engine_has_its_own_registry():
    from llmserve_prometheus.sink import PrometheusSink

    from llmserve.metrics import RequestMetrics

    a, b = PrometheusSink("a"), PrometheusSink("b")
    a.on_request_finished(RequestMetrics("r", 0, "stop", None, 3, 4, 0, 0, 0.1, 0.2, 0.3, [0.05]))
    assert 'llmserve_generation_tokens_total{model_name="a"} 4.0' in a.render().decode()
    assert 'llmserve_generation_tokens_total{model_name="b"} 0.0' in b.render().decode()
    # the failure counter, not the success one, takes errors
    b.on_request_finished(RequestMetrics("r", 0, "error", "boom", 3, 0, 0, 0, None, None, 0.3, []))
    assert 'llmserve_request_failure_total{model_name="b"} 1.0' in b.render().decode()


def test_one_prometheus_sink_whether_or_not_the_config_names_it():
    from llmserve_prometheus.sink import PrometheusSink

    for sinks in ([], ["prometheus"]):
        s = start_server({**FAKE, "metrics": {"sinks": sinks}})
        try:
            assert sum(isinstance(x, PrometheusSink) for x in s.state.client.metric_sinks) == 1
            s.client().completions.create(model="embedded", prompt="once", max_tokens=3,
                                          extra_body={"ignore_eos": True})
            s.wait_idle()
            text = httpx.get(s.url + "/metrics").text
            assert 'llmserve_generation_tokens_total{model_name="embedded"} 3.0' in text  # counted once
        finally:
            s.stop()


def test_gauges_show_zero_within_a_second_after_streaming_clients_disconnect():
    s = start_server({**FAKE, "backend": {"name": "fake", "options": {"step_cost_s": 0.02}}})
    try:
        body = {"prompt": "hold on", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=s.url, timeout=30) as c:
            streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(20)]
            # keep each line iterator alive: a dropped one closes its connection early
            lines = [st.__enter__().iter_lines() for st in streams]
            for it in lines:  # every stream is producing tokens
                next(it)
            gauge = _gauge(httpx.get(s.url + "/metrics").text, "llmserve_num_requests_running")
            assert gauge > 0
            for st in streams:
                st.__exit__(None, None, None)
        deadline = time.monotonic() + 1.0
        while True:
            text = httpx.get(s.url + "/metrics").text
            running = _gauge(text, "llmserve_num_requests_running")
            usage = _gauge(text, "llmserve_kv_cache_usage_ratio")
            if (running, usage) == (0.0, 0.0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (running, usage) == (0.0, 0.0)
    finally:
        s.stop()


def _gauge(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_stats_reports_queue_cache_and_latencies(fake_server):
    fake_server.client().completions.create(model="embedded", prompt="stats", max_tokens=3)
    s = fake_server.wait_idle()
    assert {"waiting", "running", "cache", "metrics", "max_model_len", "server"} <= set(s)
    assert s["cache"]["num_blocks"] == 256 and s["cache"]["used_blocks"] == 0
    assert s["metrics"]["latency_seconds"]["ttft"]["count"] >= 1
    conns = s["server"]["connections"]  # the transport's counts (tests/server/test_connections.py)
    assert s["server"] == {"ready": True, "draining": False, "active_requests": 0, "steps": s["server"]["steps"],
                           "engine_pid": os.getpid(), "connections": conns}  # engine_core thread: this process
    assert conns["open"] >= 1 and conns["limit"] >= 16 and conns["refused"] == {"max_connections": 0,
                                                                                 "max_connections_per_client": 0}
