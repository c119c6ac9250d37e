#!/usr/bin/env python
"""Accuracy, reported: perplexity on a fixed text and greedy agreement, per model.quantization and dtype.

Everything runs through llmserve's own engine (prompt logprobs and greedy decoding), one engine
per (dtype, quantization) setting, the setting passed through the config (model.quantization,
model.dtype), nothing else changed:

  perplexity  PPL = exp(mean NLL) over the tokens of tests/data/perplexity.txt, each token scored
              exactly once. Windows of --ctx tokens, moved --stride tokens at a time: the first
              window scores its tokens 1..ctx-1, each later one only its last `stride` tokens (the
              ones no earlier window reached), so every token after the first is scored once and,
              past the first window, with at least ctx - stride tokens of context. The first token
              has no context and is not scored (the model adds no BOS: tokenizer.ggml.add_bos_token
              is false for the default model).
  agreement   20 fixed chat prompts (the chat template applied through the engine's tokenizer, as
              the server does), greedy, the first --max-tokens tokens (EOS ends a sequence early);
              per setting: how many of the 20 outputs equal the reference's token for token, and
              the mean length of the common prefix. The reference is `none` at the same dtype; for
              `none` at another dtype, `none` at the first dtype.

quantization: none (every weight dequantized to dtype) | int8 | int4 (round-to-nearest at load) |
auto (a GGUF's Q4_1 / Q8_0 tensors kept quantized). Deltas are (PPL - PPL_ref) / PPL_ref in %.

With --llama-perplexity PATH, llama.cpp's `llama-perplexity -f TEXT -m GGUF -c CTX` runs on the same
text and file and its "Final estimate" is printed beside ours computed its way (chunks of ctx
tokens, no overlap, each scoring its second half: positions ctx/2+1 .. ctx-1, a trailing partial
chunk dropped), so that the two numbers score the same tokens with the same context.

Threads: one by default (--threads). The figures do not depend on speed, and on a shared 2-core
machine two threads' OpenMP barriers cost far more than the second core gains: with the load of
other jobs at ~8, one setting of the default model took 288 s with 2 threads and 73 s with 1, for
the same perplexity to the last printed digit. On a quiet machine, --threads 0 (torch's default) is
faster.

The text, tests/data/perplexity.txt: Jane Austen, "Pride and Prejudice" (1813, public domain),
chapters 1 and 2 and the first part of chapter 3, written out from memory; it may differ from the
Project Gutenberg edition in small details. About 2,800 tokens with the default model's tokenizer.

    python benchmarks/accuracy.py                        # float32; none, auto, int8, int4
    python benchmarks/accuracy.py --dtype float32 bfloat16 --json
    python benchmarks/accuracy.py --quantization none int8 --ctx 1024 --stride 512
    python benchmarks/accuracy.py --llama-perplexity ~/llama.cpp/build/bin/llama-perplexity
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "plugins"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

TEXT = ROOT / "tests" / "data" / "perplexity.txt"
QUANTIZATIONS = ("none", "auto", "int8", "int4")
DTYPES = ("float32", "bfloat16")

# 20 short chat prompts: facts, arithmetic, instructions, rewriting, code, lists, advice
PROMPTS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what photosynthesis is.",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
    "Write a Python function that returns the square of a number.",
    "Who wrote 'Romeo and Juliet'?",
    "List the days of the week.",
    "Summarize the story of Cinderella in two sentences.",
    "What does a thermometer measure?",
    "Suggest a name for a black cat.",
    "Why is the sky blue?",
    "Rewrite this sentence politely: Give me the report now.",
    "What is the largest planet in our solar system?",
    "Give two tips for sleeping better.",
    "Is 17 a prime number? Answer yes or no, then explain.",
]


# --- windows ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens [start, end) go in as one prompt; the tokens at positions [score_from, end) are scored."""

    start: int
    end: int
    score_from: int


def stride_windows(n: int, ctx: int, stride: int) -> list[Window]:
    """Windows of at most ctx tokens, stride apart, scoring every position 1..n-1 exactly once."""
    if not 1 <= stride <= ctx - 1:
        raise ValueError(f"stride must be in [1, ctx - 1], got stride {stride} with ctx {ctx}")
    out: list[Window] = []
    prev_end = 1  # position 0 has no context
    begin = 0
    while prev_end < n:
        end = min(begin + ctx, n)
        out.append(Window(begin, end, prev_end))
        prev_end = end
        begin += stride
    return out


