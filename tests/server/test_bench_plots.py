"""`llmserve bench serve|offline --plot DIR`: the figures are real PNGs drawn from the JSON beside them, which
matches the run's own report; a concurrency sweep covers every point; the one-line errors of a first run."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from llmserve.cli import main
from tests.server.conftest import FAKE, free_port, start_server

pytest.importorskip("matplotlib")  # the plot extra, in dev


def _png(path: Path) -> None:
    """A real image with something drawn on it (not a blank canvas)."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] >= 600 and im.size[1] >= 300
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 100  # lines and text on the background
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20  # several colours


@pytest.fixture(scope="module")
def slow_fake():
    # a step cost, so the run lasts long enough for the timeline to sample it several times
    s = start_server({**FAKE, "backend": {"name": "fake", "options": {"step_cost_s": 0.004}}})
    yield s
    s.stop()


def test_bench_serve_sweep_plots_match_the_json_report(slow_fake, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", slow_fake.url, "--concurrency", "1,4", "--requests", "8",
               "--prompt-len", "4", "8", "--output-len", "8", "16", "--plot", str(tmp_path), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["concurrency"] == [1, 4] and "serve" not in r
    assert [p["concurrency"] for p in r["sweep"]] == [1, 4]
    assert all(p["serve"]["completed"] == 8 and p["serve"]["failed"] == 0 for p in r["sweep"])
    # fresh seeds per point, so the second point gets no prefix-cache hits from the first
    assert [p["rounds"][0]["workload_seed"] for p in r["sweep"]] == [0, 1]
    assert sorted(r["plots"]) == sorted(str(tmp_path / f) for f in ("latency_cdf.png", "concurrency.png",
                                                                     "timeline.png"))
    for f in r["plots"]:
        _png(Path(f))

    cdf = json.loads((tmp_path / "latency_cdf.json").read_text())
    assert list(cdf) == ["c=1", "c=4"]
    for point in r["sweep"]:
        d, lat = cdf[f"c={point['concurrency']}"], point["serve"]["latency_ms"]
        assert len(d["ttft_ms"]) == len(d["e2e_ms"]) == 8 and d["ttft_ms"] == sorted(d["ttft_ms"])
        # the JSON keeps 4 decimals of a ms
        assert statistics.fmean(d["ttft_ms"]) == pytest.approx(lat["ttft"]["mean"], abs=1e-4)
        assert statistics.fmean(d["e2e_ms"]) == pytest.approx(lat["e2e"]["mean"], abs=1e-4)
        assert d["itl_ms"] and statistics.fmean(d["itl_ms"]) == pytest.approx(lat["itl"]["mean"], abs=1e-4)

    conc = json.loads((tmp_path / "concurrency.json").read_text())["points"]
    assert [(p["concurrency"], p["output_token_throughput"]) for p in conc] == \
           [(p["concurrency"], pytest.approx(p["serve"]["output_token_throughput"], abs=1e-4)) for p in r["sweep"]]

    tl = json.loads((tmp_path / "timeline.json").read_text())
    assert [m["label"] for m in tl["marks"]] == ["c=1", "c=4"]
    assert len(tl["t_s"]) >= 5 and tl["t_s"] == sorted(tl["t_s"])
    assert 1 <= max(tl["running"]) <= 4 and max(tl["kv_usage"]) > 0 and max(tl["output_tok_s"]) > 0
    # the tokens it saw generated are the ones the clients counted (the counter is the server's, since start)
    assert tl["output_tok_s"][0] == 0.0 and min(tl["waiting"]) >= 0


def test_bench_offline_plots_cdfs_and_a_timeline_of_the_engine(tmp_path, capsys):
    rc = main(["bench", "offline", "--requests", "120", "--prompt-len", "8", "64", "--output-len", "16", "64",
               "--no-bound", "--max-num-seqs", "16", "--plot", str(tmp_path), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert sorted(Path(f).name for f in r["plots"]) == ["latency_cdf.png", "timeline.png"]
    for f in r["plots"]:
        _png(Path(f))
    cdf = json.loads((tmp_path / "latency_cdf.json").read_text())["engine"]
    assert len(cdf["ttft_ms"]) == r["completed"] == 120
    tl = json.loads((tmp_path / "timeline.json").read_text())
    assert len(tl["t_s"]) >= 2
    assert max(tl["running"]) <= 16 and max(tl["waiting"]) > 0  # 120 arrive at once, 16 run
    assert max(tl["kv_usage"]) <= r["kv_cache"]["peak_utilization"] + 1e-9


def test_plot_without_matplotlib_is_one_line_before_any_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for cmd in (["bench", "offline", "--requests", "5"], ["bench", "serve", "--base-url", "http://127.0.0.1:9"]):
        assert main([*cmd, "--plot", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--plot needs matplotlib" in err and "pip install" in err
    assert not list(tmp_path.iterdir())


def test_bench_serve_with_no_server_is_one_clear_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--base-url", url, "--requests", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"llmserve: error: no server answers at {url}") and "--launch" in err


def test_bench_offline_header_says_it_measures_the_engine_on_the_fake_backend(capsys):
    assert main(["bench", "offline", "--requests", "10", "--no-bound"]) == 0
    header = capsys.readouterr().out.splitlines()[:2]
    assert header[0].startswith("llmserve bench offline")
    assert "measures the engine" in header[1] and "fake backend" in header[1]
