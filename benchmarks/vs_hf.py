#!/usr/bin/env python
"""Offline throughput of llmserve's torch backend against HF transformers on the same weights and prompts.

Workload (defaults): 64 requests, prompt lengths uniform in [16, 128] (seeded random token ids),
128 new tokens each, greedy, EOS ignored. Models: GPT-2 124M and Qwen2.5-0.5B shapes with seeded
random ("dummy") weights; dtypes float32 and bfloat16. Peers, in the same process:
  hf-seq     HF generate() one request at a time (on the first --seq-requests requests: it is slow)
  hf-static  HF generate() on all requests as one left-padded batch
  hf-cb      HF generate_batch() (continuous batching; run outside inference_mode)
The machine's limit for the workload is computed from GEMM times measured now at the workload's
shapes and the measured memory bandwidth: each step costs max(compute, weights + KV traffic).

    python benchmarks/vs_hf.py                      # the full workload (minutes)
    python benchmarks/vs_hf.py --requests 16 --max-new-tokens 32 --models gpt2 --dtypes float32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from shapes import SHAPES  # noqa: E402

from llmserve_bench.report import machine_info  # noqa: E402

MODELS = {k: SHAPES[k] for k in ("gpt2", "qwen2.5-0.5b")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PEERS = ("hf-seq", "hf-static", "hf-cb")


# --- the machine ------------------------------------------------------------------------------------


class Clock:
    """Wall time and process CPU time of a run; CPU time / threads is what the run costs with the CPU to itself."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def _best_time(fn, reps: int) -> float:
    """The best of reps runs, each taken as the smaller of wall time and CPU time / threads (the machine is shared)."""
    fn()
    best = math.inf
    threads = torch.get_num_threads()
    for _ in range(reps):
        with Clock() as c:
            fn()
        best = min(best, c.wall, c.cpu / threads)
    return best


def measure_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Read bandwidth in bytes/s: the best time of summing a large float32 tensor."""
    x = torch.ones(nbytes // 4)
    return nbytes / _best_time(lambda: x.sum(), reps)


def _gemm_variants(weights: list[torch.Tensor], dtype: torch.dtype) -> list:
    """Ways to run x @ w.T that torch offers here: F.linear, and oneDNN with pre-packed weights where it exists."""
    from llmserve_torch.models.common import Linear, onednn_available

    variants = [[Linear(w, None, pack=False) for w in weights]]
    if onednn_available(torch.device("cpu"), dtype):
        variants.append([Linear(w, None, pack=True) for w in weights])
    return variants


def lm_head_time(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """The fastest of one GEMM, vocabulary-chunked GEMMs and a packed oneDNN GEMM for the LM head."""
    from llmserve_torch.models.common import lm_head

    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    best = _best_time(lambda: F.linear(x, w), reps)
    for (head,) in _gemm_variants([w], dtype):
        best = min(best, _best_time(lambda: lm_head(x, head), reps))
    return best


def matmul_shapes(arch) -> list[tuple[int, int]]:
    """(in, out) of each matmul in one layer, as our backend fuses them."""
    h, i = arch.hidden_size, arch.intermediate_size
    if arch.family == "gpt2":
        return [(h, 3 * h), (h, h), (h, i), (i, h)]
    return [(h, arch.q_size + 2 * arch.kv_size), (arch.q_size, h), (h, 2 * i), (i, h)]


def workload_limit(arch, dtype, prompt_lens: list[int], new_tokens: int, chunk: int, bandwidth: float) -> dict:
    """Bound on output tok/s: ideal schedule = prompts in full chunks, then decode steps of every sequence.

    Each step costs max(compute at the GEMM rate measured now for its shapes, (weights + KV read) / bandwidth).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = matmul_shapes(arch)
    L, H, V = arch.num_layers, arch.hidden_size, arch.vocab_size
    B = len(prompt_lens)
    layer_params = sum(k * n for k, n in shapes)
    weight_bytes = (L * layer_params + V * H) * elem
    kv_per_token = 2 * L * arch.kv_size * elem

    # one distinct weight per layer, as in the model: a single matrix timed in a loop would sit in L3
    # (32 MiB on the dev machine) and overstate the rate a real step can reach
    # (each timed with every GEMM variant torch offers here: the limit is the machine's best, not ours)
    layer_weights = [torch.randn(n, k).to(dtype) for _ in range(L) for k, n in shapes]
    variants = _gemm_variants(layer_weights, dtype)
    del layer_weights
    in_dims = sorted({k for k, _ in shapes})

    def step_compute(m: int, lm_rows: int) -> float:
        xs = {k: torch.randn(m, k).to(dtype) for k in in_dims}
        ins = [xs[k] for _ in range(L) for k, _ in shapes]
        t = min(_best_time(lambda v=v: [lin(x) for lin, x in zip(v, ins)], 3) for v in variants)
        return t + (lm_head_time(lm_rows, H, V, dtype) if lm_rows else 0.0)

    # prefill: full chunks of `chunk` tokens; the LM head runs for the prompts that end in the chunk
    total_prompt = sum(prompt_lens)
    rows_per_chunk = max(1, round(chunk / (total_prompt / B)))
    t_chunk = step_compute(chunk, rows_per_chunk)
    flops_chunk = 2 * chunk * L * layer_params + 2 * rows_per_chunk * H * V
    n_chunks = total_prompt / chunk
    t_prefill = n_chunks * max(t_chunk, weight_bytes / bandwidth)
    # decode: new_tokens - 1 steps at batch B (the first token comes with the prefill)
    t_dec_compute = step_compute(B, B)
    del variants
    flops_dec = 2 * B * (L * layer_params + H * V)
    rate_dec = flops_dec / t_dec_compute
    t_decode = 0.0
    t_decode_compute_total = t_decode_mem_total = 0.0
    for i in range(1, new_tokens):
        ctx = sum(p + i for p in prompt_lens)
        attn_flops = 4 * ctx * arch.q_size * L  # QK^T and PV for every sequence's context
        c = t_dec_compute + attn_flops / rate_dec
        mem = (weight_bytes + ctx * kv_per_token) / bandwidth
        t_decode += max(c, mem)
        t_decode_compute_total += c
        t_decode_mem_total += mem
    total = t_prefill + t_decode
    return {
        "gemm_gflops_decode": rate_dec / 1e9, "gemm_gflops_prefill": flops_chunk / t_chunk / 1e9,
        "bandwidth_gbs": bandwidth / 1e9, "weight_bytes": weight_bytes,
        "prefill_s": t_prefill, "decode_s": t_decode,
        "decode_bound_by": "compute" if t_decode_compute_total >= t_decode_mem_total else "memory",
        "limit_tok_s": B * new_tokens / total,
    }


