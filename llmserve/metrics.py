"""Measurements the engine takes: per step, per request, and the rolling snapshot.

The engine fills StepMetrics / RequestMetrics and hands them to every metric sink; the
MetricsCollector here keeps what `metrics_snapshot()` and `/stats` report.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class StepMetrics:
    """One engine step."""

    step: int
    timestamp: float  # time.time() at the end of the step
    batch_size: int  # sequences scheduled
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int  # preemptions in this step
    step_seconds: float
    backend_seconds: float  # forward + sampling
    overhead_seconds: float  # scheduler + allocator + bookkeeping (step - backend)
    kv_cache_usage: float  # used blocks / total blocks
    prefix_cache_queries: int  # prompt tokens looked up in this step
    prefix_cache_hits: int  # of those, served from the cache
    num_output_tokens: int = 0  # tokens sampled in this step (what "output tok/s" counts while requests run)
    num_forwards: int = 1  # forwards the backend ran (llmserve.batch.Forwards): a decode's time is step / this

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RequestMetrics:
    """One sequence, reported once when it ends."""

    request_id: str
    index: int
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    queue_seconds: float | None  # arrival → first scheduled
    ttft_seconds: float | None  # arrival → first output token
    e2e_seconds: float  # arrival → end
    inter_token_latencies: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return sorted_values[lo]
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """count, mean, p50, p90, p95, p99 and max of values."""
    s = sorted(values)
    return {"count": len(s), "mean": (sum(s) / len(s)) if s else None,
            **{f"p{q}": percentile(s, q) for q in (50, 90, 95, 99)}, "max": s[-1] if s else None}


class MetricsCollector:
    """Keeps counters and a bounded window of recent samples for the engine's snapshot."""

    def __init__(self, window: int = 10_000):
        self.ttft: deque[float] = deque(maxlen=window)
        self.queue: deque[float] = deque(maxlen=window)
        self.e2e: deque[float] = deque(maxlen=window)
        self.itl: deque[float] = deque(maxlen=window * 4)
        self.step_overhead: deque[float] = deque(maxlen=window)
        self.step_backend: deque[float] = deque(maxlen=window)
        self.batch_sizes: deque[int] = deque(maxlen=window)
        self.steps = 0
        self.requests_finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.decode_tokens = 0  # counted per step, so a rate read from it moves while requests run
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.step_tokens = {"prefill": 0, "decode": 0, "output": 0}  # totals over steps: live rates need no finish

    def on_step(self, m: StepMetrics) -> None:
        self.steps += 1
        self.step_overhead.append(m.overhead_seconds)
        self.step_backend.append(m.backend_seconds)
        self.batch_sizes.append(m.batch_size)
        self.decode_tokens += m.num_decode_tokens
        self.preemptions += m.num_preempted
        self.prefix_cache_queries += m.prefix_cache_queries
        self.prefix_cache_hits += m.prefix_cache_hits
        for k, n in (("prefill", m.num_prefill_tokens), ("decode", m.num_decode_tokens), ("output", m.num_output_tokens)):
            self.step_tokens[k] += n

    def on_request_finished(self, m: RequestMetrics) -> None:
        self.requests_finished[m.finish_reason or "error"] += 1
        self.prompt_tokens += m.num_prompt_tokens
        self.generation_tokens += m.num_output_tokens
        if m.ttft_seconds is not None:
            self.ttft.append(m.ttft_seconds)
        if m.queue_seconds is not None:
            self.queue.append(m.queue_seconds)
        self.e2e.append(m.e2e_seconds)
        self.itl.extend(m.inter_token_latencies)

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "requests_finished": dict(self.requests_finished),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "decode_tokens": self.decode_tokens,
            "preemptions": self.preemptions,
            "step_tokens": dict(self.step_tokens),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": (self.prefix_cache_hits / self.prefix_cache_queries)
            if self.prefix_cache_queries else 0.0,
            "latency_seconds": {k: summarize(getattr(self, k)) for k in ("queue", "ttft", "itl", "e2e")},
            "step_seconds": {"overhead": summarize(self.step_overhead), "backend": summarize(self.step_backend)},
            "batch_size": summarize([float(b) for b in self.batch_sizes]),
        }
