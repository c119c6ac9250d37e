"""PrometheusSink: turns the engine's step and request metrics into Prometheus series."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmserve.interfaces import MetricSink

CONTENT_TYPE = CONTENT_TYPE_LATEST

# bucket edges in seconds, from sub-millisecond (fake backend) to minutes (long generations)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512)


class PrometheusSink(MetricSink):
    """A metric sink with its own CollectorRegistry; every series carries a model_name label."""

    def __init__(self, model_name: str):
        self._rendered: tuple[float, bytes] | None = None  # (monotonic time, exposition)
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, L = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, L, registry=r).labels(model_name)

        self.ttft = hist("llmserve_time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS)
        self.itl = hist("llmserve_inter_token_latency_seconds", "Time between consecutive output tokens.",
                        _ITL_BUCKETS)
        self.e2e = hist("llmserve_e2e_request_latency_seconds", "Arrival to the end of a sequence.", _E2E_BUCKETS)
        self.queue = hist("llmserve_request_queue_time_seconds", "Arrival to first scheduled.", _TTFT_BUCKETS)
        self.batch = hist("llmserve_batch_size", "Sequences scheduled per engine step.", _BATCH_BUCKETS)
        self.running = gauge("llmserve_num_requests_running", "Sequences holding KV blocks and being computed.")
        self.waiting = gauge("llmserve_num_requests_waiting", "Sequences waiting for admission.")
        self.kv_usage = gauge("llmserve_kv_cache_usage_ratio", "Used KV-cache blocks / all blocks (0..1).")
        self.prompt_tokens = counter("llmserve_prompt_tokens", "Prompt tokens of finished sequences.")
        self.generation_tokens = counter("llmserve_generation_tokens", "Generated tokens of finished sequences.")
        self.prefix_queries = counter("llmserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("llmserve_prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("llmserve_preemptions", "Sequences preempted (blocks freed, recomputed later).")
        self.evictions = counter("llmserve_kv_cache_evictions", "Cached KV blocks evicted for fresh ones (cache.eviction).")
        self._evicted = 0  # the allocator's total at the last stats (it counts since start)
        self._success = Counter("llmserve_request_success", "Sequences that ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._failure = Counter("llmserve_request_failure", "Sequences that failed (backend or request error).",
                                ["model_name"], registry=r).labels(model_name)
        self._success_by_reason: dict[str, Counter] = {}

    def on_step(self, m) -> None:
        """The batch-size histogram and the per-step counters."""
        self.batch.observe(m.batch_size)
        if m.prefix_cache_queries:
            self.prefix_queries.inc(m.prefix_cache_queries)
        if m.prefix_cache_hits:
            self.prefix_hits.inc(m.prefix_cache_hits)
        if m.num_preempted:
            self.preemptions.inc(m.num_preempted)

    def on_scheduler_stats(self, st) -> None:
        """The gauges: set whenever the state changes (steps, aborts), so an idle server shows zeros."""
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.cache.usage)
        if st.cache.evictions > self._evicted:
            self.evictions.inc(st.cache.evictions - self._evicted)
            self._evicted = st.cache.evictions

    def on_request_finished(self, m) -> None:
        """Latency histograms, token counters and the finish-reason counter."""
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        self.e2e.observe(m.e2e_seconds)
        if m.ttft_seconds is not None:
            self.ttft.observe(m.ttft_seconds)
        if m.queue_seconds is not None:
            self.queue.observe(m.queue_seconds)
        for x in m.inter_token_latencies:
            self.itl.observe(x)
        reason = m.finish_reason or "error"
        if reason == "error":
            self._failure.inc()
            return
        child = self._success_by_reason.get(reason)
        if child is None:
            child = self._success_by_reason[reason] = self._success.labels(self.model_name, reason)
        child.inc()

    def render(self, max_age: float = 0.0) -> bytes:
        """The registry in Prometheus' text exposition format, re-rendered at most every max_age seconds."""
        # scrapers polling in a tight loop would otherwise take the event loop from the streams
        now = time.monotonic()
        if self._rendered is None or now - self._rendered[0] >= max_age:
            self._rendered = (now, generate_latest(self.registry))
        return self._rendered[1]


class _ConnectionSnapshot:
    """A collector of one Connections.stats() dict (llmserve/server/connections.py)."""

    def __init__(self, stats: dict, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s, m = self.stats, [self.model_name]
        for key, doc in (("open", "Open HTTP connections (admitted, not yet closed)."),
                         ("idle", "Open HTTP connections with no request in progress."),
                         ("limit", "The cap on open HTTP connections (server.max_connections).")):
            g = GaugeMetricFamily(f"llmserve_http_connections_{key}", doc, labels=["model_name"])
            g.add_metric(m, s[key])
            yield g
        refused = CounterMetricFamily("llmserve_http_connections_refused", "Connections refused at a limit (503/429).",
                                      labels=["model_name", "limit"])
        for limit, n in s["refused"].items():
            refused.add_metric(m + [limit], n)
        yield refused
        for key, doc in (("evicted", "Idle connections closed to make room for a new one."),
                         ("timed_out", "Connections closed by a header, read or first-byte timeout.")):
            c = CounterMetricFamily(f"llmserve_http_connections_{key}", doc, labels=["model_name"])
            c.add_metric(m, s[key])
            yield c


def render_connections(stats: dict, model_name: str) -> bytes:
    """The server's connection counts (Connections.stats()) in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ConnectionSnapshot(stats, model_name))
    return generate_latest(registry)