# --- models and weights -----------------------------------------------------------------------------


def make_model_dir(name: str, tmp: Path) -> Path:
    """A directory with just config.json for the shape (our engine builds dummy weights from it)."""
    import transformers

    kw = dict(MODELS[name])
    mt = kw.pop("model_type")
    cfg = transformers.GPT2Config(**kw) if mt == "gpt2" else transformers.Qwen2Config(**kw)
    d = tmp / name
    cfg.save_pretrained(d)
    return d


def hf_model(model_dir: Path, arch, dtype: torch.dtype, seed: int):
    """The HF model with exactly the weights our loader invents for (config, seed)."""
    import transformers
    from llmserve_torch.checkpoint import dummy_state_dict
    from llmserve_torch.models.family import family_of

    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    sd = dummy_state_dict(family_of(arch).hf_shapes(arch), seed)
    if arch.family == "gpt2":
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"HF model parameters left uninitialized: {missing[:3]}")
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and name.endswith("rotary_emb"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=cfg))  # recompute inv_freq on the CPU
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            raise RuntimeError(f"HF model buffer {name} left on meta; cannot run")
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = cfg.eos_token_id
    return model


# --- the runs ---------------------------------------------------------------------------------------


def _rates(r: dict) -> None:
    """tok/s by wall clock, and by CPU time / threads (what the run would reach with the CPU to itself)."""
    r["tok_s"] = r["output_tokens"] / r["seconds"]
    r["tok_s_cpu"] = r["output_tokens"] / (r["cpu_seconds"] / torch.get_num_threads())


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_ours(model_dir: Path, dtype: str, prompts, new_tokens: int, args) -> dict:
    from llmserve.config import config_from_dict
    from llmserve.engine import Engine
    from llmserve.request import SamplingParams

    per_seq_blocks = -(-(max(map(len, prompts)) + new_tokens) // args.block_size)
    engine = Engine.from_config(config_from_dict({
        "model": {"model": str(model_dir), "dtype": dtype, "load_format": "dummy", "seed": args.seed},
        "backend": {"name": "torch", "options": {"attention": args.attention},
                    "kv_cache_memory": args.kv_cache_memory or 0.2},
        "scheduler": {"max_num_seqs": max(len(prompts), 1), "max_num_batched_tokens": args.max_num_batched_tokens},
        "cache": {"block_size": args.block_size, "num_blocks": len(prompts) * per_seq_blocks + 1
                  if args.kv_cache_memory is None else None, "enable_prefix_caching": False},
        "tokenizer": {"name": "none"},
    }))
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    outs: dict[str, list[int]] = {}
    clock = Clock().__enter__()
    ids = [engine.add_request(p, sp) for p in prompts]
    with tqdm(total=len(prompts) * new_tokens, desc=f"ours {dtype}", unit="tok", leave=False,
              disable=args.json) as bar:
        while engine.has_unfinished:
            st = engine.step()
            for o in st.outputs:
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                bar.update(len(o.new_token_ids))
    clock.__exit__()
    tokens = [outs[i] for i in ids]
    desc = engine.backend.describe()
    engine.shutdown()
    return {"seconds": clock.wall, "cpu_seconds": clock.cpu, "output_tokens": sum(map(len, tokens)), "tokens": tokens,
            "attention": desc.get("attention"), "kv_peak": desc.get("kv_peak"), "kv_blocks": desc.get("kv_blocks")}


def run_hf_seq(model, prompts, new_tokens: int, quiet: bool) -> dict:
    out = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False)  # warm-up
        with Clock() as clock:
            for p in tqdm(prompts, desc="hf-seq", leave=False, disable=quiet):
                g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                out.append(g[0, len(p):].tolist())
    return {"seconds": clock.wall, "cpu_seconds": clock.cpu, "output_tokens": sum(map(len, out)), "tokens": out}


