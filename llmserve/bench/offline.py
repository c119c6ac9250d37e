"""`llmserve bench offline`: a seeded synthetic workload run through the engine, no HTTP.

Reports latency (queue, TTFT, ITL, e2e), throughput, batch sizes, KV-cache utilization and
fragmentation, prefix-cache hit rate, and the engine's own overhead per step (everything but
the backend's forward and sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from llmserve.errors import ConfigError
from llmserve.metrics import summarize

# the bench defaults to the fake backend: it measures the engine, not a model
BENCH_DEFAULTS = {
    "backend": {"name": "fake"},
    "tokenizer": {"name": "none"},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Workload and output flags."""
    p.add_argument("--requests", type=int, default=1000, help="number of requests")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output lengths (max_tokens, EOS ignored), uniform in [MIN, MAX]")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="every prompt starts with the same TOKENS-token system prompt")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second (0: all requests arrive at once)")
    p.add_argument("--priorities", type=int, default=1, help="draw priorities from 0..N-1 (policy priority)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(slots=True)
class Item:
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival: float  # seconds after the start


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Item]:
    """The seeded synthetic requests."""
    rng = random.Random(args.workload_seed)
    top = min(vocab_size, 50000) - 1
    prefix = [rng.randint(0, top) for _ in range(args.shared_prefix)]
    items, t = [], 0.0
    for _ in range(args.requests):
        n = rng.randint(*args.prompt_len)
        body = [rng.randint(0, top) for _ in range(n)]
        if args.request_rate > 0:
            t += rng.expovariate(args.request_rate)
        items.append(Item(prefix + body, rng.randint(*args.output_len), rng.randrange(args.priorities), t))
    return items


def machine_info() -> dict[str, Any]:
    """The facts a figure needs next to it."""
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def thread_layout(engine) -> dict[str, Any]:
    """Which thread loaded the engine, which stepped it, and torch's thread count (a figure needs it beside it)."""
    return {**engine.threads.layout(), "torch_threads": engine.backend.describe().get("threads")}


