"""`llmserve bench offline`: a seeded synthetic workload run through the engine, no HTTP.

Reports latency (queue, TTFT, ITL, e2e), throughput, batch sizes, KV-cache utilization and
fragmentation, prefix-cache hit rate, the engine's own overhead per step (everything but
the backend's forward and sampling), and decode step time against the machine's bound
(bound.py). `drive` is also the offline side of `bench serve --compare-offline`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from llmserve_bench.bound import bound_report, print_decode_bound, probe_before
from llmserve_bench.report import Result, Timing, fmt, format_threads, in_ms, machine_info, print_run, \
    progress_bar, summarize_results
from llmserve_bench.workload import Item, add_workload_arguments, make_workload, workload_facts
from llmserve.config_args import add_config_arguments, config_from_args
from llmserve.errors import ConfigError
from llmserve.metrics import summarize

# the bench defaults to the fake backend: it measures the engine, not a model
BENCH_DEFAULTS = {
    "backend": {"name": "fake"},
    "tokenizer": {"name": "none"},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Config, workload and output flags."""
    add_config_arguments(p)
    add_workload_arguments(p, requests=1000, prompt_len=[16, 256], output_len=[16, 256])
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second (0: all requests arrive at once)")
    p.add_argument("--priorities", type=int, default=1, help="draw priorities from 0..N-1 (policy priority)")
    p.add_argument("--n", type=int, default=1, help="completions per request (n > 1 shares the prompt's KV)")
    p.add_argument("--no-bound", action="store_true",
                   help="skip the bandwidth and GEMM probes and the decode step vs bound table")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="write latency CDFs and a timeline of running, waiting, KV usage and tok/s sampled between "
                        "steps, as PNG + JSON (needs matplotlib)")


def thread_layout(engine) -> dict[str, Any]:
    """Which thread loaded the engine, which stepped it, and torch's thread count (a figure needs it beside it)."""
    return {**engine.threads.layout(), "torch_threads": engine.backend.describe().get("threads")}