def run_hf_static(model, prompts, new_tokens: int, pad_id: int, quiet: bool) -> dict:
    n = max(map(len, prompts))
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False)
        with tqdm(total=1, desc="hf-static", leave=False, disable=quiet) as bar:
            with Clock() as clock:
                g = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False)
            bar.update(1)
    out = g[:, n:].tolist()
    return {"seconds": clock.wall, "cpu_seconds": clock.cpu, "output_tokens": sum(map(len, out)), "tokens": out}


def run_hf_cb(model, prompts, new_tokens: int, quiet: bool) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=model.generation_config.pad_token_id)
    # generate_batch runs a worker thread: it must not be called under torch.inference_mode()
    model.generate_batch([prompts[0][:8]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=gc.pad_token_id))
    with Clock() as clock:
        res = model.generate_batch(prompts, generation_config=gc, progress_bar=not quiet)
    out = [list(r.generated_tokens) for r in res.values()]
    return {"seconds": clock.wall, "cpu_seconds": clock.cpu, "output_tokens": sum(map(len, out)), "tokens": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--models", default="gpt2,qwen2.5-0.5b", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)} (or none)")
    ap.add_argument("--seq-requests", type=int, default=8,
                    help="hf-seq runs only the first N requests (it is the slowest); its tok/s is over those")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention", default="auto", help="backend.options.attention for ours")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default=None,
                    help="backend.kv_cache_memory for ours (default: exactly the blocks the workload needs)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = ap.parse_args(argv)

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r} (choose from {', '.join(MODELS)})")
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    for p in peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p!r} (choose from {', '.join(PEERS)})")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    transformers.logging.set_verbosity_error()
    from llmserve_torch.checkpoint import read_arch

    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    N = args.max_new_tokens
    report = {"machine": machine_info(), "workload": {
        "requests": args.requests, "prompt_lens": f"uniform [{args.min_prompt}, {args.max_prompt}]",
        "prompt_tokens": sum(lens), "new_tokens": N, "greedy": True, "ignore_eos": True, "seed": args.seed},
        "results": []}
    bandwidth = measure_bandwidth()
    report["machine"]["bandwidth_gbs"] = bandwidth / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model_dir = make_model_dir(name, Path(tmp))
            arch = read_arch(model_dir)
            prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in lens]
            for dt in dtypes:
                row = {"model": name, "dtype": dt}
                if not args.json:
                    print(f"== {name} {dt}: measuring the machine's limit ...", file=sys.stderr)
                load0 = os.getloadavg()[0]
                row["limit"] = workload_limit(arch, DTYPES[dt], lens, N, args.max_num_batched_tokens, bandwidth)
                row["limit"]["loadavg"] = [load0, os.getloadavg()[0]]
                load0 = os.getloadavg()[0]
                ours = run_ours(model_dir, dt, prompts, N, args)
                ours["loadavg"] = [load0, os.getloadavg()[0]]
                row["ours"] = {k: v for k, v in ours.items() if k != "tokens"}
                _rates(row["ours"])
                if peers:
                    hf = hf_model(model_dir, arch, DTYPES[dt], args.seed)
                    for peer in peers:
                        load0 = os.getloadavg()[0]
                        if peer == "hf-seq":
                            r = run_hf_seq(hf, prompts[: args.seq_requests], N, args.json)
                            same = sum(a == b for a, b in zip(ours["tokens"], r["tokens"]))
                            r["identical_to_ours"] = f"{same}/{len(r['tokens'])}"
                            # bf16 rounding differs between implementations: report how long outputs agree
                            r["mean_common_prefix"] = sum(_common_prefix(a, b) for a, b in
                                                          zip(ours["tokens"], r["tokens"])) / len(r["tokens"])
                        elif peer == "hf-static":
                            r = run_hf_static(hf, prompts, N, arch.eos_token_id or 0, args.json)
                        else:
                            r = run_hf_cb(hf, prompts, N, args.json)
                        r.pop("tokens")
                        r["loadavg"] = [load0, os.getloadavg()[0]]
                        _rates(r)
                        row[peer] = r
                    del hf
                row["ratios"] = {"ours/limit": row["ours"]["tok_s"] / row["limit"]["limit_tok_s"]}
                for peer in peers:
                    row["ratios"][f"ours/{peer}"] = row["ours"]["tok_s"] / row[peer]["tok_s"]
                # the same ratios with each run charged its CPU time / threads: steadier when others share the CPU
                row["ratios_cpu"] = {"ours/limit": row["ours"]["tok_s_cpu"] / row["limit"]["limit_tok_s"]}
                for peer in peers:
                    row["ratios_cpu"][f"ours/{peer}"] = row["ours"]["tok_s_cpu"] / row[peer]["tok_s_cpu"]
                report["results"].append(row)
                if not args.json:
                    print_row(row, peers)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_summary(report, peers)
    return 0


