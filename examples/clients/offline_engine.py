#!/usr/bin/env python3
"""The offline Python API: build an Engine from a config, add requests, step until done. No server.

    python examples/clients/offline_engine.py                      # fake backend: runs anywhere, instantly
                                                                   # (its "text" is deterministic random bytes)
    python examples/clients/offline_engine.py --backend torch      # the embedded tiny model (CPU)
    python examples/clients/offline_engine.py --json               # one JSON object per completion

Run from the repository root (or with llmserve installed); the script puts the source tree on
sys.path when llmserve is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    import llmserve  # noqa: F401
except ImportError:  # not installed: use the source tree this script lives in
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "plugins")]

from llmserve.engine import Engine
from llmserve.errors import LLMServeError
from llmserve.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
]


def main(argv: list[str] | None = None) -> int:
    """Generate a completion for each prompt, streaming the text of the first one as it is produced."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["fake", "torch"], default="fake",
                    help="fake: deterministic, no model; torch: the embedded tiny model")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object per completion")
    args = ap.parse_args(argv)

    # the same settings a YAML file under configs/ would hold
    config = {
        "model": {"model": "embedded"},
        "backend": {"name": args.backend, "kv_cache_memory": "64MiB"} if args.backend == "torch"
        else {"name": "fake"},
        "tokenizer": {"name": "auto"},  # byte-level for the embedded model and the fake backend
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
    }
    try:
        engine = Engine.from_config(config)
    except LLMServeError as e:  # e.g. the torch plugin is not installed
        print(f"offline_engine: cannot start the engine: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)

    t0 = time.perf_counter()
    ids = [engine.add_request(tok.encode(p), params, request_id=f"req-{i}") for i, p in enumerate(PROMPTS)]
    texts = {rid: "" for rid in ids}
    tokens = {rid: 0 for rid in ids}
    reasons: dict[str, str] = {}
    if not args.json:
        print(f"[{ids[0]}] {PROMPTS[0]!r} →", end=" ", flush=True)
    while engine.has_unfinished:
        for out in engine.step().outputs:  # a delta per sequence that advanced this step
            texts[out.request_id] += out.new_text
            tokens[out.request_id] += len(out.new_token_ids)
            if out.request_id == ids[0] and not args.json:
                print(out.new_text, end="", flush=True)  # streaming: text as soon as it is stable
            if out.finished:
                reasons[out.request_id] = out.finish_reason.value
    elapsed = time.perf_counter() - t0

    if args.json:
        for rid, prompt in zip(ids, PROMPTS):
            print(json.dumps({"request_id": rid, "prompt": prompt, "text": texts[rid],
                              "num_tokens": tokens[rid], "finish_reason": reasons[rid]}))
    else:
        print(f"  ({reasons[ids[0]]})")
        for rid, prompt in list(zip(ids, PROMPTS))[1:]:
            print(f"[{rid}] {prompt!r} → {texts[rid]!r} ({reasons[rid]})")
        snap = engine.metrics_snapshot()
        print(f"{sum(tokens.values())} tokens in {elapsed:.3f}s over {snap['steps']} steps; "
              f"TTFT p50 {snap['latency_seconds']['ttft']['p50']:.4f}s")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
