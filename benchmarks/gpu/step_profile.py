#!/usr/bin/env python
"""Where a decode step's time goes on a GPU: the graph replay, sampling, the backend's host work, the engine's.

Fills the engine with --batch requests of --context prompt tokens (the Qwen2.5-0.5B shape, random weights), steps
until every one decodes, then times: whole engine steps (wall), backend.execute (synchronized), the captured
graph's replay (CUDA events), the sampler on the graph's logits, and, from an uncaptured run of the same step
under torch.profiler, the GPU time of each kernel.

    python benchmarks/gpu/step_profile.py [--batch 256] [--context 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from llmserve_bench.bound import cuda_seconds  # noqa: E402


def events_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() timed by CUDA events, after one warm-up."""
    times = sorted(cuda_seconds(fn, reps))
    return times[len(times) // 2] * 1e3


def wall_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() followed by a device synchronize."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from vs_hf import make_model_dir

    from llmserve.config import config_from_dict
    from llmserve.engine import Engine
    from llmserve.request import SamplingParams

    tmp = Path(tempfile.mkdtemp())
    engine = Engine.from_config(config_from_dict({
        "model": {"model": str(make_model_dir("qwen2.5-0.5b", tmp)), "dtype": "bfloat16", "device": "cuda",
                  "load_format": "dummy", "max_model_len": 4096},
        "backend": {"name": "torch", "kv_cache_memory": 0.3},
        "scheduler": {"max_num_seqs": args.batch, "max_num_batched_tokens": 16384},
        "tokenizer": {"name": "none"},
    }))
    b = engine.backend
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=args.temperature, max_tokens=400, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(0, 50000, (args.context,), generator=g).tolist(), sp)
    last: dict = {}
    execute = b.execute

    def spy(batch):
        last["batch"] = batch
        return execute(batch)

    b.execute = spy
    while True:  # until a step computes only decodes, all of them
        out = engine.step()
        m = out.metrics
        if m is not None and m.num_prefill_tokens == 0 and m.batch_size == args.batch:
            break
    for _ in range(3):
        engine.step()
    step_wall = wall_ms(engine.step, 30)
    batch = last["batch"]
    b.execute = execute
    exec_ms = wall_ms(lambda: b.execute(batch), 10)  # writes K/V at the same slots again: harmless here
    graphs = b.graphs
    bucket = next(x for x in graphs.buckets if x >= args.batch)
    replay_ms = events_ms(graphs.graphs[bucket].replay, 20)
    logits = graphs.outputs[bucket][:args.batch]
    with torch.inference_mode():
        sample_ms = wall_ms(lambda: b.sampler.sample(logits, batch.requests), 10)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphs._step(bucket)
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda k: -k[1])
    total_kernels = sum(k[1] for k in kernels)
    report = {
        "gpu": torch.cuda.get_device_name(), "batch": args.batch, "context": args.context, "bucket": bucket,
        "engine_step_ms": step_wall, "backend_execute_ms": exec_ms, "graph_replay_ms": replay_ms,
        "sampler_ms": sample_ms, "engine_outside_execute_ms": step_wall - exec_ms,
        "backend_host_ms": exec_ms - replay_ms - sample_ms,
        "eager_step_kernel_ms": total_kernels,
        "kernels": [{"name": k, "ms": ms, "count": c} for k, ms, c in kernels[:25]],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['gpu']}: decode step at batch {args.batch} (bucket {bucket}), {args.context}-token prompts")
    for k in ("engine_step_ms", "backend_execute_ms", "graph_replay_ms", "sampler_ms", "backend_host_ms",
              "engine_outside_execute_ms", "eager_step_kernel_ms"):
        print(f"  {k:28s} {report[k]:8.3f}")
    print("  kernels of one uncaptured step (GPU ms, calls):")
    for k in report["kernels"][:18]:
        print(f"    {k['ms']:7.3f} {k['count']:5d}  {k['name'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