def llama_windows(n: int, ctx: int) -> list[Window]:
    """llama-perplexity's way: n // ctx chunks of ctx tokens, each scoring positions ctx/2 + 1 .. ctx - 1."""
    return [Window(k * ctx, (k + 1) * ctx, k * ctx + ctx // 2 + 1) for k in range(n // ctx)]


# --- perplexity through the engine ------------------------------------------------------------------


def scored_logprobs(engine: Any, ids: Sequence[int], windows: Sequence[Window],
                    on_tokens: Callable[[int], None] | None = None) -> dict[int, float]:
    """Position → logprob of ids[position] given the window before it, from the engine's prompt logprobs."""
    from llmserve.request import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    sp.validate()
    rids = {engine.add_request(list(ids[w.start:w.end]), sp, request_id=f"w{i}"): w for i, w in enumerate(windows)}
    got: dict[str, list] = {}
    while engine.has_unfinished:
        step = engine.step()
        for o in step.outputs:
            if o.error:
                raise RuntimeError(f"window {o.request_id} failed: {o.error}")
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
        if on_tokens is not None and step.metrics is not None:
            on_tokens(step.metrics.num_prefill_tokens)
    out: dict[int, float] = {}
    for rid, w in rids.items():
        plp = got[rid]
        assert len(plp) == w.end - w.start and plp[0] is None, f"{rid}: {len(plp)} prompt logprobs"
        for pos in range(max(w.score_from, w.start + 1), w.end):
            e = plp[pos - w.start]
            assert e.token_id == ids[pos], f"{rid}: the logprob at {pos} is of token {e.token_id}, not {ids[pos]}"
            assert pos not in out, f"position {pos} scored twice"
            out[pos] = e.logprob
    return out


def perplexity(engine: Any, ids: Sequence[int], windows: Sequence[Window],
               on_tokens: Callable[[int], None] | None = None) -> dict[str, Any]:
    """PPL = exp(mean NLL) over the scored positions of the windows."""
    if not windows:
        raise ValueError(f"nothing to score: {len(ids)} tokens")
    lps = scored_logprobs(engine, ids, windows, on_tokens)
    nll = -math.fsum(lps.values()) / len(lps)
    return {"ppl": math.exp(nll), "mean_nll": nll, "tokens_scored": len(lps), "windows": len(windows)}


# --- greedy agreement --------------------------------------------------------------------------------


def chat_prompt_ids(engine: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as one user message through the engine tokenizer's chat template (the server's way)."""
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                       add_special_tokens=False) for p in prompts]


def greedy(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
           on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy outputs of every prompt (batched by the engine), EOS honoured."""
    from llmserve.request import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    sp.validate()
    ids = [engine.add_request(list(p), sp, request_id=f"g{i}") for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        step = engine.step()
        n = 0
        for o in step.outputs:
            if o.error:
                raise RuntimeError(f"prompt {o.request_id} failed: {o.error}")
            out[o.request_id].extend(o.new_token_ids)
            n += len(o.new_token_ids)
        if on_tokens is not None:
            on_tokens(n)
    return [out[i] for i in ids]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Outputs identical to the reference, and the mean common-prefix length."""
    prefixes = [common_prefix(r, g) for r, g in zip(ref, got, strict=True)]
    return {"exact": sum(list(r) == list(g) for r, g in zip(ref, got)), "of": len(ref),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "common_prefix": prefixes}


# --- llama.cpp -----------------------------------------------------------------------------------------

_FINAL = re.compile(r"Final estimate:\s*PPL\s*=\s*([0-9.]+)(?:\s*\+/-\s*([0-9.]+))?")


def parse_llama_perplexity(output: str) -> tuple[float, float | None]:
    """(PPL, its +/-) from llama-perplexity's "Final estimate: PPL = 12.3456 +/- 0.12345" line."""
    m = _FINAL.findall(output)
    if not m:
        raise ValueError("no 'Final estimate: PPL = ...' line in llama-perplexity's output")
    ppl, err = m[-1]
    return float(ppl), float(err) if err else None


def run_llama_perplexity(binary: str, text: Path, gguf: Path, ctx: int, threads: int | None) -> dict[str, Any]:
    cmd = [binary, "-f", str(text), "-m", str(gguf), "-c", str(ctx)]
    if threads:
        cmd += ["-t", str(threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = {"command": " ".join(cmd), "seconds": time.perf_counter() - t0, "returncode": p.returncode}
    try:
        out["ppl"], out["ppl_error"] = parse_llama_perplexity(p.stdout + "\n" + p.stderr)
    except ValueError as e:
        out["error"] = f"{e}; exit {p.returncode}; last lines: " + " | ".join((p.stdout + p.stderr).splitlines()[-5:])
    return out


def gguf_of(model: str) -> Path | None:
    """The GGUF file behind model.model (a packaged name, a .gguf file or a directory holding one)."""
    from llmserve_torch.packaged import PACKAGED, resolve

    if model in PACKAGED:
        return resolve(model)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        return found[0] if len(found) == 1 else None
    return None


# --- the run --------------------------------------------------------------------------------------------


def report_machine() -> dict[str, Any]:
    """llmserve_bench.report.machine_info() (imported late: the script puts the repo on sys.path first)."""
    import torch
    from llmserve_bench.report import machine_info

    return {**machine_info(), "torch": torch.__version__}


def build_engine(args: argparse.Namespace, dtype: str, quantization: str):
    from llmserve.config import load_config
    from llmserve.engine import Engine
    from llmserve.plugins import load_plugins

    overrides = {"model.model": args.model, "model.dtype": dtype, "model.quantization": quantization,
                 "model.threads": args.threads, "backend.kv_cache_memory": args.kv_cache_memory}
    return Engine(load_config(args.config, overrides), load_plugins())


def bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False, disable=not enabled, dynamic_ncols=True)


def run_setting(args, dtype: str, q: str, text: str, progress: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"dtype": dtype, "quantization": q}
    t0 = time.perf_counter()
    eng = build_engine(args, dtype, q)
    row["load_s"] = time.perf_counter() - t0
    try:
        ids = eng.tokenizer.encode(text, add_special_tokens=True)
        wins = stride_windows(len(ids), args.ctx, args.stride)
        row["text_tokens"] = len(ids)
        row["backend"] = {k: v for k, v in eng.backend.describe().items()
                          if k in ("dtype", "linear", "weights", "threads")}
        label = f"{dtype}/{q}"
        t0 = time.perf_counter()
        with bar(sum(w.end - w.start for w in wins), f"{label} perplexity", progress) as b:
            row.update(perplexity(eng, ids, wins, b.update))
        row["ppl_s"] = time.perf_counter() - t0
        if args.llama_perplexity:
            lw = llama_windows(len(ids), args.ctx)
            with bar(sum(w.end - w.start for w in lw), f"{label} llama.cpp windows", progress) as b:
                row["ppl_llama_windows"] = perplexity(eng, ids, lw, b.update)["ppl"]
        prompts = chat_prompt_ids(eng, PROMPTS[: args.prompts])
        t0 = time.perf_counter()
        with bar(len(prompts) * args.max_tokens, f"{label} greedy", progress) as b:
            row["greedy"] = greedy(eng, prompts, args.max_tokens, b.update)
        row["greedy_s"] = time.perf_counter() - t0
    finally:
        eng.shutdown()
        del eng
        gc.collect()
    return row


def fmt_table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [
        f"model {report['model']} ({report['weights']}); {report['machine']['cpu']}, "
        f"{report['machine']['cpus']} cores, torch {report['machine']['torch']}",
        f"perplexity: {report['text']} ({report['text_tokens']} tokens), windows of {report['ctx']} "
        f"stride {report['stride']}: {rows[0]['windows']} windows, {rows[0]['tokens_scored']} tokens scored",
        f"agreement: {report['prompts']} chat prompts, greedy, first {report['max_tokens']} tokens, "
        "against the reference (ref); mean prefix: tokens in common with it, mean len: this row's own",
        "",
    ]
    llama = "ppl_llama_windows" in rows[0]
    head = ["dtype", "quantization", "PPL", "vs ref", "ref", "greedy exact", "mean prefix", "mean len", "load s",
            "ppl s", "greedy s"]
    if llama:
        head.insert(3, "PPL (llama.cpp windows)")
    table = [head]
    for r in rows:
        if "error" in r:
            table.append([r["dtype"], r["quantization"], "failed: " + r["error"]])
            continue
        a = r.get("agreement")
        cells = [r["dtype"], r["quantization"], f"{r['ppl']:.4f}",
                 "-" if r.get("ref") is None else f"{r['delta_pct']:+.2f}%", r.get("ref") or "-",
                 f"{a['exact']}/{a['of']}" if a else "-", f"{a['mean_common_prefix']:.1f}" if a else "-",
                 f"{sum(map(len, r['greedy'])) / len(r['greedy']):.1f}",
                 f"{r['load_s']:.1f}", f"{r['ppl_s']:.1f}", f"{r['greedy_s']:.1f}"]
        if llama:
            cells.insert(3, f"{r['ppl_llama_windows']:.4f}")
        table.append(cells)
    widths = [max(len(row[i]) for row in table if i < len(row) and len(row) == len(head)) for i in range(len(head))]
    for row in table:
        if len(row) != len(head):
            lines.append("  ".join(row))
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    lp = report.get("llama_perplexity")
    if lp:
        lines.append("")
        if "ppl" in lp:
            err = f" +/- {lp['ppl_error']:.4f}" if lp.get("ppl_error") is not None else ""
            lines.append(f"llama.cpp: {lp['command']}: Final estimate PPL = {lp['ppl']:.4f}{err} "
                         f"({lp['seconds']:.1f} s)")
        else:
            lines.append(f"llama.cpp: {lp['command']}: {lp['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model.model (default: the default model)")
    ap.add_argument("--config", default=None, help="a YAML config the settings are applied on top of")
    ap.add_argument("--quantization", nargs="+", default=list(QUANTIZATIONS), choices=QUANTIZATIONS,
                    help="settings of model.quantization (none is always run: it is the reference)")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=DTYPES)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="window length in tokens")
    ap.add_argument("--stride", type=int, default=None, help="window stride (default ctx/2)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} chat prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="model.threads (default 1: see the module docstring; 0: torch's default)")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--llama-perplexity", default=None, metavar="PATH", help="a llama.cpp llama-perplexity binary")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF for llama-perplexity (default: the model's)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ap.add_argument("--save", type=Path, default=None, metavar="FILE", help="also write the JSON report to FILE")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.stride = args.stride or args.ctx // 2
    args.threads = args.threads or None
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    stride_windows(args.ctx, args.ctx, args.stride)  # a bad stride fails now, not after a model load
    text = args.text.read_text(encoding="utf-8")
    progress = not args.no_progress and sys.stderr.isatty()
    quants = ["none"] + [q for q in dict.fromkeys(args.quantization) if q != "none"]

    where = args.text.resolve()
    report: dict[str, Any] = {"model": args.model, "text": str(where.relative_to(ROOT) if where.is_relative_to(ROOT)
                                                               else args.text),
                              "ctx": args.ctx, "stride": args.stride, "prompts": args.prompts,
                              "max_tokens": args.max_tokens, "threads": args.threads, "machine": report_machine(),
                              "rows": []}
    refs: dict[str, dict[str, Any]] = {}  # dtype → its none row
    t_all = time.perf_counter()
    for dtype in dict.fromkeys(args.dtype):
        for q in quants:
            try:
                row = run_setting(args, dtype, q, text, progress)
            except Exception as e:  # a setting the backend refuses is reported, the others still run
                if q == "none":
                    raise
                report["rows"].append({"dtype": dtype, "quantization": q, "error": f"{type(e).__name__}: {e}"})
                continue
            if q == "none":  # against none at the first dtype (none for the first dtype itself)
                ref = refs[next(iter(refs))] if refs else None
                refs[dtype] = row
            else:
                ref = refs[dtype]
            if ref is not None:
                row["ref"] = f"{ref['dtype']}/{ref['quantization']}"
                row["delta_pct"] = 100.0 * (row["ppl"] - ref["ppl"]) / ref["ppl"]
                row["agreement"] = agreement(ref["greedy"], row["greedy"])
            report["rows"].append(row)
            if not progress:
                print(f"{dtype}/{q}: PPL {row['ppl']:.4f} ({row['load_s'] + row['ppl_s'] + row['greedy_s']:.0f} s)",
                      file=sys.stderr)
    report["seconds"] = time.perf_counter() - t_all
    first = report["rows"][0]
    report["text_tokens"] = first["text_tokens"]
    report["weights"] = first["backend"].get("weights", "?")
    if args.llama_perplexity:
        gguf = args.gguf or gguf_of(args.model)
        if gguf is None:
            report["llama_perplexity"] = {"command": args.llama_perplexity, "error": "no GGUF file: pass --gguf"}
        else:
            report["llama_perplexity"] = run_llama_perplexity(args.llama_perplexity, args.text, gguf, args.ctx,
                                                              args.threads)
    if args.save:
        args.save.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(fmt_table(report))
        print(f"\nwhole run {report['seconds']:.0f} s, {args.threads or 'default'} torch threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