def print_row(row: dict, peers: list[str]) -> None:
    """One model/dtype: the limit, every system's throughput, the ratios, KV use at peak."""
    lim = row["limit"]
    kv = row["ours"]["kv_peak"] or {}

    def load(r: dict) -> str:
        return "load avg {:.1f} -> {:.1f}".format(*r["loadavg"])

    def line(name: str, r: dict, extra: str = "") -> str:
        return (f"  {name:10s} {r['tok_s']:8.1f} tok/s wall, {r['tok_s_cpu']:8.1f} per CPU  "
                f"({r['output_tokens']} tokens in {r['seconds']:.1f}s, {load(r)}{extra})")

    print(f"\n{row['model']} {row['dtype']}: limit {lim['limit_tok_s']:.0f} tok/s "
          f"(GEMM {lim['gemm_gflops_decode']:.0f} GFLOP/s decode, {lim['gemm_gflops_prefill']:.0f} prefill; "
          f"bandwidth {lim['bandwidth_gbs']:.1f} GB/s; decode {lim['decode_bound_by']}-bound; {load(lim)})")
    print(line("ours", row["ours"], f", attention={row['ours']['attention']}"))
    for p in peers:
        extra = (f", identical to ours: {row[p]['identical_to_ours']}, mean common prefix "
                 f"{row[p]['mean_common_prefix']:.0f} tokens" if "identical_to_ours" in row[p] else "")
        print(line(p, row[p], extra))
    print("  ratios (wall):    " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()))
    print("  ratios (per CPU): " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios_cpu"].items()))
    if kv:
        print(f"  KV at peak: {kv['used_slots']} used of {kv['reserved_slots']} reserved slots "
              f"(waste {100 * kv['waste_fraction']:.1f}%)")


def print_summary(report: dict, peers: list[str]) -> None:
    """Machine, workload, and one table row per model/dtype."""
    m = report["machine"]
    w = report["workload"]
    print(f"\nmachine: {m['cpu']}, {m['cpus']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}, "
          f"{m['threads']} threads, read bandwidth {m['bandwidth_gbs']:.1f} GB/s")
    print(f"workload: {w['requests']} requests, prompts {w['prompt_lens']} ({w['prompt_tokens']} tokens), "
          f"{w['new_tokens']} new tokens each, greedy, EOS ignored, seed {w['seed']}")
    print("tok/s by wall clock; 'per CPU' charges each run its CPU time / threads (steadier on a shared machine); "
          "a load average above the thread count during a run means another process shared the CPU")
    head = ["model", "dtype", "limit", "ours", *peers, "ours/limit", *[f"ours/{p}" for p in peers]]
    print(" | ".join(head))
    for r in report["results"]:
        for kind, key, ratios in (("wall", "tok_s", "ratios"), ("per CPU", "tok_s_cpu", "ratios_cpu")):
            cells = [r["model"], f"{r['dtype']} ({kind})", f"{r['limit']['limit_tok_s']:.0f}", f"{r['ours'][key]:.1f}",
                     *[f"{r[p][key]:.1f}" for p in peers], *[f"{v:.2f}" for v in r[ratios].values()]]
            print(" | ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
