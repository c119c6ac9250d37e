#!/usr/bin/env python
"""nano-vllm's bench.py workload on one GPU: llmserve offline and over HTTP, HF transformers, and the decode roofline.

Workload (nano-vllm's bench.py, its order of random draws): random.seed(0); 256 prompts of randint(100, 1024)
token ids, each randint(0, 10000); then 256 max_tokens of randint(100, 1024): 133,966 output tokens. Temperature
0.6, EOS ignored, every request submitted at once; throughput = output tokens / wall seconds, as bench.py counts it.
Model: the Qwen2.5-0.5B shape with seeded random weights (llmserve's dummy loader; HF gets the same tensors),
bfloat16 on CUDA. Phases, in this order, each time-boxed by --budget-s (and all of them by --total-budget-s); a
phase that fails or runs out of time is recorded and the next one runs:

  offline    llmserve's Engine in this process, stepped by `bench offline`'s drive(), after a warm-up that is
             not counted; also the batch, context and time of every decode-only step
  roofline   those decode steps against bench's bound.py: (weights + K/V read) / bandwidth, the bandwidth a
             device-to-device copy's bytes read + written over its time (CUDA events); at the full batch, at the
             mean decode batch, and over all decode steps
  http       `llmserve serve` with the same config on a free 127.0.0.1 port, every request a streaming
             /v1/completions with token-id prompts at once; its throughput over offline's (server.engine_core
             as configured: auto is the engine in its own process on a GPU)
  http-thread  the same with server.engine_core=thread (engine and event loop share one process and its GIL)
  hf-static  HF generate() on left-padded batches of --hf-batch, as many as fit in the budget; counts the tokens
             the requests asked for (a batch runs to its longest request)
  hf-cb      HF transformers' continuous batching (ContinuousBatchingManager, each request its own
             max_new_tokens) on the same weights and device

The report (GPU, torch, transformers, config, every phase) is written to --out after every phase; a table at the
end (--json: the report instead). Backend options pass through with --set, e.g. --set backend.options.attention=X.

    python benchmarks/gpu_nanovllm.py --out gpu_bench.json                  # on a GPU: the whole workload
    python benchmarks/gpu_nanovllm.py --device cpu --dtype float32 --requests 6 --max-input-len 40 \\
        --max-output-len 24 --model-shape tiny-qwen2 --out gpu_bench.json   # a dry run on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from shapes import SHAPES  # noqa: E402

from llmserve_bench.report import machine_info, progress_bar  # noqa: E402

# hf-static before hf-cb: on a CPU, HF continuous batching's worker thread would leave this one's torch slowed
# (llmserve/threads.py); on a GPU the order does not matter
PHASES = ("offline", "roofline", "http", "http-thread", "hf-static", "hf-cb")
NANO_TOTAL = 133966  # bench.py's total output tokens: what its 256 requests at the default lengths sum to
TOKEN_TOP = 10000  # bench.py draws prompt token ids in [0, 10000]
# a shape for dry runs on a CPU: Qwen2 layout, a vocabulary just above bench.py's token ids
TINY_SHAPES = {
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=10240, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=10239, bos_token_id=10239),
}


class PhaseTimeout(Exception):
    """A phase ran past its deadline; what it measured until then is in the report."""


# --- the workload -----------------------------------------------------------------------------------


def nano_workload(requests: int, min_in: int, max_in: int, min_out: int, max_out: int,
                  seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """bench.py's prompts and max_tokens: every prompt drawn first, then every max_tokens (its order of draws)."""
    random.seed(seed)
    prompts = [[random.randint(0, TOKEN_TOP) for _ in range(random.randint(min_in, max_in))] for _ in range(requests)]
    max_tokens = [random.randint(min_out, max_out) for _ in range(requests)]
    return prompts, max_tokens


