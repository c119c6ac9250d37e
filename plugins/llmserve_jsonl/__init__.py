"""Default metric sink plugin: JSON lines, one object per step and per finished request."""

from __future__ import annotations

import json
import sys
from typing import IO

from llmserve.hookspecs import hookimpl
from llmserve.interfaces import MetricSink


class JsonLinesSink(MetricSink):
    """Writes {"event": "step"|"request", ...} lines to a file (or stderr with path "-")."""

    def __init__(self, path: str = "llmserve-metrics.jsonl", steps: bool = True, flush_every: int = 64):
        self.path = path
        self.steps = steps
        self.flush_every = flush_every
        self._fh: IO[str] = sys.stderr if path == "-" else open(path, "a", buffering=1 << 16)
        self._pending = 0

    def _write(self, obj: dict) -> None:
        self._fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self.flush_every:  # buffered: a write per step would cost more than the step
            self._fh.flush()
            self._pending = 0

    def on_step(self, metrics) -> None:
        if self.steps:
            self._write({"event": "step", **metrics.to_dict()})

    def on_request_finished(self, metrics) -> None:
        self._write({"event": "request", **metrics.to_dict()})

    def close(self) -> None:
        self._fh.flush()
        if self._fh is not sys.stderr:
            self._fh.close()


def _build(config, options) -> JsonLinesSink:
    from llmserve.config import check_options

    o = check_options(options, {"path": "llmserve-metrics.jsonl", "steps": True, "flush_every": 64},
                      "metrics.sinks[jsonl].options")
    return JsonLinesSink(str(o["path"]), bool(o["steps"]), int(o["flush_every"]))


@hookimpl
def register_metric_sinks(register):
    """Register the JSON-lines sink as "jsonl" (options: path, steps, flush_every)."""
    register("jsonl", _build)
