"""The `llmserve` command: serve (the default), plugins, bench, config.

Heavy imports (torch, transformers, the server) happen inside the commands that need them,
so `llmserve --help` and `llmserve plugins` stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from llmserve.errors import LLMServeError

# flag → dotted config key; each flag overrides the config file
CONFIG_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model.model", str, "local checkpoint directory, hub id, or 'embedded'"),
    "--tokenizer": ("model.tokenizer", str, "tokenizer directory or hub id (defaults to the model's)"),
    "--served-model-name": ("model.served_model_name", str, "the model name clients send"),
    "--dtype": ("model.dtype", str, "float32 | bfloat16 | float16 | auto"),
    "--device": ("model.device", str, "cpu | cuda | auto"),
    "--max-model-len": ("model.max_model_len", int, "context length limit"),
    "--load-format": ("model.load_format", str, "auto | safetensors | pt | dummy"),
    "--seed": ("model.seed", int, "seed for dummy weights"),
    "--threads": ("model.threads", int, "torch intra-op threads"),
    "--backend": ("backend.name", str, "model backend plugin (torch, fake, …)"),
    "--kv-cache-memory": ("backend.kv_cache_memory", str, "KV cache size: bytes ('512MiB') or fraction of free memory"),
    "--scheduler": ("scheduler.name", str, "scheduler plugin"),
    "--policy": ("scheduler.policy", str, "fcfs | priority"),
    "--max-num-seqs": ("scheduler.max_num_seqs", int, "sequences per batch"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", int, "token budget per step"),
    "--cache": ("cache.name", str, "KV-cache allocator plugin"),
    "--block-size": ("cache.block_size", int, "tokens per KV block"),
    "--num-blocks": ("cache.num_blocks", int, "KV blocks (default: from --kv-cache-memory)"),
    "--host": ("server.host", str, "address to bind"),
    "--port": ("server.port", int, "port to bind"),
    "--api-key": ("server.api_key", str, "require this Bearer token on /v1/*"),
}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config FILE, --set KEY=VALUE and the common override flags."""
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set scheduler.enable_chunked_prefill=false")
    g = p.add_argument_group("config overrides")
    for flag, (key, tp, help_) in CONFIG_FLAGS.items():
        g.add_argument(flag, dest="cfg_" + key.replace(".", "__"), type=tp, default=None,
                       metavar=key.rsplit(".", 1)[-1].upper(), help=f"{help_} [{key}]")
    g.add_argument("--no-prefix-caching", dest="cfg_cache__enable_prefix_caching", action="store_const",
                   const=False, default=None, help="disable automatic prefix caching")
    g.add_argument("--no-chunked-prefill", dest="cfg_scheduler__enable_chunked_prefill", action="store_const",
                   const=False, default=None, help="compute each prompt in one step")


def config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None):
    """Config file, then `defaults` for keys the file leaves unset, then flags and --set."""
    import yaml

    from llmserve.config import load_config

    overrides: dict[str, Any] = {}
    for k, v in vars(args).items():
        if k.startswith("cfg_") and v is not None:
            overrides[k[4:].replace("__", ".")] = v
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise LLMServeError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(raw)
    return load_config(getattr(args, "config", None), overrides, defaults)


# --- commands ---------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible HTTP server."""
    cfg = config_from_args(args)
    if args.log_level:
        cfg.server.log_level = args.log_level  # one flag for our logs and uvicorn's
    from llmserve.server import serve

    return serve(cfg)


def cmd_plugins(args: argparse.Namespace) -> int:
    """List plugins, their hooks and the components they register."""
    from llmserve.plugins import load_plugins

    ps = load_plugins()
    info = ps.describe()
    if args.json:
        print(json.dumps({"plugins": info}, indent=2))
        return 0
    for p in info:
        print(f"{p['name']}  [{p['source']}]")
        if p.get("error"):
            print(f"    FAILED: {p['error']}")
            continue
        print(f"    hooks: {', '.join(p['hooks']) or '-'}")
        for kind, names in p["components"].items():
            print(f"    {kind}: {', '.join(names)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved configuration (file + flags), validated."""
    cfg = config_from_args(args)
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def build_parser(with_plugins: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmserve",
        description="A plugin-based LLM serving engine with an OpenAI-compatible API. "
                    "With no command, `llmserve --config FILE` serves.",
    )
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                        help="log level (default info; for serve it also sets server.log_level)")
    add_config_arguments(parser)
    parser.set_defaults(func=cmd_serve)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_config_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plugins", help="list plugins and what they register")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="print the resolved configuration")
    add_config_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)

    bench = sub.add_parser("bench", help="benchmarks (offline engine, serving)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    from llmserve.bench import offline

    p = bsub.add_parser("offline", help="run a synthetic workload through the engine, no HTTP")
    add_config_arguments(p)
    offline.add_arguments(p)
    p.set_defaults(func=offline.main)
    try:
        from llmserve.bench import serve as serve_bench
    except ImportError:
        serve_bench = None
    if serve_bench is not None and hasattr(serve_bench, "add_arguments"):
        p = bsub.add_parser("serve", help="load an OpenAI-compatible server with streaming clients")
        serve_bench.add_arguments(p)
        p.set_defaults(func=getattr(serve_bench, "main", None) or serve_bench.run_serve_bench)

    if with_plugins:
        # third-party subcommands
        try:
            from llmserve.plugins import load_plugins

            load_plugins().pm.hook.register_commands(subparsers=sub)
        except LLMServeError as e:
            logging.getLogger("llmserve").error("%s", e)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_plugins=not any(a in ("-h", "--help") for a in argv[:1]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, (args.log_level or "info").upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except LLMServeError as e:
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
