#!/usr/bin/env python
"""One forward a step against several (scheduler.num_scheduler_steps), alternated in one engine.

The VM this project measures on changes its memory bandwidth minutes apart, so two runs of `bench offline`
compare states more than settings. Here one engine decodes greedy requests at `--concurrency` sequences and its
scheduler's `num_scheduler_steps` is switched between 1 and each `--steps` value every few forwards, so both
see the same machine and the same contexts. Per forward: the step's wall time, the backend's share of it, and the
fused C call's (where the backend runs one).

    python benchmarks/ab_forwards.py                      # c = 1: 1 vs 4 vs 8 forwards a step
    python benchmarks/ab_forwards.py --steps 8 --rounds 200 --json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from profile_step import run_cli, time_calls  # noqa: E402


def build(args):
    from llmserve.config import config_from_dict
    from llmserve.engine import Engine

    return Engine.from_config(config_from_dict({
        "model": {"model": args.model, "dtype": args.dtype},
        "backend": {"name": "torch", "kv_cache_memory": "1GiB"}, "tokenizer": {"name": "none"},
        "scheduler": {"max_num_seqs": args.concurrency, "num_scheduler_steps": max(args.steps)},
    }, "<ab_forwards>"))


def run(args) -> dict:
    from llmserve.request import SamplingParams
    from llmserve_bench.bound import measure_bandwidth
    from llmserve_bench.report import machine_info, progress_bar

    engine = build(args)
    stack = engine.backend.stack
    call_s: list[float] = time_calls(stack) if stack is not None else []  # the C call itself
    rnd = random.Random(args.seed)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def keep_full():  # every seat decoding: new requests' prompts computed outside the timed steps
        while engine.num_running + engine.num_waiting < args.concurrency:
            engine.add_request([rnd.randrange(100, 40000) for _ in range(rnd.randrange(*args.prompt_len))], sp)
        while True:
            so = engine.step()
            if so.metrics is None or so.metrics.num_prefill_tokens == 0:
                return so

    values = [1] + list(args.steps)
    got = {k: {"step": [], "backend": [], "call": []} for k in values}
    sched = engine.scheduler
    bar = progress_bar(args, args.rounds, "ab_forwards")
    bar.unit = "round"
    for r in range(args.rounds):
        bar.update()
        for k in (values if r % 2 == 0 else values[::-1]):
            sched.num_scheduler_steps = k
            done = 0
            while done < max(values):
                keep_full()
                call_s.clear()
                t = time.perf_counter()
                so = engine.step()
                dt = time.perf_counter() - t
                m = so.metrics
                if m is None or m.num_prefill_tokens:
                    continue
                done += m.num_forwards
                if m.num_forwards == k:  # a run cut short by a sequence's max_tokens is not counted
                    got[k]["step"].append(dt / k)
                    got[k]["backend"].append(m.backend_seconds / k)
                    if call_s:
                        got[k]["call"].append(sum(call_s) / k)
    bar.close()
    med = statistics.median
    rows = {k: {f"{n}_ms": med(v) * 1e3 if v else None for n, v in d.items()} | {"forwards_timed": len(d["step"])}
            for k, d in got.items()}
    base = rows[1]["step_ms"]
    for k in values:
        rows[k]["of_one_a_step"] = rows[k]["step_ms"] / base
    engine.shutdown()
    return {"concurrency": args.concurrency, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "rounds": args.rounds, "bandwidth_gbs_after": measure_bandwidth() / 1e9, "machine": machine_info(),
            "by_steps": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", "-c", type=int, default=1)
    ap.add_argument("--steps", type=int, nargs="+", default=[4, 8], help="num_scheduler_steps values against 1")
    ap.add_argument("--rounds", type=int, default=150, help="alternations (each runs max(--steps) forwards a value)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    return run_cli(ap, argv, run, print_report)


def print_report(r: dict) -> None:
    """A row per forwards-a-step value."""
    print(f"c = {r['concurrency']}, {r['rounds']} rounds; bandwidth after: {r['bandwidth_gbs_after']:.1f} GB/s")
    print("forwards a step | step ms / forward | backend | C call | of one a step")
    for k, row in r["by_steps"].items():
        call = "-" if row["call_ms"] is None else f"{row['call_ms']:.3f}"
        print(f"{k:>15} | {row['step_ms']:.3f} | {row['backend_ms']:.3f} | {call} | {row['of_one_a_step']:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
