#!/usr/bin/env python
"""Two `llmserve serve` configurations side by side, one stream's requests alternated between them A B B A.

The VM this project is measured on changes its speed between runs (its memory bandwidth moved 2x within minutes),
so two `bench serve --launch` runs one after the other compare moments as much as settings. Here both servers are
up at once (one idle while the other answers) and each round sends `--per` requests to A, 2 x `--per` to B, then
`--per` to A again (B A A B the next round), so a change of machine falls on both, and both get the same requests; then all of it again with B
started first (the server started first ran slower in some runs). The client is `bench serve`'s raw one
(llmserve_bench.raw_http), one connection a server.

    python benchmarks/ab_servers.py --a "--stream-interval 1" --b "--stream-interval 8"
    python benchmarks/ab_servers.py --a "--set backend.options.dense_copies=auto" --b "" --rounds 8 --json
    python benchmarks/ab_servers.py --a "ATEN_CPU_CAPABILITY=avx2" --b ""     # leading NAME=VALUE: environment
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from llmserve_bench.clients import completion_body, run_client, stream_raw  # noqa: E402
from llmserve_bench.raw_http import RawConnection  # noqa: E402
from llmserve_bench.report import Result, summarize_results  # noqa: E402
from llmserve_bench.workload import Item, make_workload  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, extra: str, port: int, log: Path) -> subprocess.Popen:
    """`llmserve serve` with the config and extra flags on port (leading NAME=VALUE words: its environment); healthy
    when this returns."""
    words = shlex.split(extra)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    p = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--config", config, "--port", str(port),
                          "--log-level", "warning", *words],
                         stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=ROOT, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"the server with {extra!r} exited: see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            time.sleep(0.5)
    p.kill()
    raise SystemExit(f"the server with {extra!r} was not healthy in 300 s: see {log}")


async def measure(args, ports: dict[str, int], items: list[Item]) -> dict:
    conns = {k: RawConnection(f"http://127.0.0.1:{p}") for k, p in ports.items()}
    results: dict[str, list[Result]] = {"A": [], "B": []}
    ratios = []  # A's speed over B's, a round each (tokens are alike: the time they took, inverted)

    async def send(side: str, item: Item) -> float:
        r = await stream_raw(conns[side], {}, completion_body(item, None, True), 600.0)
        if not r.ok:
            raise SystemExit(f"server {side}: {r.error}")
        results[side].append(r)
        return r.e2e

    for side in ("A", "B"):  # a warm-up request each, not counted
        await stream_raw(conns[side], {}, completion_body(Item([1, 2, 3, 4], 8), None, True), 600.0)
    for rnd in range(args.rounds):
        # both servers get the round's same requests (prompt lengths differ, and so does TTFT): the first turn's
        # items, then the second's
        turns = [items[(2 * rnd + k) * args.per:(2 * rnd + k + 1) * args.per] for k in (0, 1)]
        spent = {"A": 0.0, "B": 0.0}
        order = ("A", "B", "B", "A") if rnd % 2 == 0 else ("B", "A", "A", "B")
        for side, turn in zip(order, (turns[0], turns[0], turns[1], turns[1])):
            for item in turn:
                spent[side] += await send(side, item)
        ratios.append(spent["B"] / spent["A"])
        print(f"round {rnd + 1}/{args.rounds}: A/B speed {ratios[-1]:.3f}", file=sys.stderr)
    for c in conns.values():
        c.close()
    out = {side: summarize_results(rs, sum(r.e2e for r in rs)) for side, rs in results.items()}
    out["ratios"] = ratios
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/default.yaml", help="the config both servers start from")
    ap.add_argument("--a", default="", help="server A's extra `llmserve serve` flags (one string; leading NAME=VALUE "
                    "words set its environment)")
    ap.add_argument("--b", default="", help="server B's extra flags")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per", type=int, default=3, help="requests a turn (a round: 2 turns a server)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=128, help="new tokens a request (EOS ignored)")
    ap.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    ap.add_argument("--once", action="store_true", help="one launch order (A first), not both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.rounds * args.per * 2
    w = argparse.Namespace(requests=n, prompt_len=args.prompt_len, output_len=(args.output_len, args.output_len),
                           workload_seed=0, shared_prefix=0, text_prompts=False)
    items = make_workload(w, args.vocab_size)
    out = {"flags": {"A": args.a, "B": args.b}, "orders": []}
    # the server started first ran slower in some runs (TTFT +20 ms at the same flags): each order once, unless --once
    for first in ("A",) if args.once else ("A", "B"):
        ports = {"A": free_port(), "B": free_port()}
        order = ("A", "B") if first == "A" else ("B", "A")
        procs = [launch(args.config, getattr(args, side.lower()), ports[side], Path(f"/tmp/ab_servers_{side}.log"))
                 for side in order]
        try:
            out["orders"].append({"started_first": first} | run_client(measure(args, ports, items)))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
    out["ratio"] = statistics.geometric_mean([statistics.median(o["ratios"]) for o in out["orders"]])
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for o in out["orders"]:
        print(f"server {o['started_first']} started first:")
        for side in ("A", "B"):
            s, lat = o[side], o[side]["latency_ms"]
            print(f"  {side} {out['flags'][side] or '(config only)'}: {s['output_token_throughput']:.1f} tok/s, "
                  f"TPOT p50 {lat['tpot']['p50']:.2f} ms, ITL p50 {lat['itl']['p50']:.2f} ms, "
                  f"TTFT p50 {lat['ttft']['p50']:.1f} ms ({s['completed']} requests)")
        print("  A/B speed a round:", " ".join(f"{x:.3f}" for x in o["ratios"]),
              f"(median {statistics.median(o['ratios']):.3f})")
    print(f"A/B speed: {out['ratio']:.3f} (geometric mean of the orders' medians)")


if __name__ == "__main__":
    main()
