#!/usr/bin/env python
"""One of the fused call's run-time options on against off, in one engine.

`--option balance`: the two members share the matmuls out by their measured rates (decode_layers.cpp's Balance;
off: a null pointer, equal halves, no clocks). `--option wait_ahead`: a member waiting at a barrier asks for its
share of the next matmul's weights (team.h's WaitAhead; off: 0 bytes). One engine decodes and the option is
switched every `--turn` steps, in the order on off off on, so a change of the VM's state falls on both; the C
call's time is compared (and the first member's share printed).

    python benchmarks/ab_call_option.py --option balance          # c = 1, 60 rounds
    python benchmarks/ab_call_option.py --option wait_ahead -c 4 --rounds 100 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from profile_step import build_engine, engine_arguments, run_cli, start_decoding, time_calls  # noqa: E402


def run(args) -> dict:
    from llmserve_bench.bound import measure_bandwidth
    from llmserve_bench.report import machine_info, progress_bar

    engine = build_engine(args)
    stack = engine.backend.stack
    if stack is None:
        raise SystemExit(f"no fused call here: {engine.backend.stack_note}")
    took = time_calls(stack)
    start_decoding(engine, args.concurrency, args.prompt_len, args.rounds * 4 * args.turn + 64, 0)
    on = getattr(stack._model, args.option)
    got: dict[str, list[float]] = {"on": [], "off": []}
    bar = progress_bar(args, args.rounds, f"ab {args.option}")
    bar.unit = "round"
    for r in range(args.rounds):
        bar.update()
        for mode in ("on", "off", "off", "on"):
            setattr(stack._model, args.option, on if mode == "on" else 0)
            for _ in range(args.turn):
                took.clear()
                engine.step()
                got[mode].append(took[-1])
    bar.close()
    setattr(stack._model, args.option, on)
    med = statistics.median
    on_s, off_s = med(got["on"]), med(got["off"])
    engine.shutdown()
    return {"option": args.option, "concurrency": args.concurrency, "rounds": args.rounds, "machine": machine_info(),
            "call_ms": {"on": on_s * 1e3, "off": off_s * 1e3}, "on_over_off": on_s / off_s,
            "first_member_share": float(stack._balance[0]), "bandwidth_gbs_after": measure_bandwidth() / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    engine_arguments(ap, prompt_len=96)
    ap.add_argument("--option", choices=["balance", "wait_ahead"], required=True)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--turn", type=int, default=4, help="steps of one mode before the other's")
    return run_cli(ap, argv, run, print_report)


def print_report(r: dict) -> None:
    """One line: both times, their ratio, the share."""
    c = r["call_ms"]
    print(f"c = {r['concurrency']}, {r['option']}: the fused call {c['on']:.3f} ms on, {c['off']:.3f} off: "
          f"{r['on_over_off']:.3f}; first member's share {r['first_member_share']:.3f}; "
          f"bandwidth after {r['bandwidth_gbs_after']:.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
