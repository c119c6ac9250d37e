"""`llmserve bench router`: R simulated replicas in one process, a multi-tenant multi-turn workload, per router.

Each replica is a real Engine (scheduler, paged allocator with prefix caching) over the fake
backend; time is virtual: a step costs step_cost + token_cost × the tokens it computes, so a
prefix-cache hit is a cheaper prefill and a shorter TTFT, as on a model. Users of several tenants
(one system prompt each) hold multi-turn chats: each turn's prompt is the whole conversation so
far. Every request is placed by the router under test (the same objects Ray Serve runs, fed the
same block keys and the loads and held keys replicas report every --report-period). Reports per
router and R: the fleet's prefix hit rate, output throughput, TTFT p50/p95, and what the router
itself cost per request in wall time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve_bench.report import progress_bar


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Fleet sizes, routers, the workload and the cost model."""
    p.add_argument("--replicas", default="2,8,32", help="comma-separated fleet sizes R")
    p.add_argument("--routers", default="round-robin,power-of-two,prefix-aware", help="comma-separated router names")
    p.add_argument("--tenants", type=int, default=8, help="system prompts")
    p.add_argument("--users-per-replica", type=int, default=6, help="concurrent chats per replica")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--system-len", type=int, default=512, help="tokens of each tenant's system prompt")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--think-s", type=float, default=2.0, help="mean pause between a user's turns (virtual s)")
    p.add_argument("--num-blocks", type=int, default=768, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--step-cost-ms", type=float, default=4.0, help="virtual cost of a step")
    p.add_argument("--token-cost-ms", type=float, default=0.15, help="virtual cost per computed token")
    p.add_argument("--report-period", type=float, default=0.5, help="how often replicas report held keys (virtual s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class _Replica:
    engine: Any
    rid: str
    clock: float = 0.0  # virtual time at which its next step starts
    in_flight: int = 0
    keys: frozenset[int] = frozenset()


@dataclass
class _Chat:
    tenant: int
    history: list[int]
    turns_left: int
    arrival: float = 0.0
    first: float | None = None
    output: list[int] = field(default_factory=list)


def _engine(args, plugins):
    from llmserve.config import config_from_dict
    from llmserve.engine import Engine

    cfg = config_from_dict({"backend": {"name": "fake"}, "tokenizer": {"name": "none"},
                            "model": {"max_model_len": 8192},
                            "cache": {"num_blocks": args.num_blocks, "block_size": 16},
                            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}})
    return Engine(cfg, plugins)


def simulate(args, R: int, router_name: str, bar=None) -> dict[str, Any]:
    """One fleet of R replicas under one router; the row of the table."""
    from llmserve.interfaces import ReplicaLoad
    from llmserve.plugins import load_plugins
    from llmserve.request import SamplingParams
    from llmserve_ray.routers import request_keys, short_key

    plugins = load_plugins()
    router = plugins.get("router", router_name).factory({"seed": args.seed} if router_name != "round-robin" else {})
    rng = random.Random(args.seed)  # the same workload for every router
    systems = [[rng.randrange(0, 256) for _ in range(args.system_len)] for _ in range(args.tenants)]
    reps = [_Replica(_engine(args, plugins), f"r{i}") for i in range(R)]
    now = 0.0
    if hasattr(router, "clock"):
        router.clock = lambda: now  # "recently routed" expires in virtual time
    events: list[tuple[float, int, _Chat]] = []
    for u in range(args.users_per_replica * R):
        tenant = rng.randrange(args.tenants)
        heapq.heappush(events, (rng.uniform(0, args.think_s * 2), u, _Chat(tenant, list(systems[tenant]), args.turns)))
    chats: dict[str, tuple[_Chat, _Replica]] = {}
    ttfts: list[float] = []
    out_tokens = 0
    route_s = 0.0
    busy_s = 0.0  # virtual compute the fleet spent: a prefix hit is prefill not paid for
    routed = 0
    next_report = 0.0
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    seq = 0
    while events or any(r.engine.has_unfinished for r in reps):
        busy = [r for r in reps if r.engine.has_unfinished]
        t_step = min((r.clock for r in busy), default=float("inf"))
        t_arrive = events[0][0] if events else float("inf")
        now = min(t_step, t_arrive)
        if now >= next_report:  # replicas report what they hold, as record_routing_stats does
            for r in reps:
                r.keys = frozenset(short_key(k) for k in r.engine.scheduler.allocator.held_block_keys())
            next_report = now + args.report_period
        if t_arrive <= t_step:
            _, u, chat = heapq.heappop(events)
            chat.history += [rng.randrange(0, 256) for _ in range(args.user_len)]
            t0 = time.perf_counter()
            keys = request_keys(chat.history, 16)
            ranks = router.rank(keys, [ReplicaLoad(r.rid, r.in_flight, r.keys) for r in reps])
            best = min(next(rank for rank in ranks if rank), key=lambda i: reps[i].in_flight)
            router.routed(keys, reps[best].rid)
            route_s += time.perf_counter() - t0
            routed += 1
            rep = reps[best]
            if not rep.engine.has_unfinished:
                rep.clock = max(rep.clock, now)
            rid = f"u{u}-{seq}"
            seq += 1
            chat.arrival, chat.first, chat.output = now, None, []
            rep.engine.add_request(chat.history, sp, request_id=rid)
            rep.in_flight += 1
            chats[rid] = (chat, rep)
            continue
        rep = min(busy, key=lambda r: r.clock)
        out = rep.engine.step()
        tokens = out.metrics.num_scheduled_tokens if out.metrics is not None else 0
        cost = (args.step_cost_ms + args.token_cost_ms * tokens) / 1000
        rep.clock += cost
        busy_s += cost
        for o in out.outputs:
            chat, _ = chats[o.request_id]
            if chat.first is None and o.new_token_ids:
                chat.first = rep.clock
                ttfts.append(chat.first - chat.arrival)
            chat.output += o.new_token_ids
            if o.finished:
                del chats[o.request_id]
                rep.in_flight -= 1
                out_tokens += len(chat.output)
                chat.history += chat.output
                chat.turns_left -= 1
                if bar is not None:
                    bar.update(1)
                if chat.turns_left > 0:
                    heapq.heappush(events, (rep.clock + rng.expovariate(1 / args.think_s), seq, chat))
                    seq += 1
    makespan = max(r.clock for r in reps)
    stats = [r.engine.scheduler.stats().cache for r in reps]
    q, h = sum(s.prefix_queries for s in stats), sum(s.prefix_hits for s in stats)
    ttfts.sort()
    return {"replicas": R, "router": router_name, "requests": routed, "prefix_hit_rate": h / q if q else 0.0,
            "output_tok_per_s": out_tokens / makespan if makespan else 0.0, "compute_s": busy_s,
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "ttft_p95_ms": 1000 * ttfts[int(len(ttfts) * 0.95)],
            "router_us_per_request": 1e6 * route_s / routed if routed else 0.0}


def main(args: argparse.Namespace) -> int:
    """Run every (R, router) pair and print the table (or --json)."""
    sizes = [int(x) for x in args.replicas.split(",")]
    routers = [x.strip() for x in args.routers.split(",")]
    total = sum(R * args.users_per_replica * args.turns for R in sizes) * len(routers)
    rows = []
    with progress_bar(args, total, "bench router") as bar:
        for R in sizes:
            for name in routers:
                rows.append(simulate(args, R, name, bar))
    workload = {k: getattr(args, k) for k in ("tenants", "users_per_replica", "turns", "system_len", "user_len",
                                              "output_len", "think_s", "num_blocks", "step_cost_ms",
                                              "token_cost_ms", "report_period", "seed")}
    if args.json:
        print(json.dumps({"workload": workload, "results": rows}, indent=2))
        return 0
    print("| R | router | requests | prefix hit rate | TTFT p50 ms | TTFT p95 ms | fleet compute s | output tok/s "
          "| router µs/req |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['replicas']} | {r['router']} | {r['requests']} | {r['prefix_hit_rate']:.3f} | "
              f"{r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['compute_s']:.1f} | {r['output_tok_per_s']:.0f} | "
              f"{r['router_us_per_request']:.1f} |")
    return 0
