#!/usr/bin/env python
"""Structured vs unconstrained decoding throughput: 64 concurrent sequences on the GPT-2 124M shape.

One engine (torch backend, seeded random weights of the GPT-2 124M shape, the default model's
real 49,152-token tokenizer, llguidance), rounds alternated in one run: every sequence decodes
--max-tokens tokens either freely or under a json_schema whose array needs more items than fit,
so both runs produce the same number of tokens and the difference is the constraint's cost.
Mask cost per step (Constraints.fill on the engine thread) is timed separately.

    python benchmarks/structured_throughput.py [--requests 64] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins"), str(ROOT / "benchmarks")]

from grammar_engines import SCHEMA, real_tokenizer  # noqa: E402
from shapes import SHAPES  # noqa: E402

from llmserve_bench.report import machine_info  # noqa: E402
from llmserve.engine import Engine  # noqa: E402
from llmserve.request import SamplingParams, StructuredOutput  # noqa: E402

# more items than --max-tokens can hold: every constrained sequence runs to max_tokens, as the free ones do
LONG = {"type": "object", "additionalProperties": False, "required": ["people"],
        "properties": {"people": {"type": "array", "items": SCHEMA, "minItems": 100}}}


def build_engine(args, tmp: Path) -> Engine:
    import transformers

    kw = dict(SHAPES["gpt2"])
    kw.pop("model_type")
    transformers.GPT2Config(**kw).save_pretrained(tmp / "gpt2")
    tok_dir = Path(real_tokenizer().name)
    return Engine.from_config({
        "model": {"model": str(tmp / "gpt2"), "tokenizer": str(tok_dir), "dtype": args.dtype, "load_format": "dummy"},
        "tokenizer": {"name": "hf"},
        "backend": {"name": "torch", "kv_cache_memory": "1GiB"},
        "scheduler": {"max_num_seqs": args.requests, "max_num_batched_tokens": 2048},
        "cache": {"enable_prefix_caching": False},
    })


def run(engine: Engine, args, structured: StructuredOutput | None) -> dict:
    """One round: --requests sequences at once; tokens per second and the mask time per decode step."""
    fill = engine.constraints.fill
    mask_s: list[float] = []

    def timed_fill(batch, seqs):
        t0 = time.perf_counter()
        fill(batch, seqs)
        if batch.token_bitmask is not None:
            mask_s.append(time.perf_counter() - t0)

    engine.constraints.fill = timed_fill
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=None, ignore_eos=True, structured=structured)
    prompt = engine.tokenizer.encode("Extract every person mentioned in the text below as JSON. " * 2)[: args.prompt_len]
    try:
        t0 = time.perf_counter()
        for _ in range(args.requests):
            engine.add_request(prompt, sp)
        tokens = 0
        texts: dict[str, list[int]] = {}
        while engine.has_unfinished:
            for o in engine.step().outputs:
                tokens += len(o.new_token_ids)
                texts.setdefault(o.request_id, []).extend(o.new_token_ids)
        wall = time.perf_counter() - t0
    finally:
        engine.constraints.fill = fill
    sample = engine.tokenizer.decode(next(iter(texts.values())))[:120]
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "sample": sample,
            "mask_ms_per_step": statistics.mean(mask_s) * 1e3 if mask_s else 0.0,
            "mask_ms_per_step_p99": sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e3 if mask_s else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    spec = StructuredOutput("json", json.dumps(LONG))
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, Path(tmp))
        engine.constraints.compile(spec)  # compiled once, as a server would have on the first such request
        run(engine, argparse.Namespace(**{**vars(args), "requests": 4, "max_tokens": 8}), spec)  # warm-up
        rounds: dict[str, list[dict]] = {"free": [], "json_schema": []}
        for _ in range(args.rounds):  # alternated, so drift on a shared machine hits both alike
            rounds["free"].append(run(engine, args, None))
            rounds["json_schema"].append(run(engine, args, spec))
        engine.shutdown()
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in rounds.items()}
    ratio = best["json_schema"]["tokens_per_s"] / best["free"]["tokens_per_s"]
    report = {"machine": machine_info(), "requests": args.requests, "max_tokens": args.max_tokens,
              "rounds": rounds, "best": best, "structured_vs_free": ratio}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"GPT-2 124M shape, {args.requests} sequences × {args.max_tokens} tokens, {report['machine']['cpu']}")
    for k, r in best.items():
        print(f"  {k:12} {r['tokens_per_s']:8.1f} tok/s   mask {r['mask_ms_per_step']:.2f} ms/step "
              f"(p99 {r['mask_ms_per_step_p99']:.2f})   {r['sample']!r}")
    print(f"  structured / free: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
