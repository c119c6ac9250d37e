"""An example third-party llmserve plugin: the "sjf" scheduler, the "simple" KV cache, the "csv" sink, `llmserve csv-report`.

llmserve finds this module through the entry point in pyproject.toml and registers the
@hookimpl functions below. Each hook only hands llmserve a name and a factory; llmserve calls
the factory when a config picks that name.
"""

from __future__ import annotations

from llmserve.config import check_options
from llmserve.hookspecs import hookimpl

__version__ = "0.1.0"

SJF_OPTIONS = {"respect_priority": False}
CSV_OPTIONS = {"path": "llmserve-requests.csv", "append": True, "flush_every": 16}


def build_sjf(config, allocator):
    """scheduler factory: the shared scheduler settings come from config.scheduler, ours from its options."""
    from llmserve_example_plugin.sjf import ShortestJobFirstScheduler

    s = config.scheduler
    o = check_options(s.options, SJF_OPTIONS, "scheduler.options (sjf)")
    return ShortestJobFirstScheduler(
        allocator,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enable_chunked_prefill=s.enable_chunked_prefill,
        respect_priority=bool(o["respect_priority"]),
    )


def build_simple_cache(config, num_blocks):
    """cache-allocator factory: the engine says how many blocks the backend's memory holds."""
    from llmserve_example_plugin.simple_cache import SimplePrefixCache

    check_options(config.cache.options, {}, "cache.options (simple)")
    return SimplePrefixCache(num_blocks, config.cache.block_size)


def build_csv(config, options):
    """metric-sink factory: `options` is this sink's `options:` mapping from metrics.sinks."""
    from llmserve_example_plugin.csv_sink import CsvSink

    o = check_options(options, CSV_OPTIONS, "metrics.sinks[csv].options")
    return CsvSink(str(o["path"]), append=bool(o["append"]), flush_every=int(o["flush_every"]))


@hookimpl
def register_schedulers(register):
    """Register shortest-job-first as "sjf"."""
    register("sjf", build_sjf)


@hookimpl
def register_cache_allocators(register):
    """Register the exact-prefix KV cache as "simple"."""
    register("simple", build_simple_cache)


@hookimpl
def register_metric_sinks(register):
    """Register the per-request CSV writer as "csv"."""
    register("csv", build_csv)


@hookimpl
def register_commands(subparsers):
    """Add `llmserve csv-report FILE [--json]`."""
    p = subparsers.add_parser("csv-report", help="latency percentiles from a CSV written by the csv sink")
    p.add_argument("path", help="the CSV file (metrics.sinks: [{name: csv, options: {path: ...}}])")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def run(args):
        from llmserve_example_plugin.report import run as report

        return report(args)

    p.set_defaults(func=run)
