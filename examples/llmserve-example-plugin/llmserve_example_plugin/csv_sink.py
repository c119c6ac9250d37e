"""A metric sink that appends one CSV row per finished request (spreadsheet- and pandas-friendly)."""

from __future__ import annotations

import csv
import os
import time
from typing import IO

from llmserve.interfaces import MetricSink
from llmserve.metrics import RequestMetrics

# The columns, in order. inter_token_latencies (a list) is summarised as its mean.
COLUMNS = (
    "finished_at",
    "request_id",
    "index",
    "finish_reason",
    "error",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "num_preemptions",
    "queue_seconds",
    "ttft_seconds",
    "e2e_seconds",
    "mean_itl_seconds",
)


class CsvSink(MetricSink):
    """Writes a header once, then a row per finished, failed or aborted sequence."""

    def __init__(self, path: str = "llmserve-requests.csv", append: bool = True, flush_every: int = 16):
        self.path = path
        self.flush_every = max(1, flush_every)
        # a header only when the file starts empty, so appending runs keep one valid table
        fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
        self._fh: IO[str] = open(path, "a" if append else "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._fh)
        if fresh:
            self._writer.writerow(COLUMNS)
        self._unflushed = 0
        self.rows = 0

    def on_request_finished(self, metrics: RequestMetrics) -> None:
        itl = metrics.inter_token_latencies
        self._writer.writerow((
            f"{time.time():.6f}",
            metrics.request_id,
            metrics.index,
            metrics.finish_reason or "",
            metrics.error or "",
            metrics.num_prompt_tokens,
            metrics.num_output_tokens,
            metrics.num_cached_tokens,
            metrics.num_preemptions,
            _fmt(metrics.queue_seconds),
            _fmt(metrics.ttft_seconds),
            _fmt(metrics.e2e_seconds),
            _fmt(sum(itl) / len(itl) if itl else None),
        ))
        self.rows += 1
        self._unflushed += 1
        # buffered: this runs inside the engine's step loop, and a flush per row costs a syscall
        if self._unflushed >= self.flush_every:
            self._fh.flush()
            self._unflushed = 0

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self._fh.close()


def _fmt(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.6f}"
