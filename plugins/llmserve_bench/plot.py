"""`--plot DIR` of both benches: PNG figures (matplotlib, Agg) and, beside each, the JSON that fed it.

latency_cdf.png   CDFs of TTFT, ITL and end-to-end latency (one line per concurrency in a sweep)
concurrency.png   throughput and latency percentiles against concurrency (`bench serve --concurrency 1,8,32`)
timeline.png      running / waiting sequences, KV-cache usage and output tok/s, sampled during the run
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from llmserve.errors import LLMServeError
from llmserve_bench.report import Result


def require_matplotlib() -> None:
    """Fail before the run, in one line, where matplotlib (the `plot` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        raise LLMServeError("--plot needs matplotlib, the plot extra: pip install -e '.[plot]' in the virtualenv "
                            "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit


def latency_data(results: list[Result], points: int = 1000) -> dict[str, list[float]]:
    """Per request TTFT and e2e, per token ITL, in ms, sorted (a CDF's x values); a longer list is cut to
    `points` evenly spaced quantiles, first and last kept, so the JSON beside the figure stays small."""
    ok = [r for r in results if r.ok]

    def cdf(xs: list[float]) -> list[float]:
        xs = sorted(xs)
        if len(xs) <= points:
            return xs
        return [xs[round(i * (len(xs) - 1) / (points - 1))] for i in range(points)]

    return {"ttft_ms": cdf([r.ttft * 1e3 for r in ok]), "itl_ms": cdf([x * 1e3 for r in ok for x in r.itl]),
            "e2e_ms": cdf([r.e2e * 1e3 for r in ok])}


class Timeline:
    """Samples (t, running, waiting, kv_usage, generated tokens) from `read` every `interval` s in a thread."""

    def __init__(self, read, interval: float = 0.1, window: float = 1.0):
        self.read, self.interval, self.window = read, interval, window
        self.samples: list[dict[str, float]] = []
        self.marks: list[tuple[float, str]] = []  # (t, label): where each point of a sweep starts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-bench-timeline", daemon=True)
        self.t0 = time.perf_counter()

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter() - self.t0, label))

    def add(self, running: int, waiting: int, kv_usage: float, generated: int) -> None:
        """One sample now (the offline bench calls this between steps instead of starting the thread)."""
        self.samples.append({"t": time.perf_counter() - self.t0, "running": running, "waiting": waiting,
                             "kv_usage": kv_usage, "generated_tokens": generated})

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.add(*self.read())
            except Exception:  # noqa: BLE001 - a missed sample (server busy or gone) is only a gap
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        getattr(self.read, "close", lambda: None)()

    def data(self) -> dict[str, Any]:
        """The samples as columns; tok/s from the generated-token counter over the trailing `window` seconds
        (between two samples alone it jumps: a sample can repeat a snapshot, or come late from a busy server)."""
        s, tok_s, j = self.samples, [], 0
        for b in s:
            while j + 1 < len(s) and s[j + 1]["t"] <= b["t"] - self.window:
                j += 1
            a = s[j]
            tok_s.append((b["generated_tokens"] - a["generated_tokens"]) / (b["t"] - a["t"]) if b["t"] > a["t"] else 0.0)
        return {"t_s": [x["t"] for x in s], "running": [x["running"] for x in s],
                "waiting": [x["waiting"] for x in s], "kv_usage": [x["kv_usage"] for x in s],
                "output_tok_s": tok_s, "marks": [{"t_s": t, "label": lb} for t, lb in self.marks]}


