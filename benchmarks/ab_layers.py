#!/usr/bin/env python
"""Two builds of the kernel library in one process: the fused layers' C call of a git revision's csrc/ against
this tree's, taking turns every few decode steps of one engine.

The VM this project is measured on changes its memory bandwidth between runs (the bound's probe read 55 and
95 GB/s minutes apart), so two runs of `llmserve bench offline` compare machines as much as code. Here both
builds run the same steps' tables in turn, four calls each in the order A B B A, so a change of machine falls on
both (in plain alternation the build that went first was 2-3 % faster at 8 sequences with the same code on both
sides; A B B A reads 0.995-1.016 there, 0.997-1.001 at one). For revisions whose decode_layers.cpp tables (Model,
Scratch, Step) are laid out as this tree's; the K/V each call writes is the same.

    python benchmarks/ab_layers.py                      # HEAD's kernels against the working tree's
    python benchmarks/ab_layers.py --base HEAD~3 -c 8 --json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from profile_step import build_engine, engine_arguments, start_decoding  # noqa: E402

CSRC = "plugins/llmserve_torch/csrc"


def build_revision(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel library of `rev`'s csrc/, compiled as the backend compiles this tree's."""
    from llmserve_torch.kernel_library import cxx_flags

    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out_dir)], input=archive, check=True)
    src = out_dir / CSRC
    so = out_dir / "kernels.so"
    subprocess.run(["g++", *cxx_flags("native"), f"-I{src}", *map(str, sorted(src.glob("*.cpp"))), "-o", str(so)],
                   check=True)
    return ctypes.CDLL(str(so))


def run(args) -> dict:
    engine = build_engine(args)
    stack = engine.backend.stack
    if stack is None:
        raise SystemExit(f"the fused layers do not run here: {engine.backend.stack_note}")
    if not stack.covers(args.concurrency):
        raise SystemExit(f"a step of {args.concurrency} rows runs outside the fused layers (up to {stack.max_rows})")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_revision(args.base, Path(tmp)).llmserve_decode_layers
    ours = stack._fn
    base.restype, base.argtypes = ours.restype, ours.argtypes
    builds = {args.base: base, "this tree": ours}
    times: dict[str, list[float]] = {k: [] for k in builds}
    calls = 0

    def alternate(*a):  # `--turn` calls of each build in the order A B B A: neither always goes first
        nonlocal calls
        name = list(builds)[(0, 1, 1, 0)[calls // args.turn % 4]]
        t0 = time.perf_counter()
        builds[name](*a)
        times[name].append(time.perf_counter() - t0)
        calls += 1

    start_decoding(engine, args.concurrency, args.prompt_len, args.steps, seed=0)  # prefill: outside the stack
    stack._fn = alternate
    try:
        for _ in range(args.steps):
            engine.step()
    finally:
        stack._fn = ours
    skip = 2 * args.turn  # each build's first two turns: warm-up
    res = {name: {"p50_ms": statistics.median(t[skip:]) * 1e3, "mean_ms": statistics.mean(t[skip:]) * 1e3,
                  "calls": len(t) - skip} for name, t in times.items()}
    return {"base": args.base, "concurrency": args.concurrency, "contexts": [args.prompt_len,
                                                                             args.prompt_len + args.steps],
            "builds": res, "ratio_p50": res["this tree"]["p50_ms"] / res[args.base]["p50_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels this tree's are compared with")
    engine_arguments(ap, prompt_len=64)
    ap.add_argument("--steps", type=int, default=400, help="decode steps, shared between the builds")
    ap.add_argument("--turn", type=int, default=4, help="calls of one build before the other's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"fused layers' C call, c = {r['concurrency']}, contexts {r['contexts'][0]}-{r['contexts'][1]} tokens, "
          f"builds taking turns of {args.turn} calls, A B B A")
    for name, b in r["builds"].items():
        print(f"  {name:>12}: p50 {b['p50_ms']:.3f} ms  mean {b['mean_ms']:.3f} ms  ({b['calls']} calls)")
    print(f"  this tree / {r['base']}: {r['ratio_p50']:.3f} (p50)")


if __name__ == "__main__":
    main()
