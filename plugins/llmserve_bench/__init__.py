"""The bench plugin: `llmserve bench offline` (engine, no HTTP), `llmserve bench serve` (HTTP)
and `llmserve bench router` (replica routers, simulated).

A default plugin like any other: the core never imports it; its command arrives through
register_commands. The subcommands' modules import only argparse-level things at the top,
so `llmserve --help` stays fast.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_commands(subparsers):
    """Add `llmserve bench offline`, `llmserve bench serve` and `llmserve bench router`."""
    from llmserve_bench import offline, router, serve

    bench = subparsers.add_parser("bench", help="benchmarks (offline engine, serving)")
    # the same action class as the top level: flags before `offline`/`serve` survive, --log-level is taken
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True, action=type(subparsers))
    p = bsub.add_parser("offline", help="run a synthetic workload through the engine, no HTTP")
    offline.add_arguments(p)
    p.set_defaults(func=offline.main)
    p = bsub.add_parser("serve", help="load an OpenAI-compatible server with streaming clients")
    serve.add_arguments(p)
    p.set_defaults(func=serve.main)
    p = bsub.add_parser("router", help="simulate R replicas in one process and compare the replica routers")
    router.add_arguments(p)
    p.set_defaults(func=router.main)