def stats_reader(base_url: str, api_key: str | None):
    """A Timeline source from the server's /stats (a snapshot cached for 100 ms, so polling is cheap)."""
    import httpx

    client = httpx.Client(base_url=base_url.rstrip("/"), timeout=5,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def read() -> tuple[int, int, float, int]:
        s = client.get("/stats").json()
        # decode_tokens grows every step (generation_tokens only as requests end): its rate is the live tok/s
        return s["running"], s["waiting"], s["cache"]["usage"], s["metrics"]["decode_tokens"]

    read.close = client.close  # Timeline.stop closes the connection
    return read


def _rounded(x: Any) -> Any:
    """Floats to 4 decimals (a tenth of a microsecond in ms): the JSON stays small enough to commit beside a figure."""
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _save(fig, out: Path, name: str, data: dict[str, Any]) -> list[str]:
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    (out / f"{name}.json").write_text(json.dumps(_rounded(data), separators=(",", ":")))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return [str(out / f"{name}.png")]


def _cdf(ax, xs: list[float], label: str) -> None:
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, drawstyle="steps-post")


def write_plots(out_dir: str, title: str, latencies: dict[str, dict[str, list[float]]],
                timeline: dict[str, Any] | None, sweep: list[dict[str, Any]] | None = None) -> list[str]:
    """The figures into out_dir; `latencies` maps a label (a run, or a concurrency) to latency_data."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "end-to-end latency")):
        for label, d in latencies.items():
            _cdf(ax, d[key], label)
        # log x: latencies span orders of magnitude (an ITL of 0 ms, tokens that came in one read, is left out)
        ax.set(title=name, xlabel="ms (log)", ylabel="fraction of requests" if key != "itl_ms" else "fraction of tokens",
               ylim=(0, 1.02), xscale="log")
        ax.grid(alpha=0.3)
        if len(latencies) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    files += _save(fig, out, "latency_cdf", latencies)

    if sweep:
        c = [p["concurrency"] for p in sweep]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        a1.plot(c, [p["serve"]["output_token_throughput"] for p in sweep], "o-", label="output tok/s")
        a1.set(title="throughput", xlabel="concurrency (streams in flight)", ylabel="output tokens / s", xscale="log")
        r = a1.twinx()
        r.plot(c, [p["serve"]["request_throughput"] for p in sweep], "s--", color="tab:orange", label="requests/s")
        r.set_ylabel("requests / s")
        a1.legend(loc="upper left", fontsize=8)
        r.legend(loc="lower right", fontsize=8)
        for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e")):
            for q, style in (("p50", "o-"), ("p99", "x:")):
                a2.plot(c, [p["serve"]["latency_ms"][key][q] for p in sweep], style, label=f"{name} {q}")
        a2.set(title="latency", xlabel="concurrency (streams in flight)", ylabel="ms", xscale="log", yscale="log")
        a2.legend(fontsize=7, ncol=3)
        for ax in (a1, a2):
            ax.set_xticks(c, [str(x) for x in c])
            ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=10)
        files += _save(fig, out, "concurrency", {"points": [{"concurrency": p["concurrency"], **{
            k: p["serve"][k] for k in ("output_token_throughput", "request_throughput", "latency_ms")}}
            for p in sweep]})

    if timeline is not None and timeline["t_s"]:
        t = timeline["t_s"]
        fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
        axes[0].plot(t, timeline["running"], label="running")
        axes[0].plot(t, timeline["waiting"], label="waiting")
        axes[0].set(ylabel="sequences")
        axes[0].legend(fontsize=8)
        axes[1].plot(t, [100 * u for u in timeline["kv_usage"]], color="tab:green")
        axes[1].set(ylabel="KV cache used (%)", ylim=(0, 101))
        axes[2].plot(t, timeline["output_tok_s"], color="tab:red")
        axes[2].set(ylabel="output tok/s", xlabel="seconds since the start")
        for ax in axes:
            ax.grid(alpha=0.3)
            for m in timeline["marks"]:
                ax.axvline(m["t_s"], color="gray", lw=0.8, ls="--")
        for m in timeline["marks"]:
            axes[0].annotate(m["label"], (m["t_s"], 1), xycoords=("data", "axes fraction"), fontsize=7,
                             rotation=90, va="top", ha="right")
        fig.suptitle(title, fontsize=10)
        files += _save(fig, out, "timeline", timeline)
    return files