def drive(engine, items: list[Item], concurrency: int, bar, detokenize: bool = True,
          on_step: Callable[[Any], None] | None = None, n: int = 1) -> tuple[list[Result], float]:
    """Step `engine` until every item is done: each added at its arrival, at most `concurrency` in flight.

    Call it on the thread that built `engine`, exactly as `bench offline` and the server's engine
    thread do: stepping a torch engine from any other thread runs at ~0.6x (llmserve/threads.py),
    which made earlier serve/offline ratios compare two slowed paths.
    """
    from llmserve.request import SamplingParams

    pending = sorted(items, key=lambda it: it.arrival)  # stable: the same arrival keeps the order
    nxt = 0
    results: list[Result] = []
    live: dict[tuple[str, int], Timing] = {}  # per sequence: n of them per request
    start = time.perf_counter()
    while nxt < len(pending) or live:
        now = time.perf_counter()
        while nxt < len(pending) and len(live) < concurrency and pending[nxt].arrival <= now - start:
            it = pending[nxt]
            # the engine caps max_tokens at its context, and fails a prompt that fills it
            sp = SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True, detokenize=detokenize, n=n)
            rid = engine.add_request(it.prompt, sp, priority=it.priority, arrival_time=start + it.arrival)
            live.update({(rid, i): Timing(now) for i in range(n)})
            nxt += 1
        if not live:  # idle until the next arrival
            time.sleep(min(0.01, max(0.0, pending[nxt].arrival - (now - start))))
            continue
        so = engine.step()
        now = time.perf_counter()
        for o in so.outputs:
            timing = live.get((o.request_id, o.index))
            if timing is None:
                continue
            if o.new_token_ids:
                timing.token(now)
            if o.finished:
                del live[o.request_id, o.index]
                results.append(Result(False, error=o.error) if o.error else
                               timing.result(now, o.num_output_tokens, o.num_prompt_tokens))
                bar.update(1)
        if on_step is not None:
            on_step(so)
    elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def run(args: argparse.Namespace, config) -> dict[str, Any]:
    """Build an engine from config, run the workload, return the report."""
    from llmserve.engine import Engine

    engine = Engine.from_config(config)
    items = make_workload(args, engine.backend.vocab_size)
    full = engine.scheduler_stats().max_num_seqs or config.scheduler.max_num_seqs
    ran: list = []  # the metrics of the steps that ran a batch
    decodes: list[tuple[int, int, float]] = []  # decode-only steps: batch, context tokens read, step seconds
    peak = {"internal": 0.0, "external": 0.0}
    steps = 0
    timeline = None
    if args.plot:
        from llmserve_bench.plot import Timeline

        timeline = Timeline(None, interval=0.01, window=0.1)  # sampled between steps below, not by its thread
    generated = 0
    before = probe_before(engine.backend.describe(), full, args.no_bound)  # the machine drifts: probe it twice

    def on_step(so) -> None:
        nonlocal steps
        steps += 1
        m = so.metrics
        if m is not None and m.batch_size:
            ran.append(m)
            # each forward of a decode step put out a token a sequence and read its context: prompt + outputs before
            # it (a step of f forwards: their mean context, and the step's time over f)
            if m.num_prefill_tokens == 0 and len(so.outputs) == m.batch_size:
                f = m.num_forwards
                ctx = sum(o.num_prompt_tokens + o.num_output_tokens - 1 for o in so.outputs) - m.batch_size * (f - 1) / 2
                decodes.append((m.batch_size, round(ctx), m.step_seconds / f))
        # read between steps, so its cost is not counted as engine overhead
        st = engine.scheduler_stats()
        c = st.cache
        peak["internal"] = max(peak["internal"], c.internal_fragmentation)
        peak["external"] = max(peak["external"], c.external_fragmentation)
        if timeline is not None:
            nonlocal generated
            generated += sum(len(o.new_token_ids) for o in so.outputs)
            s = timeline.samples
            if not s or time.perf_counter() - timeline.t0 - s[-1]["t"] >= timeline.interval:
                timeline.add(st.num_running, st.num_waiting, c.usage, generated)

    results, elapsed = drive(engine, items, len(items) * args.n,
                             progress_bar(args, len(items) * args.n, "bench offline"), detokenize=False,
                             on_step=on_step, n=args.n)
    snap = engine.metrics_snapshot()
    desc = engine.backend.describe()
    bound = bound_report(decodes, desc, args.no_bound, before)  # probes on the engine's thread: its torch threads
    cache = engine.scheduler_stats().cache
    total_prompt = sum(len(it.prompt) for it in items) * args.n  # every sequence's prompt: the fan-out total
    summary = summarize_results(results, elapsed)
    prompt_tokens = sum(r.prompt_tokens for r in results if r.ok)
    batch_sizes = [m.batch_size for m in ran]
    prefill_computed = sum(m.num_prefill_tokens for m in ran)
    report = {
        "workload": {**workload_facts(args), "request_rate": args.request_rate, "priorities": args.priorities,
                     "n": args.n},
        "config": {
            "backend": config.backend.name, "model": config.model.model, "scheduler": config.scheduler.name,
            "policy": config.scheduler.policy, "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "cache": config.cache.name, "block_size": config.cache.block_size, "num_blocks": cache.num_blocks,
            "prefix_caching": config.cache.enable_prefix_caching,
        },
        "backend": desc,
        "threads": thread_layout(engine),
        "machine": machine_info(),
        **summary,
        "steps": steps,
        "total_token_throughput": (summary["output_tokens"] + prompt_tokens) / elapsed if elapsed else 0.0,
        # the engine's own figures, which count from each request's arrival and add the queue
        "latency_ms": {k: in_ms(v) for k, v in snap["latency_seconds"].items()},
        "batch_size": {"mean": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
                       "max": max(batch_sizes, default=0), "max_num_seqs": full},
        "engine_overhead_ms": {
            "all_steps": in_ms(summarize([m.overhead_seconds for m in ran])),
            f"steps_with_{full}_running": in_ms(summarize([m.overhead_seconds for m in ran if m.batch_size >= full])),
        },
        "backend_ms": in_ms(summarize([m.backend_seconds for m in ran])),
        "decode_bound": bound,
        "kv_cache": {
            "peak_utilization": max((m.kv_cache_usage for m in ran), default=0.0),
            "peak_internal_fragmentation": peak["internal"],
            "peak_external_fragmentation": peak["external"],
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
    if args.plot:
        from llmserve_bench.plot import latency_data, write_plots

        title = (f"llmserve bench offline: {config.backend.name} backend"
                 f"{'' if config.backend.name == 'fake' else f' ({config.model.model})'}, {args.requests} requests "
                 f"at once, prompt {args.prompt_len}, output {args.output_len}, max_num_seqs {full}")
        report["plots"] = write_plots(args.plot, title, {"engine": latency_data(results)}, timeline.data())
    return report


def print_report(r: dict[str, Any]) -> None:
    """A human-readable table."""
    w = r["workload"]
    c = r["config"]
    print(f"llmserve bench offline — {w['requests']} requests, prompt {w['prompt_len']}, output {w['output_len']}, "
          f"shared prefix {w['shared_prefix']}, seed {w['workload_seed']}")
    if c["backend"] == "fake":  # what the figures mean: no model runs, so they are the engine's own costs
        print("  measures the engine (scheduler, KV cache, step loop) on the fake backend: no model runs and no HTTP; "
              "--model M for a model")
    model = "" if c["backend"] == "fake" else f" ({c['model']})"  # the fake backend loads none
    print(f"  backend {c['backend']}{model}, scheduler {c['scheduler']}/{c['policy']}, max_num_seqs "
          f"{c['max_num_seqs']}, budget {c['max_num_batched_tokens']} tok, {c['num_blocks']}×{c['block_size']} blocks")
    print(f"  machine: {r['machine'].get('cpu', '?')}, {r['machine']['cpus']} cpus, python {r['machine']['python']}")
    print(f"  {format_threads(r['threads'])}")
    print_run(f"engine ({r['steps']} steps)", r)
    print(f"total throughput {r['total_token_throughput']:.0f} tok/s; batch size: mean {r['batch_size']['mean']:.1f}, "
          f"max {r['batch_size']['max']} (max_num_seqs {r['batch_size']['max_num_seqs']})")
    for k, d in r["engine_overhead_ms"].items():
        print(f"engine overhead per step, {k.replace('_', ' ')} (ms): p50 {fmt(d['p50'])}  p99 {fmt(d['p99'])}  "
              f"(n={d['count']})")
    kv = r["kv_cache"]
    print(f"kv cache: peak utilization {kv['peak_utilization']:.1%}, peak internal fragmentation "
          f"{kv['peak_internal_fragmentation']:.1%}, peak external fragmentation {kv['peak_external_fragmentation']:.1%}, "
          f"preemptions {kv['preemptions']}, blocks used at end {kv['blocks_used_at_end']}/{kv['blocks_total']}")
    pc = r["prefix_cache"]
    print(f"prefix cache: hit rate {pc['hit_rate']:.1%}; prefill tokens computed {pc['prefill_tokens_computed']} of "
          f"{pc['prompt_tokens_total']} prompt tokens ({pc['prefill_reduction']:+.1%} saved; recompute after preemption counts)")
    print_decode_bound(r["decode_bound"])
    for f in r.get("plots", []):
        print(f"plot: {f}")


def bench_config(args: argparse.Namespace):
    """The engine config: file and flags over the bench defaults; a model flag means a backend that loads it."""
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
    if args.plot:
        from llmserve_bench.plot import require_matplotlib

        require_matplotlib()
    report = run(args, bench_config(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["failed"] == 0 else 1
