"""`llmserve bench serve` against a live server, with the offline comparison, through the real CLI."""

from __future__ import annotations

import json

from llmserve.cli import main


def test_bench_serve_reports_latencies_throughput_and_the_offline_ratio(fake_server, capsys):
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--concurrency", "4", "--requests", "12",
               "--prompt-len", "8", "16", "--output-len", "6", "10", "--compare-offline", "--backend", "fake",
               "--rounds", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out)
    for run in ("serve", "offline"):
        d = r[run]
        assert d["completed"] == 24 and d["failed"] == 0  # 12 requests × 2 rounds
        assert set(d["latency_ms"]) == {"ttft", "tpot", "itl", "e2e"}
        assert set(d["latency_ms"]["e2e"]) >= {"mean", "p50", "p90", "p99"}
        assert d["output_token_throughput"] > 0
    # the same seeded workload in both runs: max_tokens honoured exactly (EOS is ignored)
    assert r["serve"]["output_tokens"] == r["offline"]["output_tokens"]
    assert 6 * 24 <= r["serve"]["output_tokens"] <= 10 * 24
    assert [x["workload_seed"] for x in r["rounds"]] == [0, 1]
    assert all(x["ratio"] == x["serve_tok_s"] / x["offline_tok_s"] for x in r["rounds"])
    assert r["serve_over_offline"] == r["serve"]["output_token_throughput"] / r["offline"]["output_token_throughput"]
    assert r["server"]["model"] == "embedded" and r["workload"]["vocab_size"] == 257


def test_bench_serve_counts_failures(fake_server, capsys):
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--concurrency", "2", "--requests", "3",
               "--request-model", "no-such-model", "--json", "--output-len", "4", "4"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 1 and r["serve"]["failed"] == 3
    assert any("404" in e for e in r["serve"]["errors"])
