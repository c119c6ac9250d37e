#!/usr/bin/env python
"""The fused call's matmuls shared by the two members' measured rates against equal halves, in one engine.

decode_layers.cpp's Balance moves the first member's share of every matmul towards where both would finish
together. Here one engine decodes and its fused stack's Balance is switched on and off (a null pointer: equal
halves, no clocks) every `--turn` steps, in the order on off off on, so a change of the VM's state falls on both;
the C call's time is compared, and the share the rates settled on is printed.

    python benchmarks/ab_balance.py                  # c = 1, 60 rounds
    python benchmarks/ab_balance.py -c 4 --rounds 100 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from profile_step import build_engine, engine_arguments, start_decoding  # noqa: E402


def run(args) -> dict:
    from llmserve_bench.bound import measure_bandwidth
    from llmserve_bench.report import machine_info, progress_bar

    engine = build_engine(args)
    stack = engine.backend.stack
    if stack is None:
        raise SystemExit(f"no fused call here: {engine.backend.stack_note}")
    fn, took = stack._fn, []

    def timed(*a):
        t = time.perf_counter()
        r = fn(*a)
        took.append(time.perf_counter() - t)
        return r

    stack._fn = timed
    start_decoding(engine, args.concurrency, args.prompt_len, args.rounds * 4 * args.turn + 64, 0)
    on_at = stack._balance.data_ptr()
    got: dict[str, list[float]] = {"balanced": [], "equal": []}
    bar = progress_bar(args, args.rounds, "ab_balance")
    bar.unit = "round"
    for r in range(args.rounds):
        bar.update()
        for mode in ("balanced", "equal", "equal", "balanced"):
            stack._model.balance = on_at if mode == "balanced" else 0
            for _ in range(args.turn):
                took.clear()
                engine.step()
                got[mode].append(took[-1])
    bar.close()
    stack._model.balance = on_at
    med = statistics.median
    balanced, equal = med(got["balanced"]), med(got["equal"])
    engine.shutdown()
    return {"concurrency": args.concurrency, "rounds": args.rounds, "machine": machine_info(),
            "call_ms": {"balanced": balanced * 1e3, "equal": equal * 1e3}, "balanced_over_equal": balanced / equal,
            "first_member_share": float(stack._balance[0]), "bandwidth_gbs_after": measure_bandwidth() / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    engine_arguments(ap, prompt_len=96)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--turn", type=int, default=4, help="steps of one mode before the other's")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    c = r["call_ms"]
    print(f"c = {r['concurrency']}: the fused call {c['balanced']:.3f} ms balanced, {c['equal']:.3f} equal halves: "
          f"{r['balanced_over_equal']:.3f}; first member's share {r['first_member_share']:.3f}; "
          f"bandwidth after {r['bandwidth_gbs_after']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
