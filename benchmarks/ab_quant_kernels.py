#!/usr/bin/env python
"""The group kernel (llmserve_quant_matmul) of a git revision's csrc/ against this tree's, both built for one
-march, timed in one process on a model's linear shapes and formats, taking turns A B B A.

The VM this project is measured on changes its memory bandwidth between runs, so only two builds timed in the same
run compare code (ab_layers.py). Weights are random values in each GGUF type's format, packed for each build's own
layout (its tile), at the file's shapes: by default the Qwen2.5-0.5B Q4_K_M file's (Q5_0 q|k|v, o, gate|up; Q8_0
q|k|v where v is Q8_0 and the tied head; Q4_K and Q6_K down) and the SmolLM2-135M Q4_1 file's.

    python benchmarks/ab_quant_kernels.py --march x86-64-v3            # HEAD against the tree, as an AVX2-only CPU
    python benchmarks/ab_quant_kernels.py --base HEAD~2 --rows 1 4 --json
    python benchmarks/ab_quant_kernels.py --extra "-mavx512vnni -mavx512vl"  # the AVX2 path's vpdpbusd (AVX-VNNI)
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

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from llmserve_torch import quant  # noqa: E402
from llmserve_torch.kernel_library import api, cxx_flags  # noqa: E402
from llmserve_torch.quant import Factors, QuantWeight  # noqa: E402

CSRC = "plugins/llmserve_torch/csrc"
# per GGUF type: (kind, offsets, scales per 16, K-quant factors)
TYPES = {"Q4_1": ("int4", True, False, False), "Q5_0": ("int5", False, False, False),
         "Q8_0": ("int8g", False, False, False), "Q4_K": ("int4", True, False, True),
         "Q6_K": ("int6", False, True, True)}
# (type, N, K, times a step): a decode step's linears on each file
MODELS = {
    "qwen2.5-0.5b:Q4_K_M": [("Q5_0", 1152, 896, 12), ("Q8_0", 1152, 896, 12), ("Q5_0", 896, 896, 24),
                            ("Q5_0", 9728, 896, 24), ("Q4_K", 896, 4864, 12), ("Q6_K", 896, 4864, 12),
                            ("Q8_0", 151936, 896, 1)],
    "llama-3.2-1b:Q4_K_M": [("Q4_K", 3072, 2048, 8), ("Q6_K", 3072, 2048, 8), ("Q4_K", 2048, 2048, 16),
                            ("Q4_K", 16384, 2048, 16), ("Q4_K", 2048, 8192, 8), ("Q6_K", 2048, 8192, 8),
                            ("Q6_K", 128256, 2048, 1)],
    "smollm2-135m:Q4_1": [("Q4_1", 960, 576, 30), ("Q4_1", 576, 576, 30), ("Q4_1", 3072, 576, 30),
                          ("Q4_1", 576, 1536, 30), ("Q4_1", 49152, 576, 1)],
}


def build(src: Path, march: str, extra: tuple[str, ...], so: Path) -> ctypes.CDLL:
    """quant_matmul.cpp of `src` compiled as the backend compiles the library, for `march` (and `extra` flags)."""
    subprocess.run(["g++", *cxx_flags(march, extra), f"-I{src}", str(src / "quant_matmul.cpp"), "-o", str(so)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    for name, (restype, argtypes) in api().functions.items():  # pack_own calls llmserve_pack_weight through it too
        if hasattr(lib, name):
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def random_weight(gguf_type: str, n: int, k: int, seed: int) -> QuantWeight:
    """A weight of random values and scales in a GGUF type's form (what gguf_quant.py makes of the file's blocks)."""
    kind, offsets, half, sup = TYPES[gguf_type]
    g = torch.Generator().manual_seed(seed)
    bits = quant.GROUP_BITS[kind]
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    parts = k // (16 if half else 32)
    if sup:
        d = torch.rand(n, k // 256, generator=g).half().float() * 1e-3
        sc = torch.randint(1, 64, (n, parts), generator=g, dtype=torch.int8)
        per = parts // d.shape[1]
        f = Factors(d, sc)
        scale, offset = d.repeat_interleave(per, 1) * sc.float(), None
        if offsets:
            m = torch.randint(0, 64, (n, parts), generator=g, dtype=torch.int8)
            f = Factors(d, sc, -d, m)
            offset = -d.repeat_interleave(per, 1) * m.float()
        return QuantWeight(kind, q, scale, offset, gguf_type, f)
    scale = (torch.rand(n, parts, generator=g) * 1e-2).half().float()
    offset = -(torch.rand(n, parts, generator=g) * 1e-1).half().float() if offsets else None
    return QuantWeight(kind, q, scale, offset, gguf_type)


def packed_for(lib: ctypes.CDLL, qw: QuantWeight) -> tuple[int, torch.Tensor]:
    """qw's format code and bytes as pack_own lays them out for `lib`'s build."""
    saved = quant._own_kernels
    quant._own_kernels = lambda: lib
    try:
        return quant.weight_format(qw), quant.pack_own(qw)
    finally:
        quant._own_kernels = saved


def time_calls(lib, fmt, packed, x, y, n, k, rows, threads, calls, narrow=0) -> float:
    """Seconds per call, the best of `calls` (after one warm-up)."""
    fn = lib.llmserve_quant_matmul
    args = (fmt, x.data_ptr(), k, rows, packed.data_ptr(), y.data_ptr(), n, n, k, x.element_size(), 4, threads, narrow)
    fn(*args)
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose csrc/ is A (default HEAD)")
    ap.add_argument("--march", default="x86-64-v3", help="-march both builds take (default x86-64-v3: AVX2 only)")
    ap.add_argument("--extra", default="", help="more compiler flags for both builds (e.g. -mavx512vnni -mavx512vl: "
                    "the AVX2 path's vpdpbusd, as AVX-VNNI runs it)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--min-n", type=int, default=0, help="only the linears of at least this many outputs")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="A B B A rounds")
    ap.add_argument("--narrow", nargs="?", const="b", choices=("b", "both"), default=None,
                    help="int8 activations (the narrow argument: a step's decodes past backend.options."
                    "int8_decode_rows) for B, A keeping int16 (b, the default), or for both builds (both)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, CSRC], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        extra = tuple(args.extra.split())
        libs = {"A": build(tmp / CSRC, args.march, extra, tmp / "a.so"),
                "B": build(ROOT / CSRC, args.march, extra, tmp / "b.so")}
        results = []
        for model in args.models:
            for seed, (t, n, k, times) in enumerate(MODELS[model]):
                if n < args.min_n:
                    continue
                qw = random_weight(t, n, k, seed)
                packs = {s: packed_for(lib, qw) for s, lib in libs.items()}
                for rows in args.rows:
                    x = torch.randn(rows, k).to(getattr(torch, args.dtype))
                    ys = {s: torch.empty(rows, n) for s in libs}
                    calls = max(3, min(200, int(2e8 / (n * k))))
                    got = {s: [] for s in libs}
                    for _ in range(args.rounds):
                        for s in "ABBA":
                            fmt, packed = packs[s]
                            got[s].append(time_calls(libs[s], fmt, packed, x, ys[s], n, k, rows, args.threads, calls,
                                                              rows if args.narrow == "both" or (args.narrow and s == "B") else 0))
                    err = (ys["A"] - ys["B"]).abs().max().item() / max(ys["A"].abs().max().item(), 1e-30)
                    a, b = statistics.median(got["A"]), statistics.median(got["B"])
                    results.append({"model": model, "type": t, "n": n, "k": k, "rows": rows, "times": times,
                                    "a_us": a * 1e6, "b_us": b * 1e6, "speedup": a / b, "rel_diff": err})
        for model in args.models:
            for rows in args.rows:
                rs = [r for r in results if r["model"] == model and r["rows"] == rows]
                a = sum(r["a_us"] * r["times"] for r in rs)
                b = sum(r["b_us"] * r["times"] for r in rs)
                results.append({"model": model, "type": "step", "rows": rows, "a_us": a, "b_us": b, "speedup": a / b})
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"A = {args.base}, B = this tree; -march={args.march} {args.extra}, {args.dtype}, {args.threads} threads; "
          "µs a call")
    for r in results:
        shape = f"{r['n']}x{r['k']}" if "n" in r else "a step's linears"
        extra = f"  |A-B|/max {r['rel_diff']:.1e}" if "rel_diff" in r else ""
        print(f"{r['model']:22} {r['type']:5} {shape:17} rows {r['rows']:3}: A {r['a_us']:9.1f}  B {r['b_us']:9.1f}"
              f"  A/B {r['speedup']:.2f}{extra}")


if __name__ == "__main__":
    main()