def lower(min_len: int, max_len: int) -> int:
    """A length range's low end: the flag, or half the max when the max is below twice it (shrunk dry runs)."""
    return max(1, min(min_len, max_len // 2))


def warmup_prompts(n: int, max_len: int) -> list[list[int]]:
    """n prompts of lengths spread up to max_len, from their own seed (the workload's draws stay bench.py's)."""
    rng = random.Random(1)
    return [[rng.randint(0, TOKEN_TOP) for _ in range(max(1, max_len * (i + 1) // n))] for i in range(n)]


# --- the model and the engine config ----------------------------------------------------------------


def model_dir(shape: str, tmp: Path) -> Path:
    """A directory with the shape's config.json (vs_hf's make_model_dir; the tiny shapes are written the same way)."""
    from vs_hf import MODELS, make_model_dir

    if shape in MODELS:
        return make_model_dir(shape, tmp)
    import transformers

    kw = dict(TINY_SHAPES[shape])
    kw.pop("model_type")
    d = tmp / shape
    transformers.Qwen2Config(**kw).save_pretrained(d)
    return d


def engine_config(args: argparse.Namespace, mdir: Path):
    """The engine config both llmserve phases run: nano-vllm's limits, then --set on top."""
    from llmserve.config_args import config_from_args

    kv = args.kv_cache_memory or ("0.5" if args.device.startswith("cuda") else "512MiB")
    base = {
        "model": {"model": str(mdir), "dtype": args.dtype, "device": args.device, "load_format": "dummy",
                  "seed": args.seed, "max_model_len": args.max_model_len},
        "backend": {"name": "torch", "kv_cache_memory": kv},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "cache": {"block_size": args.block_size, "enable_prefix_caching": True},
        "tokenizer": {"name": "none"},  # token-id prompts, no text: the shape ships no tokenizer
    }
    return config_from_args(argparse.Namespace(config=None, set=args.set), defaults=base)


def free_device_memory() -> dict[str, float] | None:
    """Hand cached blocks back to the driver (the next phase sizes its KV cache from free memory); GiB free/total."""
    gc.collect()
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"free_gib": free / 2**30, "total_gib": total / 2**30}


def rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


# --- (a) llmserve offline ---------------------------------------------------------------------------


class Sampled:
    """The engine as drive() sees it, with each request's temperature set (drive() asks for greedy decoding)."""

    def __init__(self, engine, temperature: float):
        self._engine = engine
        self._temperature = temperature

    def add_request(self, prompt, sp, **kw):
        """Add with sp's temperature replaced."""
        return self._engine.add_request(prompt, dataclasses.replace(sp, temperature=self._temperature), **kw)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class StepLog:
    """drive()'s on_step: tokens, steps and prefill counted, each decode-only step kept (batch, context tokens read,
    seconds, as `bench offline` counts them); raises PhaseTimeout past the deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.t0 = time.perf_counter()
        self.tokens = self.steps = self.prefill_tokens = 0
        self.decodes: list[tuple[int, int, float]] = []

    def __call__(self, so) -> None:
        m = so.metrics
        if m is not None and m.batch_size:
            self.steps += 1
            self.tokens += m.num_output_tokens
            self.prefill_tokens += m.num_prefill_tokens
            # each sequence of a decode step read its prompt and the outputs before this one
            if m.num_prefill_tokens == 0 and len(so.outputs) == m.batch_size:
                ctx = sum(o.num_prompt_tokens + o.num_output_tokens - 1 for o in so.outputs)
                self.decodes.append((m.batch_size, ctx, m.step_seconds))
        if time.perf_counter() > self.deadline:
            raise PhaseTimeout

    def facts(self) -> dict[str, Any]:
        """Counts, decode time and mean batch, and every decode step (ms) for a roofline of one's own."""
        batches = [b for b, _, _ in self.decodes]
        return {"steps": self.steps, "prefill_tokens_computed": self.prefill_tokens, "decode_steps": len(batches),
                "decode_s": sum(sec for _, _, sec in self.decodes),
                "decode_batch_mean": sum(batches) / len(batches) if batches else 0.0,
                "decode_step_log": [[b, c, round(sec * 1e3, 4)] for b, c, sec in self.decodes]}


def phase_offline(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """llmserve's engine in this process: warm-up, then every request at once through drive()."""
    from llmserve_bench.bound import probe_before
    from llmserve_bench.offline import drive
    from llmserve_bench.report import summarize_results
    from llmserve_bench.workload import Item
    from llmserve.engine import Engine
    from llmserve.request import SamplingParams

    args, config = ctx["args"], ctx["config"]
    t0 = time.perf_counter()
    engine = Engine.from_config(config)
    try:
        out: dict[str, Any] = {"load_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        engine.generate(warmup_prompts(args.warmup_requests, args.max_input_len),
                        SamplingParams(max_tokens=args.warmup_tokens, temperature=args.temperature, ignore_eos=True))
        out["warmup_s"] = time.perf_counter() - t0
        ctx["describe"] = out["backend"] = engine.backend.describe()
        full = engine.scheduler_stats().max_num_seqs or config.scheduler.max_num_seqs
        ctx["probe_before"] = probe_before(ctx["describe"], full)  # the roofline phase reads the device again after
        items = [Item(p, m) for p, m in zip(ctx["prompts"], ctx["max_tokens"])]
        log = StepLog(deadline)
        ctx["decodes"] = log.decodes
        bar = progress_bar(args, len(items), "llmserve offline")
        try:
            results, elapsed = drive(Sampled(engine, args.temperature), items, len(items), bar, detokenize=False,
                                     on_step=log)
        except PhaseTimeout:  # what the steps so far produced
            bar.close()
            elapsed = time.perf_counter() - log.t0
            return {**out, "status": "timeout", "output_tokens": log.tokens, "elapsed_s": elapsed,
                    "output_tok_s": rate(log.tokens, elapsed), **log.facts()}
        s = summarize_results(results, elapsed)
        return {**out, "output_tokens": s["output_tokens"], "elapsed_s": elapsed,
                "output_tok_s": s["output_token_throughput"], "completed": s["completed"], "failed": s["failed"],
                "errors": s["errors"], "all_tokens": s["output_tokens"] == sum(ctx["max_tokens"]),
                "latency_ms": s["latency_ms"], "kv_peak": engine.backend.describe().get("kv_peak"), **log.facts()}
    finally:
        engine.shutdown()
        del engine
        free_device_memory()


# --- (d) the roofline of the decode steps -----------------------------------------------------------


def phase_roofline(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """offline's decode steps against (weights + K/V read) / bandwidth, the device probed again now (bound.py):
    at the full batch, near the mean decode batch (within 5%), and over all of them."""
    from llmserve_bench.bound import bound_report

    if not ctx.get("decodes"):
        raise RuntimeError("no decode-only steps from the offline phase")
    decodes = ctx["decodes"]
    bound = bound_report(decodes, ctx["describe"], before=ctx.get("probe_before"))
    if "skipped" in bound:
        raise RuntimeError(f"no bound: {bound['skipped']}")
    p, f = bound["probe"], bound["footprint"]
    rates = (p["bandwidth_gbs"] * 1e9, p["gemm_gflops"] * 1e9)
    full = max(b for b, _, _ in decodes)
    mean = sum(b for b, _, _ in decodes) / len(decodes)
    near = [d for d in decodes if abs(d[0] - mean) <= max(1.0, 0.05 * mean)]
    return {
        "device": p.get("device"), "bandwidth_gbs": p["bandwidth_gbs"], "gemm_gflops": p["gemm_gflops"],
        "weight_gb": f["weight_bytes"] / 1e9, "kv_kib_per_token": f["kv_bytes_per_token"] / 1024,
        "at_full_batch": _floors([d for d in decodes if d[0] == full], f, *rates),
        "at_mean_batch": {"mean_batch": mean, **_floors(near or decodes, f, *rates)},
        "all_decode_steps": _floors(decodes, f, *rates),
        "decode_bound": bound,  # bench offline's table: every batch size seen
    }


def _floors(steps: list[tuple[int, int, float]], f: dict[str, int], bw: float, gemm: float) -> dict[str, Any]:
    """Decode steps pooled: bytes a step reads, its time against the memory floor and against max(memory,
    compute), at the median and summed (the fractions: floor seconds over step seconds)."""
    from statistics import median

    from llmserve_bench.bound import step_bound

    fl = [step_bound(f["weight_bytes"], f["kv_bytes_per_token"], f["matmul_params"], b, c, bw, gemm)
          for b, c, _ in steps]
    step_s = sum(sec for _, _, sec in steps)
    memory_s = sum(x["memory_s"] for x in fl)
    return {"steps": len(steps), "batch": [min(b for b, _, _ in steps), max(b for b, _, _ in steps)],
            "context_mean": sum(c for _, c, _ in steps) / sum(b for b, _, _ in steps),
            "bytes_per_step_gb": memory_s * bw / len(steps) / 1e9,
            "step_p50_ms": median(sec for _, _, sec in steps) * 1e3,
            "memory_floor_p50_ms": median(x["memory_s"] for x in fl) * 1e3,
            "compute_floor_p50_ms": median(x["compute_s"] for x in fl) * 1e3,
            "step_s": step_s, "memory_floor_s": memory_s, "bound_s": sum(x["bound_s"] for x in fl),
            "fraction_of_memory_roofline": memory_s / step_s,
            "fraction_of_bound": sum(x["bound_s"] for x in fl) / step_s}


# --- (b) llmserve over HTTP -------------------------------------------------------------------------


def start_server(config_file: Path, log_file: Path, deadline: float) -> tuple[subprocess.Popen, str]:
    """`llmserve serve --config FILE` on a free port, its output in log_file; its URL once /health says ok.

    Not bench serve's launch_server: that waits a fixed 300 s and shares this terminal, and this phase needs
    its deadline and the server's log for the report when the load fails.
    """
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins"),
                                                        os.environ.get("PYTHONPATH", "")])}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmserve", "--log-level", "warning", "serve", "--config",
                                 str(config_file), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {_tail(log_file)}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return proc, url
            if r.json().get("status") == "error":  # the app runs on, but its engine failed to load
                stop_server(proc)
                raise RuntimeError(f"the server failed to load: {r.json().get('error')}")
        except (httpx.TransportError, ValueError):
            pass
        if time.perf_counter() > deadline:
            stop_server(proc)
            raise PhaseTimeout("the server did not become healthy in the phase's budget")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s: its drain would wait for the streams a timed-out run left open."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


async def stream_all(url: str, items, temperature: float, budget_s: float, bar) -> tuple[list, float, bool]:
    """Every item at once as a streamed /v1/completions, timed per token by bench serve's _stream; stops at budget_s.

    Not run_http: it sends temperature 0 (greedy), and bench.py samples at 0.6.
    """
    import httpx

    from llmserve_bench.clients import _stream
    from llmserve_bench.report import Result, Timing

    results: list[Result] = []
    limits = httpx.Limits(max_connections=len(items), max_keepalive_connections=len(items))
    async with httpx.AsyncClient(timeout=budget_s + 30, limits=limits) as http:
        async def one(it) -> None:
            body = {"prompt": it.prompt, "max_tokens": it.max_tokens, "temperature": temperature, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            try:
                results.append(await _stream(http, url + "/v1/completions", {}, body, Timing(time.perf_counter())))
            except httpx.HTTPError as e:
                results.append(Result(False, error=f"{type(e).__name__}: {e}"))
            bar.update(1)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(it)) for it in items]
        _, pending = await asyncio.wait(tasks, timeout=max(budget_s, 1.0))
        elapsed = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    return results, elapsed, bool(pending)


class _Silent:
    """A progress bar that shows nothing (client worker processes)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _client_worker(url: str, items, temperature: float, budget_s: float, start_at: float):
    """One client process: waits for the common start, streams its share; (results, wall time at the end, cut)."""
    time.sleep(max(0.0, start_at - time.time()))
    results, _, cut = asyncio.run(stream_all(url, items, temperature, budget_s, _Silent()))
    return results, time.time(), cut


def stream_all_procs(url: str, items, temperature: float, budget_s: float, procs: int, bar) -> tuple[list, float, bool]:
    """stream_all spread over `procs` client processes started together, so the load generator (one Python event
    loop parses ~15k SSE events/s) is not what limits the server; elapsed from the common start to the last end."""
    if procs <= 1:
        return asyncio.run(stream_all(url, items, temperature, budget_s, bar))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [items[i::procs] for i in range(procs)]
    start_at = time.time() + 5.0  # room for the workers to start and import httpx
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as ex:
        outs = [f.result() for f in [ex.submit(_client_worker, url, sh, temperature, budget_s - 5.0, start_at)
                                     for sh in shares if sh]]
    bar.update(len(items))
    bar.close()
    return [r for o in outs for r in o[0]], max(o[1] for o in outs) - start_at, any(o[2] for o in outs)


def _generated(url: str) -> int:
    """The server's count of tokens generated so far (/stats), for a run cut off by its deadline."""
    import httpx

    return int(httpx.get(url + "/stats", timeout=10).json()["metrics"]["generation_tokens"])


def phase_http(ctx: dict[str, Any], deadline: float, engine_core: str | None = None) -> dict[str, Any]:
    """`llmserve serve` with offline's config, warmed up, then every request at once over streaming HTTP."""
    import yaml

    from llmserve_bench.report import summarize_results
    from llmserve_bench.workload import Item

    args, tmp = ctx["args"], ctx["tmp"]
    cfg = ctx["config"].to_dict()
    if engine_core is not None:
        cfg["server"]["engine_core"] = engine_core
    cfg_file = tmp / "engine.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_file = tmp / "server.log"
    t0 = time.perf_counter()
    proc, url = start_server(cfg_file, log_file, deadline)
    try:
        start_s = time.perf_counter() - t0
        warm = [Item(p, args.warmup_tokens) for p in warmup_prompts(args.warmup_requests, args.max_input_len)]
        asyncio.run(stream_all(url, warm, args.temperature, deadline - time.perf_counter(),
                               progress_bar(args, len(warm), "http warm-up")))
        items = [Item(p, m) for p, m in zip(ctx["prompts"], ctx["max_tokens"])]
        before = _generated(url)
        results, elapsed, cut = stream_all_procs(url, items, args.temperature, deadline - time.perf_counter(),
                                                 args.client_procs, progress_bar(args, len(items), "llmserve http"))
        s = summarize_results(results, elapsed)
        out = {"server_start_s": start_s, "client_procs": args.client_procs, "elapsed_s": elapsed,
               "engine_core": cfg["server"]["engine_core"],
               "output_tokens": s["output_tokens"],
               "output_tok_s": s["output_token_throughput"], "completed": s["completed"], "failed": s["failed"],
               "errors": s["errors"], "all_tokens": s["output_tokens"] == sum(ctx["max_tokens"]),
               "latency_ms": s["latency_ms"]}
        if cut:  # the streams still open count nothing client-side: the server's own count of what it generated
            gen = _generated(url) - before
            out.update(status="timeout", output_tokens_server=gen, output_tok_s=rate(gen, elapsed))
        return out
    finally:
        stop_server(proc)
        if ctx.get("out"):  # kept beside the report: the server's warnings and errors
            Path(str(ctx["out"]) + ".server.log").write_text(_tail(log_file, 200_000))


# --- (c) HF transformers ----------------------------------------------------------------------------


def hf_model_on_device(ctx: dict[str, Any]):
    """vs_hf's HF model with the tensors llmserve's dummy loader makes, on the device; loaded once for both phases."""
    if ctx.get("hf") is None:
        import torch
        import transformers
        from vs_hf import hf_model

        from llmserve_torch.checkpoint import read_arch

        transformers.logging.set_verbosity_error()
        arch = read_arch(ctx["model_dir"])
        ctx["hf"] = hf_model(ctx["model_dir"], arch, getattr(torch, ctx["args"].dtype), ctx["args"].seed).to(
            ctx["args"].device)
    return ctx["hf"]


def _sampling(ctx: dict[str, Any]) -> dict[str, Any]:
    """bench.py's sampling in HF's terms: temperature only (HF would add its default top_k=50)."""
    return {"do_sample": True, "temperature": ctx["args"].temperature, "top_k": 0, "top_p": 1.0}


def phase_hf_cb(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """HF continuous batching: generate_batch's manager, fed each request with its own max_new_tokens.

    generate_batch gives every request one max_new_tokens; its manager's add_request takes one per request
    (transformers 5.17 and 5.23 alike), so each request asks for exactly bench.py's max_tokens.
    """
    from transformers import GenerationConfig

    try:  # hints that size HF's cache and batch for the workload, as generate_batch passes them
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        WorkloadHints = None
    args, prompts, max_tokens = ctx["args"], ctx["prompts"], ctx["max_tokens"]
    model = hf_model_on_device(ctx)
    gc_ = GenerationConfig(max_new_tokens=max(max_tokens), eos_token_id=None,
                           pad_token_id=model.generation_config.pad_token_id, **_sampling(ctx))
    hints = (WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(max_tokens),
                           num_requests=len(prompts)) if WorkloadHints else None)
    t_start = time.perf_counter()
    # it runs a worker thread: not under torch.inference_mode() (vs_hf's run_hf_cb)
    with model.continuous_batching_context_manager(generation_config=gc_, block=True, timeout=30,
                                                   workload_hints=hints) as manager:
        start_s = time.perf_counter() - t_start
        warm = warmup_prompts(args.warmup_requests, args.max_input_len)
        for p in warm:  # eos -1: none (bench.py ignores EOS)
            manager.add_request(p, max_new_tokens=args.warmup_tokens, eos_token_id=-1)
        if _collect(manager, len(warm), deadline, None)["timed_out"]:
            manager.stop(block=True, timeout=30, hard_stop=True)  # the context's stop would finish every request
            raise PhaseTimeout("HF's warm-up did not finish in the phase's budget")
        bar = progress_bar(args, len(prompts), "hf generate_batch")
        t0 = time.perf_counter()
        for p, m in zip(prompts, max_tokens):
            manager.add_request(p, max_new_tokens=m, eos_token_id=-1)
        got = _collect(manager, len(prompts), deadline, bar)
        elapsed = time.perf_counter() - t0
        bar.close()
        if got["timed_out"]:
            got["in_flight_tokens"] = _in_flight_tokens(manager)
            manager.stop(block=True, timeout=30, hard_stop=True)  # the context's stop would finish every request
    tokens = got["tokens"] + got.get("in_flight_tokens", 0)
    return {"status": "timeout" if got["timed_out"] else "ok", "per_request_max_new_tokens": True,
            "manager_start_s": start_s, "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tok_s": rate(tokens, elapsed), "completed": got["finished"], "errors": got["errors"],
            "all_tokens": tokens == sum(max_tokens), "attn_implementation": model.config._attn_implementation}


def _collect(manager, n: int, deadline: float, bar) -> dict[str, Any]:
    """Wait for n finished results (or the deadline): their count, tokens and errors."""
    got: dict[str, Any] = {"finished": 0, "tokens": 0, "errors": {}, "timed_out": False}
    while got["finished"] < n:
        if time.perf_counter() > deadline:
            got["timed_out"] = True
            break
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError(f"HF's generation thread stopped with {n - got['finished']} requests left")
            continue
        if r.is_finished():
            got["finished"] += 1
            got["tokens"] += len(r.generated_tokens)
            if getattr(r, "error", None):
                got["errors"][r.error[:160]] = got["errors"].get(r.error[:160], 0) + 1
            if bar is not None:
                bar.update(1)
    return got


def _in_flight_tokens(manager) -> int:
    """Tokens HF's running requests generated so far (its scheduler's state, read racily: an estimate)."""
    try:
        active = manager.batch_processor.scheduler.active_requests
        return sum(len(s.generated_tokens) for s in list(active.values()))
    except (AttributeError, RuntimeError):
        return 0


def phase_hf_static(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """HF generate() on left-padded batches, as many as fit in the budget; only requested tokens count."""
    import torch

    args, prompts, max_tokens = ctx["args"], ctx["prompts"], ctx["max_tokens"]
    model = hf_model_on_device(ctx)
    pad = model.generation_config.pad_token_id or 0
    done = {"requests": 0, "tokens": 0, "generated": 0, "seconds": 0.0, "batches": 0}
    cut = False
    with torch.inference_mode():
        ids, mask = left_pad(warmup_prompts(2, 16), pad, args.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, **_sampling(ctx))
        bar = progress_bar(args, len(prompts), "hf generate (static)")
        for i in range(0, len(prompts), args.hf_batch):
            left = deadline - time.perf_counter()
            per_batch = done["seconds"] / done["batches"] if done["batches"] else 0.0
            if left <= 0 or per_batch > left:  # the next batch would not finish: stop at whole batches
                cut = True
                break
            chunk, want = prompts[i:i + args.hf_batch], max_tokens[i:i + args.hf_batch]
            ids, mask = left_pad(chunk, pad, args.device)
            n = max(want)
            _sync(args.device)
            t0 = time.perf_counter()
            # min_new_tokens: HF fills an unset eos_token_id from the model's config; bench.py never stops early
            g = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, max_time=left,
                               **_sampling(ctx))
            _sync(args.device)
            done["seconds"] += time.perf_counter() - t0
            made = g.shape[1] - ids.shape[1]
            done["batches"] += 1
            done["requests"] += len(chunk)
            done["generated"] += made * len(chunk)
            done["tokens"] += sum(min(m, made) for m in want)
            bar.update(len(chunk))
            if made < n:  # max_time stopped it
                cut = True
                break
        bar.close()
    return {"status": "timeout" if cut else "ok", "batch": args.hf_batch, "batches": done["batches"],
            "requests": done["requests"], "elapsed_s": done["seconds"], "output_tokens": done["tokens"],
            "generated_tokens_with_padding": done["generated"], "output_tok_s": rate(done["tokens"], done["seconds"]),
            "counts": "tokens the requests asked for (each batch runs to its longest request)"}


def left_pad(prompts: list[list[int]], pad: int, device: str):
    """Token ids and attention mask, left-padded to the longest prompt."""
    import torch

    n = max(map(len, prompts))
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    return ids.to(device), mask.to(device)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- the run ----------------------------------------------------------------------------------------


PHASE_FNS: dict[str, Callable[[dict[str, Any], float], dict[str, Any]]] = {
    "offline": phase_offline, "roofline": phase_roofline, "http": phase_http,
    "http-thread": functools.partial(phase_http, engine_core="thread"), "hf-cb": phase_hf_cb,
    "hf-static": phase_hf_static,
}


def run_phase(name: str, ctx: dict[str, Any], report: dict[str, Any], budget_s: float, total_deadline: float) -> None:
    """One phase under its deadline; its result, or its error, into the report, which is written out."""
    t0 = time.perf_counter()
    deadline = min(t0 + budget_s, total_deadline)
    r: dict[str, Any] = {"status": "ok"}
    if deadline - t0 < 5:
        r = {"status": "skipped", "error": "--total-budget-s spent"}
    else:
        try:
            r.update(PHASE_FNS[name](ctx, deadline))
        except PhaseTimeout as e:
            r = {"status": "timeout", "error": str(e) or "past its budget"}
        except Exception as e:  # noqa: BLE001 - a failed phase is a result; the next phases still run
            r = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    r["phase_s"] = time.perf_counter() - t0
    r["device_memory_after"] = free_device_memory()
    report["phases"][name] = r
    if not ctx["args"].json:
        print(f"[{name}] {r['status']} in {r['phase_s']:.1f}s"
              + (f": {r.get('output_tok_s', 0):.1f} output tok/s" if "output_tok_s" in r else "")
              + (f" — {r['error']}" if r.get("error") else ""), file=sys.stderr)
    write_report(report, ctx["out"])


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """The report so far, replaced whole (a run killed between phases leaves the last complete one)."""
    if out is None:
        return
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(add_ratios(report), indent=2, default=str))
    os.replace(tmp, out)


def add_ratios(report: dict[str, Any]) -> dict[str, Any]:
    """offline over each peer, and http over offline, where both measured a throughput."""
    ph = report["phases"]
    off = ph.get("offline", {}).get("output_tok_s")
    ratios = {}
    if off:
        for name in ("hf-cb", "hf-static"):
            if ph.get(name, {}).get("output_tok_s"):
                ratios[f"offline/{name}"] = off / ph[name]["output_tok_s"]
        for name in ("http", "http-thread"):  # the engine in its own process (auto on a GPU), and on a thread
            if ph.get(name, {}).get("output_tok_s"):
                ratios[f"{name}/offline"] = ph[name]["output_tok_s"] / off
    report["ratios"] = ratios
    # a phase cut off by its budget measured part of the workload (its start: prefill-heavy); its ratios say so
    report["ratios_from_partial_runs"] = sorted(n for n, r in ph.items() if r.get("status") == "timeout")
    return report


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """GPU, torch, transformers and the source revision: what a figure needs beside it."""
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "machine": machine_info(), "revision": _revision()}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        i = torch.device(args.device).index or 0
        prop = torch.cuda.get_device_properties(i)
        env["gpu"] = {"name": torch.cuda.get_device_name(i), "memory_gib": prop.total_memory / 2**30,
                      "capability": f"{prop.major}.{prop.minor}", "sms": prop.multi_processor_count}
    return env


def _revision() -> str | None:
    """The git commit of this checkout, '+dirty' with uncommitted changes (None outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def print_table(report: dict[str, Any]) -> None:
    """GPU and versions, one row per phase, the roofline lines."""
    e, w = report["environment"], report["workload"]
    gpu = e.get("gpu", {}).get("name") or f"CPU ({e['machine'].get('cpu', '?')})"
    print(f"\n{gpu}; torch {e['torch']} (CUDA {e['cuda']}), transformers {e['transformers']}, llmserve "
          f"{e['revision']}")
    print(f"workload: {w['requests']} requests, prompts {w['prompt_tokens']} tokens ({w['input_len']}), "
          f"{w['output_tokens']} output tokens ({w['output_len']}), temperature {w['temperature']}, EOS ignored; "
          f"{w['model_shape']} {w['dtype']} on {w['device']}")
    print(f"{'phase':<11} {'status':<8} {'output tok/s':>13} {'tokens':>8} {'seconds':>8}  ratio")
    ph, ratios = report["phases"], report.get("ratios", {})
    for name in PHASES:
        r = ph.get(name)
        if r is None or name == "roofline":
            continue
        key = f"{name}/offline" if name.startswith("http") else f"offline/{name}"
        ratio = f"{key} {ratios[key]:.2f}" if key in ratios else ""
        toks = r.get("output_tokens_server", r.get("output_tokens"))
        tok_s = f"{r['output_tok_s']:.1f}" if "output_tok_s" in r else "-"
        print(f"{name:<11} {r['status']:<8} {tok_s:>13} {toks if toks is not None else '-':>8} "
              f"{r.get('elapsed_s', r['phase_s']):>8.2f}  {ratio}")
        if r.get("error"):
            print(f"{'':<11} {r['error'][:300]}")
    rf = ph.get("roofline")
    if rf is None:
        return
    if rf["status"] != "ok":
        print(f"roofline: {rf['status']}: {rf.get('error', '')[:300]}")
        return
    how = "a copy's bytes read + written" if str(rf.get("device")).startswith("cuda") else "a sum's reads"
    print(f"roofline on {rf.get('device')}: bandwidth {rf['bandwidth_gbs']:.0f} GB/s ({how}), "
          f"GEMM {rf['gemm_gflops']:.0f} GFLOP/s; weights {rf['weight_gb']:.3f} GB, "
          f"K+V {rf['kv_kib_per_token']:.1f} KiB/token")
    for label, x in (("full batch", rf["at_full_batch"]), ("mean batch", rf["at_mean_batch"]),
                     ("all decode steps", rf["all_decode_steps"])):
        lo, hi = x["batch"]
        print(f"  {label} {lo if lo == hi else f'{lo}-{hi}'} ({x['steps']} steps, {x['context_mean']:.0f} ctx/seq): "
              f"step p50 {x['step_p50_ms']:.2f} ms, {x['bytes_per_step_gb']:.2f} GB/step, memory floor p50 "
              f"{x['memory_floor_p50_ms']:.2f} ms → {x['fraction_of_memory_roofline']:.0%} of roofline "
              f"({x['fraction_of_bound']:.0%} of max(memory, compute); compute floor p50 "
              f"{x['compute_floor_p50_ms']:.2f} ms)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    w = ap.add_argument_group("workload (nano-vllm's bench.py)")
    w.add_argument("--requests", type=int, default=256)
    w.add_argument("--min-input-len", type=int, default=100,
                   help="prompt lengths uniform in [this, --max-input-len] (half the max when that is less)")
    w.add_argument("--max-input-len", type=int, default=1024)
    w.add_argument("--min-output-len", type=int, default=100,
                   help="max_tokens uniform in [this, --max-output-len] (half the max when that is less)")
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--temperature", type=float, default=0.6)
    w.add_argument("--warmup-requests", type=int, default=16, help="requests of the warm-up (not counted)")
    w.add_argument("--warmup-tokens", type=int, default=16, help="max_tokens of each warm-up request")
    m = ap.add_argument_group("model and engine")
    m.add_argument("--model-shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", *TINY_SHAPES])
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--max-num-batched-tokens", type=int, default=16384)
    m.add_argument("--max-model-len", type=int, default=4096, help="as nano-vllm's bench.py sets it")
    m.add_argument("--kv-cache-memory", default=None,
                   help="a fraction of free device memory or bytes (default 0.5 on CUDA, 512MiB on a CPU)")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key over the above, e.g. --set backend.options.attention=triton (repeatable)")
    m.add_argument("--hf-batch", type=int, default=64, help="requests per HF static generate() batch")
    m.add_argument("--client-procs", type=int, default=4,
                   help="processes the HTTP client's streams are spread over (1: one event loop, as bench serve)")
    r = ap.add_argument_group("run")
    r.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    r.add_argument("--budget-s", type=float, default=150.0, help="the most seconds one phase may take")
    r.add_argument("--total-budget-s", type=float, default=300.0,
                   help="the most seconds all phases may take (benchmarks/gpu/session.sh gives the script 330); "
                        "phases past it are recorded as skipped")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_nanovllm.json",
                   help="the JSON report, rewritten after every phase (default: $OUT or . /gpu_nanovllm.json)")
    r.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    for x in args.phases:
        if x not in PHASES:
            ap.error(f"unknown phase {x!r} (choose from {', '.join(PHASES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # a SIGTERM (a runner's time limit) unwinds like Ctrl-C, so the server is stopped and the report kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    total_deadline = t_start + args.total_budget_s
    min_in, min_out = lower(args.min_input_len, args.max_input_len), lower(args.min_output_len, args.max_output_len)
    prompts, max_tokens = nano_workload(args.requests, min_in, args.max_input_len, min_out, args.max_output_len)
    total = sum(max_tokens)
    if not args.json:
        print(f"workload: {args.requests} requests, {sum(map(len, prompts))} prompt tokens, {total} output tokens",
              file=sys.stderr)
    if (args.requests, min_in, args.max_input_len, min_out, args.max_output_len) == (256, 100, 1024, 100, 1024):
        assert total == NANO_TOTAL, f"{total} output tokens, not bench.py's {NANO_TOTAL}: the draws differ"
    shape = {**SHAPES, **TINY_SHAPES}[args.model_shape]
    assert shape["vocab_size"] > TOKEN_TOP, f"{args.model_shape}'s vocabulary is smaller than bench.py's token ids"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "environment": environment(args),
        "workload": {"source": "nano-vllm bench.py (random.seed(0); prompts drawn first, then max_tokens)",
                     "requests": args.requests, "input_len": [min_in, args.max_input_len],
                     "output_len": [min_out, args.max_output_len], "prompt_tokens": sum(map(len, prompts)),
                     "output_tokens": total, "temperature": args.temperature, "ignore_eos": True,
                     "model_shape": args.model_shape, "dtype": args.dtype, "device": args.device},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "phases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        mdir = model_dir(args.model_shape, Path(tmp))
        ctx: dict[str, Any] = {"args": args, "prompts": prompts, "max_tokens": max_tokens, "tmp": Path(tmp),
                               "model_dir": mdir, "out": args.out}
        try:
            ctx["config"] = engine_config(args, mdir)
            report["config"] = ctx["config"].to_dict()
        except Exception as e:  # noqa: BLE001 - a bad --set: no llmserve phase can run, HF's still can
            report["config_error"] = f"{type(e).__name__}: {e}"
        for name in PHASES:  # the order of PHASES: roofline right after the run it reads
            if name not in args.phases:
                continue
            if name in ("offline", "http", "http-thread") and "config" not in ctx:
                report["phases"][name] = {"status": "error", "error": report["config_error"], "phase_s": 0.0}
                continue
            run_phase(name, ctx, report, args.budget_s, total_deadline)
        ctx.pop("hf", None)
    report["total_s"] = time.perf_counter() - t_start
    write_report(report, args.out)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_table(report)
        print(f"report: {args.out}")
    return 0 if all(r["status"] == "ok" for r in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
