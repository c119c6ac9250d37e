#!/usr/bin/env python
"""Served throughput against `llmserve bench offline`, same machine, same run, rounds alternated.

For each model shape (random weights), each torch thread count and each concurrency, one
round runs, back to back: `llmserve bench offline` (the engine loaded and stepped on one
thread, no HTTP), then `llmserve bench serve` against a running `llmserve serve` with the light
httpx client, then with the official openai SDK client. The server is started once per shape
and thread count and stays idle while the offline bench runs. Concurrency 1 runs the offline
bench with max_num_seqs 1 (one sequence a step, as one client produces).

    python benchmarks/serve_vs_offline.py                         # both shapes, c = 64 and 1
    python benchmarks/serve_vs_offline.py --shapes gpt2 --threads 2 1 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapes import SHAPES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SHAPES = ["gpt2", "smollm2-135m"]


def save_shape(name: str, root: Path) -> Path:
    """A directory holding only the shape's config.json (the weights are seeded random: load_format dummy)."""
    from transformers import AutoConfig

    cfg = dict(SHAPES[name])
    d = root / name
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(d)
    return d


def engine_flags(model_dir: Path, dtype: str, threads: int, max_num_seqs: int) -> list[str]:
    # no prefix caching: each client run on the one server would otherwise find the previous
    # run's prompts cached, while every offline run starts cold
    return ["--model", str(model_dir), "--load-format", "dummy", "--dtype", dtype, "--threads", str(threads),
            "--set", "tokenizer.name=none", "--kv-cache-memory", "1GiB", "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", "2048", "--no-prefix-caching"]


def _cli(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    p = subprocess.run([sys.executable, "-m", "llmserve", "--log-level", "warning", *args, "--json",
                        "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llmserve {' '.join(args[:2])} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    from llmserve_bench.serve import launch_server

    return launch_server(flags, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"})


def workload(requests: int) -> list[str]:
    return ["--requests", str(requests), "--prompt-len", "16", "128", "--output-len", "128", "128"]


def run(args: argparse.Namespace) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            d = save_shape(shape, Path(tmp))
            for threads in args.threads:
                proc, url = start_server(engine_flags(d, args.dtype, threads, 64))
                try:
                    for c in args.concurrency:
                        n = args.requests if c > 1 else args.requests_c1
                        for rnd in range(args.rounds):
                            seed = ["--workload-seed", str(rnd)]
                            off = _cli("bench", "offline", *engine_flags(d, args.dtype, threads, min(c, 64)),
                                       *workload(n), *seed)
                            row = {"shape": shape, "dtype": args.dtype, "threads": threads, "concurrency": c,
                                   "round": rnd, "requests": n, "offline_tok_s": off["output_token_throughput"],
                                   "offline_itl_p50_ms": off["latency_ms"]["itl"]["p50"],
                                   "offline_threads": off["threads"]}
                            for client in args.clients:
                                srv = _cli("bench", "serve", "--base-url", url, "--concurrency", str(c),
                                           "--client", client, *workload(n), *seed)
                                s = srv["serve"]
                                assert s["failed"] == 0, s["errors"]
                                row[f"serve_{client}_tok_s"] = s["output_token_throughput"]
                                row[f"serve_{client}_itl_p50_ms"] = s["latency_ms"]["itl"]["p50"]
                                row[f"ratio_{client}"] = s["output_token_throughput"] / off["output_token_throughput"]
                                row["server_threads"] = srv["server"].get("threads")
                            rows.append(row)
                            if not args.json:
                                print(_line(row, args.clients), flush=True)
                finally:
                    proc.terminate()
                    proc.wait(60)
    from llmserve_bench.report import machine_info

    return {"machine": machine_info(), "rows": rows}


def _line(r: dict, clients: list[str]) -> str:
    parts = [f"{r['shape']:<13} {r['dtype']} threads {r['threads']} c={r['concurrency']:<3} round {r['round']}: "
             f"offline {r['offline_tok_s']:7.1f} tok/s (ITL p50 {r['offline_itl_p50_ms']:.1f} ms)"]
    for c in clients:
        parts.append(f"serve/{c} {r[f'serve_{c}_tok_s']:7.1f} (ITL {r[f'serve_{c}_itl_p50_ms']:.1f}) "
                     f"ratio {r[f'ratio_{c}']:.3f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 where the CPU has AVX512_BF16, else float32")
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1], help="torch threads to try")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--requests", type=int, default=64, help="requests at concurrency > 1")
    ap.add_argument("--requests-c1", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--clients", nargs="+", default=["raw", "openai"], choices=["raw", "httpx", "openai"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
    raise SystemExit(main())
