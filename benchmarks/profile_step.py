#!/usr/bin/env python
"""Where a decode step goes: torch.profiler over decode steps of the default model, per op family.

An engine is built, warmed up and stepped on this one thread (as `llmserve bench offline` does).
`--concurrency` sequences with `--prompt-len`-token prompts are prefilled, then `--warmup` decode
steps run, then `--steps` steps are timed without the profiler and `--steps` more under it; where
the steps run in the fused layers' one C call, `--steps` more are timed by that call's own clocks
around each kernel (the profiler sees the call as one range). The
families are found by wrapping the backend's own functions in record_function ranges for the
profiled steps only (attention, norms, rope, LM head, sampling, step set-up); linears outside them
are the matmul ops by name. Attention and greedy sampling run in the kernel library through
ctypes, invisible to the profiler: their ranges count whole. "python / other" is the step's wall
time minus everything the families account for (the engine, the scheduler, the layer loop, the
profiler's own cost). The bound (plugins/llmserve_bench/bound.py) is printed beside the step.

    python benchmarks/profile_step.py                       # c = 1, the model's auto dtype
    python benchmarks/profile_step.py --dtype float32 --concurrency 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from llmserve_bench.bound import probe, probe_before, step_bound, wants_bound  # noqa: E402
from llmserve_bench.report import machine_info  # noqa: E402

PREFIX = "llmserve::"
# our own int8 matmul (csrc, via ctypes) is invisible to the profiler: under lm_head it counts there, elsewhere
# it lands in python / other. Where every row of a fused step samples, the final norm and the LM head run in the
# fused call (and greedy tokens too: no sampling), so lm_head and sampling read 0 there
FAMILIES = ["fused call (layers; LM head, greedy token)", "linear", "attention", "norm", "norm (+ residual add)",
            "rope", "silu·up", "elementwise & other ops", "sampling", "lm_head", "step set-up"]
LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", "mkldnn::_linear_pointwise",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm"}
NORM_OPS = {"aten::layer_norm", "aten::native_layer_norm"}


def build_engine(args, num_scheduler_steps: int = 1):
    """The engine of args' flags; by default a forward a step: this profiles one forward and the Python around it
    (not a run of several)."""
    from llmserve.config import config_from_dict
    from llmserve.engine import Engine

    model = {"model": args.model, "dtype": args.dtype}
    if args.threads:
        model["threads"] = args.threads
    c = args.concurrency
    return Engine.from_config(config_from_dict({
        "model": model, "backend": {"name": "torch", "kv_cache_memory": "1GiB"}, "tokenizer": {"name": "none"},
        "scheduler": {"max_num_seqs": c, "max_num_batched_tokens": max(2048, c),
                      "num_scheduler_steps": num_scheduler_steps},
    }, "<profile_step>"))


def label(obj, attr: str, family: str) -> None:
    """Run obj.attr inside a record_function range named for its family (an instance attribute shadows the method)."""
    fn = getattr(obj, attr)

    def wrapped(*a, **kw):
        with torch.profiler.record_function(PREFIX + family):
            return fn(*a, **kw)

    setattr(obj, attr, wrapped)


def label_families(backend) -> None:
    model = backend.model
    label(backend, "_metadata", "step set-up")
    label(model, "prepare_step", "step set-up")
    label(backend.attention, "forward", "attention")
    label(backend.sampler, "sample", "sampling")
    label(model, "logits", "lm_head")  # the final norm inside it counts as a norm
    if backend.stack is not None:  # every layer in one call (fused_stack.py): its kernels are not separable here
        label(backend.stack, "forward", "fused call (layers; LM head, greedy token)")
    if model.ops is not None:  # Llama-style models; GPT-2's norms are torch ops, counted by name
        for attr, family in (("add_rms", "norm (+ residual add)"), ("rope", "rope"), ("silu_mul", "silu·up")):
            label(model.ops, attr, family)


def family_times(events) -> tuple[dict[str, float], dict[str, float]]:
    """Microseconds per family: a range counts whole less the ranges nested in it; an op outside every range by name.

    Also the top-level ops outside every range by name (what "elementwise & other ops" is made of)."""
    fam = dict.fromkeys(FAMILIES, 0.0)
    loose: dict[str, float] = {}
    for e in events:
        if e.name.startswith(PREFIX):
            nested = sum(c.cpu_time_total for c in e.cpu_children if c.name.startswith(PREFIX))
            fam[e.name[len(PREFIX):]] += e.cpu_time_total - nested
        elif e.cpu_parent is None:
            f = "linear" if e.name in LINEAR_OPS else "norm" if e.name in NORM_OPS else "elementwise & other ops"
            fam[f] += e.cpu_time_total
            if f == "elementwise & other ops":
                loose[e.name] = loose.get(e.name, 0.0) + e.cpu_time_total
    return fam, loose


def decode_steps(engine, n: int) -> tuple[list[float], int]:
    """Step n times: each step's wall seconds, and the context tokens summed over the steps' sequences."""
    times, ctx = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        so = engine.step()
        times.append(time.perf_counter() - t0)
        m = so.metrics
        if m is None or m.num_prefill_tokens or len(so.outputs) != m.batch_size:
            raise RuntimeError("a step that was not decode-only: raise --max-tokens or lower --steps")
        ctx += sum(o.num_prompt_tokens + o.num_output_tokens - 1 for o in so.outputs)
    return times, ctx


def fused_stages(engine, n: int) -> dict[str, float] | None:
    """Inside the fused layers' one C call, by its own clocks around each kernel: ms per step over n more decode
    steps (not under the profiler), or None where the steps do not run there."""
    from llmserve_torch.fused_stack import STAGES

    stack = engine.backend.stack
    if stack is None:
        return None
    stack.stage_us = torch.zeros(len(STAGES), dtype=torch.float64)
    try:
        decode_steps(engine, n)
        us = stack.stage_us.tolist()
    finally:
        stack.stage_us = None
    return {name: t / n / 1e3 for name, t in zip(STAGES, us)} if sum(us) else None


def run_cli(ap: argparse.ArgumentParser, argv, run, table, progress: bool = True) -> int:
    """ap's arguments with --json (and --no-progress where run draws a bar), then run(args): its report as JSON,
    or table(report) printed."""
    ap.add_argument("--json", action="store_true")
    if progress:
        ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        table(r)
    return 0


def time_calls(stack) -> list[float]:
    """Wrap a fused stack's C call: each call's seconds go onto the list returned (the caller empties it)."""
    fn, took = stack._fn, []

    def timed(*a):
        t = time.perf_counter()
        r = fn(*a)
        took.append(time.perf_counter() - t)
        return r

    stack._fn = timed
    return took


def start_decoding(engine, c: int, prompt_len: int, steps: int, seed: int) -> None:
    """c sequences of random prompt_len-token prompts, prefilled (chunked if need be) until every one decodes, with
    room for `steps` more tokens each."""
    from llmserve.request import SamplingParams

    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(seed)
    for _ in range(c):
        engine.add_request(torch.randint(0, engine.backend.vocab_size, (prompt_len,), generator=g).tolist(), sp)
    while True:
        so = engine.step()
        if so.metrics is not None and so.metrics.num_prefill_tokens == 0:
            break


def run(args) -> dict:
    engine = build_engine(args)
    backend = engine.backend
    c = args.concurrency
    before = probe_before(backend.describe(), c, args.no_bound)  # the machine drifts: probe before and after
    start_decoding(engine, c, args.prompt_len, args.warmup + 3 * args.steps + 1, args.seed)
    decode_steps(engine, args.warmup)
    plain, _ = decode_steps(engine, args.steps)
    label_families(backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled, ctx = decode_steps(engine, args.steps)
    fam, loose = family_times(prof.events())
    stages = fused_stages(engine, args.steps)
    n = args.steps
    wall_ms = sum(profiled) / n * 1e3
    rows = {f: us / n / 1e3 for f, us in fam.items()}
    rows["python / other"] = wall_ms - sum(rows.values())
    desc = backend.describe()
    report = {
        "machine": machine_info(),
        "model": desc["model"], "dtype": desc["dtype"], "linear": desc["linear"], "attention": desc.get("attention"),
        "shape": {k: desc[k] for k in ("layers", "hidden_size", "heads", "kv_heads", "vocab_size")},
        "concurrency": c, "prompt_len": args.prompt_len, "steps": n, "context_per_seq": ctx / n / c,
        "step_ms_p50_without_profiler": sorted(plain)[n // 2] * 1e3,
        "step_ms_mean_without_profiler": sum(plain) / n * 1e3,
        "step_ms_mean_profiled": wall_ms,
        "families_ms": rows,
        "families_pct": {f: ms / wall_ms * 100 for f, ms in rows.items()},
        "top_other_ops_ms": {k: v / n / 1e3 for k, v in sorted(loose.items(), key=lambda kv: -kv[1])[:8]},
        "fused_stages_ms": stages,
    }
    if not wants_bound(desc, args.no_bound):
        p = probe(desc["dtype"], desc["hidden_size"], c, before)
        b = step_bound(desc["weight_bytes"], desc["kv_bytes_per_token"], desc["matmul_params"], c, ctx // n,
                       p.bandwidth, p.gemm_rate)
        step = report["step_ms_p50_without_profiler"]
        report["bound"] = {"bound_ms": b["bound_s"] * 1e3, "memory_ms": b["memory_s"] * 1e3,
                           "compute_ms": b["compute_s"] * 1e3, "binds": b["binds"],
                           "bandwidth_gbs": p.bandwidth / 1e9, "bandwidth_readings_gbs": [x / 1e9 for x in
                                                                                          p.bandwidth_readings],
                           "gemm_gflops": p.gemm_rate / 1e9,
                           "gemm_readings_gflops": [x / 1e9 for x in p.gemm_readings],
                           "step_over_bound": step / (b["bound_s"] * 1e3),
                           "step_read_gbs": b["memory_s"] * p.bandwidth / step * 1e3 / 1e9}
    engine.shutdown()
    return report


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"Where a decode step goes: {r['model']}, {r['dtype']}, c = {r['concurrency']}, "
          f"context ~{r['context_per_seq']:.0f} tokens/seq, {r['steps']} steps profiled")
    print(f"  machine: {m['cpu']}, {m['cpus']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}, "
          f"{m['threads']} threads; linear {r['linear']}, attention {r['attention']}")
    print(f"  step without profiler: p50 {r['step_ms_p50_without_profiler']:.2f} ms "
          f"(mean {r['step_ms_mean_without_profiler']:.2f}); under the profiler: mean {r['step_ms_mean_profiled']:.2f} ms")
    if "bound" in r:
        b = r["bound"]
        seen = ", ".join(f"{x:.1f}" for x in b["bandwidth_readings_gbs"])
        print(f"  bound: {b['bound_ms']:.2f} ms ({b['binds']}; memory {b['memory_ms']:.2f}, compute {b['compute_ms']:.2f}; "
              f"{b['bandwidth_gbs']:.1f} GB/s, best of {seen}; {b['gemm_gflops']:.0f} GFLOP/s, best of "
              f"{', '.join(f'{x:.0f}' for x in b['gemm_readings_gflops'])}); step p50 / bound "
              f"{b['step_over_bound']:.2f}; the step read {b['step_read_gbs']:.1f} GB/s")
    print("\n| family | ms / step | % of step |\n|---|---|---|")
    for f, ms in r["families_ms"].items():
        print(f"| {f} | {ms:.2f} | {r['families_pct'][f]:.1f} |")
    print(f"| **wall (profiled)** | {r['step_ms_mean_profiled']:.2f} | 100 |")
    if r["fused_stages_ms"]:
        st = r["fused_stages_ms"]
        print(f"\n  inside the fused layers (C clocks around each kernel, {r['steps']} more steps): "
              f"{sum(st.values()):.2f} ms / step\n\n| kernel | ms / step |\n|---|---|")
        for name, ms in st.items():
            print(f"| {name} | {ms:.3f} |")
    print("\n  largest ops in 'elementwise & other ops' (ms / step): "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["top_other_ops_ms"].items()))


def engine_arguments(ap: argparse.ArgumentParser, prompt_len: int) -> None:
    """The engine and workload flags build_engine and start_decoding read (ab_layers.py takes them too)."""
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="as model.model (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--concurrency", "-c", type=int, default=1, help="sequences decoding in each step")
    ap.add_argument("--prompt-len", type=int, default=prompt_len)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    engine_arguments(ap, prompt_len=128)
    ap.add_argument("--warmup", type=int, default=16, help="decode steps before timing")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed, then as many profiled")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    ap.add_argument("--no-bound", action="store_true", help="skip the bandwidth / GEMM probes and the bound")
    return run_cli(ap, argv, run, print_report, progress=False)


if __name__ == "__main__":
    sys.exit(main())
