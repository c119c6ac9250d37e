#!/usr/bin/env python
"""Greedy token identity of llmserve's GGUF load against transformers' own GGUF load, in float32.

transformers dequantizes the same file (`from_pretrained(dir, gguf_file=...)`, which needs
`pip install accelerate`); llmserve converts it through its model source and serves it. Both
run greedy on a chat prompt (rendered by each side's chat template, which must agree), a
completion, and a longer story with EOS ignored. Default file: the default model's GGUF.

    python benchmarks/gguf_vs_hf.py [--gguf FILE] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

CASES = [  # name, text, new tokens, ignore EOS
    ("chat", "What is the capital of France?", 32, False),
    ("completion", "The capital of France is", 30, False),
    ("story", "Once upon a time", 64, True),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the default model's, fetched if needed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmserve.engine import Engine
    from llmserve.request import SamplingParams
    from llmserve_torch.packaged import DEFAULT_MODEL, resolve

    path = Path(args.gguf) if args.gguf else resolve(DEFAULT_MODEL)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = Engine.from_config({"model": {"model": str(path), "dtype": "float32"}, "backend": {"kv_cache_memory": "256MiB"}})
    ours_load = time.perf_counter() - t0
    report = {"gguf": str(path), "hf_load_s": hf_load, "llmserve_load_s": ours_load, "cases": []}
    for name, text, n, ignore_eos in CASES:
        if name == "chat":
            msgs = [{"role": "user", "content": text}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert text == eng.tokenizer.apply_chat_template(msgs), "the chat templates render differently"
        ids = tok(text, add_special_tokens=name != "chat")["input_ids"]
        assert ids == eng.tokenizer.encode(text, add_special_tokens=name != "chat"), f"{name}: the prompts encode differently"
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None if ignore_eos else tok.eos_token_id)
        ref = out[0, len(ids):].tolist()
        got = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos))[0]
        report["cases"].append({"name": name, "prompt_tokens": len(ids), "tokens": len(got),
                                "identical": got == ref, "text": tok.decode(got)})
    eng.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{path.name}: transformers load {hf_load:.1f} s, llmserve load {ours_load:.1f} s (float32)")
        for c in report["cases"]:
            print(f"  {c['name']:<10} {c['tokens']:>3} tokens {'identical' if c['identical'] else 'DIFFER'}: {c['text']!r}")
    return 0 if all(c["identical"] for c in report["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