def run(args: argparse.Namespace, config) -> dict[str, Any]:
    """Build an engine from config, run the workload, return the report."""
    from llmserve.engine import Engine
    from llmserve.request import SamplingParams

    engine = Engine.from_config(config)
    items = make_workload(args, engine.backend.vocab_size)
    max_len = engine.max_model_len
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(items), unit="req", desc="bench offline", file=sys.stderr)

    overhead, overhead_full, backend_s, batch_sizes = [], [], [], []
    peak_usage = peak_int = peak_ext = 0.0
    out_tokens = prompt_tokens = 0
    completed = failed = 0
    errors: dict[str, int] = {}
    full = engine.scheduler_stats().max_num_seqs or config.scheduler.max_num_seqs
    start = time.perf_counter()
    pending = sorted(items, key=lambda it: it.arrival)
    nxt = 0
    steps = 0
    prefill_computed = 0
    while nxt < len(pending) or engine.has_unfinished:
        now = time.perf_counter() - start
        while nxt < len(pending) and pending[nxt].arrival <= now:
            it = pending[nxt]
            mt = max(1, min(it.max_tokens, max_len - len(it.prompt))) if len(it.prompt) < max_len else 1
            engine.add_request(it.prompt, SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True,
                                                         detokenize=False),
                               priority=it.priority, arrival_time=start + it.arrival)
            nxt += 1
        if not engine.has_unfinished:
            time.sleep(min(0.01, max(0.0, pending[nxt].arrival - now)))
            continue
        so = engine.step()
        steps += 1
        for o in so.outputs:
            out_tokens += len(o.new_token_ids)
            if o.finished:
                if o.error:
                    failed += 1
                    errors[o.error[:120]] = errors.get(o.error[:120], 0) + 1
                else:
                    completed += 1
                    prompt_tokens += o.num_prompt_tokens
                if bar is not None:
                    bar.update(1)
        m = so.metrics
        if m is not None and m.batch_size:
            overhead.append(m.overhead_seconds)
            backend_s.append(m.backend_seconds)
            batch_sizes.append(m.batch_size)
            prefill_computed += m.num_prefill_tokens
            if m.batch_size >= full:
                overhead_full.append(m.overhead_seconds)
            peak_usage = max(peak_usage, m.kv_cache_usage)
        # fragmentation is read between steps so its cost is not counted as engine overhead
        c = engine.scheduler_stats().cache
        peak_int = max(peak_int, c.internal_fragmentation)
        peak_ext = max(peak_ext, c.external_fragmentation)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()

    snap = engine.metrics_snapshot()
    cache = engine.scheduler_stats().cache
    ms = lambda d: {k: (v * 1e3 if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    total_prompt = sum(len(it.prompt) for it in items)
    report = {
        "workload": {
            "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "shared_prefix": args.shared_prefix, "request_rate": args.request_rate,
            "workload_seed": args.workload_seed,
        },
        "config": {
            "backend": config.backend.name, "model": config.model.model, "scheduler": config.scheduler.name,
            "policy": config.scheduler.policy, "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "cache": config.cache.name, "block_size": config.cache.block_size, "num_blocks": cache.num_blocks,
            "prefix_caching": config.cache.enable_prefix_caching,
        },
        "backend": engine.backend.describe(),
        "threads": thread_layout(engine),
        "machine": machine_info(),
        "completed": completed,
        "failed": failed,
        "errors": errors,
        "elapsed_s": elapsed,
        "steps": steps,
        "request_throughput": completed / elapsed if elapsed else 0.0,
        "output_token_throughput": out_tokens / elapsed if elapsed else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / elapsed if elapsed else 0.0,
        "output_tokens": out_tokens,
        "latency_ms": {k: ms(v) for k, v in snap["latency_seconds"].items()},
        "batch_size": {"mean": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
                       "max": max(batch_sizes, default=0), "max_num_seqs": full},
        "engine_overhead_ms": {"all_steps": ms(summarize(overhead)),
                               f"steps_with_{full}_running": ms(summarize(overhead_full))},
        "backend_ms": ms(summarize(backend_s)),
        "kv_cache": {
            "peak_utilization": peak_usage,
            "peak_internal_fragmentation": peak_int,
            "peak_external_fragmentation": peak_ext,
            "preemptions": snap["preemptions"],
            "blocks_total": cache.num_blocks,
            "blocks_used_at_end": cache.used_blocks,
            "all_blocks_free_at_end": cache.used_blocks == 0,
        },
        "prefix_cache": {
            "hit_rate": cache.prefix_hit_rate,
            "queried_tokens": cache.prefix_queries,
            "hit_tokens": cache.prefix_hits,
            "prompt_tokens_total": total_prompt,
            # prefill work actually done: recomputation after preemption adds to it, cache hits save
            "prefill_tokens_computed": prefill_computed,
            "prefill_reduction": 1.0 - prefill_computed / total_prompt if total_prompt else 0.0,
        },
    }
    engine.shutdown()
    return report


def format_threads(t: dict[str, Any]) -> str:
    """One line: load thread, step thread(s), torch threads."""
    return (f"threads: loaded on {t['load_thread']}, stepped on {', '.join(t['step_threads']) or '-'}"
            f"{'' if t['one_thread'] else ' (NOT the loading thread: torch runs slower)'}, "
            f"torch threads {t['torch_threads'] if t['torch_threads'] is not None else '-'}")


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def print_report(r: dict[str, Any]) -> None:
    """A human-readable table."""
    w = r["workload"]
    c = r["config"]
    print(f"llmserve bench offline — {w['requests']} requests, prompt {w['prompt_len']}, output {w['output_len']}, "
          f"shared prefix {w['shared_prefix']}, seed {w['workload_seed']}")
    print(f"  backend {c['backend']} ({c['model']}), scheduler {c['scheduler']}/{c['policy']}, max_num_seqs "
          f"{c['max_num_seqs']}, budget {c['max_num_batched_tokens']} tok, {c['num_blocks']}×{c['block_size']} blocks")
    print(f"  machine: {r['machine'].get('cpu', '?')}, {r['machine']['cpus']} cpus, python {r['machine']['python']}")
    print(f"  {format_threads(r['threads'])}")
    print(f"completed {r['completed']}  failed {r['failed']}  in {r['elapsed_s']:.2f}s over {r['steps']} steps")
    print(f"throughput: {r['request_throughput']:.1f} req/s, {r['output_token_throughput']:.0f} output tok/s, "
          f"{r['total_token_throughput']:.0f} total tok/s")
    print(f"batch size: mean {r['batch_size']['mean']:.1f}, max {r['batch_size']['max']} (max_num_seqs {r['batch_size']['max_num_seqs']})")
    print("latency (ms)        mean      p50      p95      p99")
    for k in ("queue", "ttft", "itl", "e2e"):
        d = r["latency_ms"][k]
        print(f"  {k:<12} {_fmt(d['mean']):>9} {_fmt(d['p50']):>8} {_fmt(d['p95']):>8} {_fmt(d['p99']):>8}")
    for k, d in r["engine_overhead_ms"].items():
        print(f"engine overhead per step, {k.replace('_', ' ')} (ms): p50 {_fmt(d['p50'])}  p99 {_fmt(d['p99'])}  "
              f"(n={d['count']})")
    kv = r["kv_cache"]
    print(f"kv cache: peak utilization {kv['peak_utilization']:.1%}, peak internal fragmentation "
          f"{kv['peak_internal_fragmentation']:.1%}, peak external fragmentation {kv['peak_external_fragmentation']:.1%}, "
          f"preemptions {kv['preemptions']}, blocks used at end {kv['blocks_used_at_end']}/{kv['blocks_total']}")
    pc = r["prefix_cache"]
    print(f"prefix cache: hit rate {pc['hit_rate']:.1%}; prefill tokens computed {pc['prefill_tokens_computed']} of "
          f"{pc['prompt_tokens_total']} prompt tokens ({pc['prefill_reduction']:+.1%} saved; recompute after preemption counts)")


def bench_config(args: argparse.Namespace):
    """The engine config: file and flags over the bench defaults; a model flag means a backend that loads it."""
    from llmserve.cli import config_from_args

    model_flag = getattr(args, "cfg_model__model", None)
    defaults = BENCH_DEFAULTS
    if model_flag is not None:  # the fake default would ignore the model and report made-up figures
        defaults = {k: v for k, v in BENCH_DEFAULTS.items() if k != "backend"}
    config = config_from_args(args, defaults=defaults)
    if model_flag is not None and config.backend.name == "fake":
        raise ConfigError(f"--model {model_flag!r} names a checkpoint, but the backend is 'fake', which loads "
                          "none: drop --backend fake (or backend.name: fake in the config file)")
    return config


def main(args: argparse.Namespace) -> int:
    """Entry point of `llmserve bench offline`."""
    config = bench_config(args)
    report = run(args, config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["failed"] == 0 else 1
