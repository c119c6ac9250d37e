"""The config flags every engine-building command takes: --config, --set and the override flags."""

from __future__ import annotations

import argparse
from typing import Any

from llmserve.config import load_config
from llmserve.errors import LLMServeError

# flag → dotted config key; each flag overrides the config file
CONFIG_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model.model", str, "local checkpoint directory, GGUF file, hub id, or 'embedded'"),
    "--tokenizer": ("model.tokenizer", str, "tokenizer directory or hub id (defaults to the model's)"),
    "--served-model-name": ("model.served_model_name", str, "the model name clients send"),
    "--chat-template": ("model.chat_template", str, "a Jinja chat template file that replaces the tokenizer's"),
    "--dtype": ("model.dtype", str, "float32 | bfloat16 | float16 | auto"),
    "--quantization": ("model.quantization", str, "auto | none | int8 | int4 (weight-only, at load)"),
    "--device": ("model.device", str, "cpu | cuda | auto"),
    "--max-model-len": ("model.max_model_len", int, "context length limit"),
    "--load-format": ("model.load_format", str, "auto | safetensors | pt | dummy"),
    "--seed": ("model.seed", int, "seed for dummy weights"),
    "--threads": ("model.threads", int, "torch intra-op threads"),
    "--generation-config": ("model.generation_config", str, "auto | none: the model's default sampling parameters"),
    "--backend": ("backend.name", str, "model backend plugin (torch, fake, …)"),
    "--kv-cache-memory": ("backend.kv_cache_memory", str,
                          "KV cache size: tokens ('32768 tokens', the default), bytes ('512MiB') or a fraction of free memory"),
    "--scheduler": ("scheduler.name", str, "scheduler plugin"),
    "--policy": ("scheduler.policy", str, "fcfs | priority"),
    "--max-num-seqs": ("scheduler.max_num_seqs", int, "sequences per batch"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", int, "token budget per step"),
    "--num-scheduler-steps": ("scheduler.num_scheduler_steps", int,
                              "forwards a step may run on a batch of decodes when nothing waits (1: one)"),
    "--stream-interval": ("scheduler.stream_interval", int,
                          "tokens a stream gets at a time from a step of several forwards (1: each as it is made)"),
    "--stream-hold-ms": ("scheduler.stream_hold_ms", float,
                         "a forward this long or longer sends its tokens at once, whatever --stream-interval says"),
    "--cache": ("cache.name", str, "KV-cache allocator plugin"),
    "--block-size": ("cache.block_size", int, "tokens per KV block"),
    "--eviction": ("cache.eviction", str, "lru | fifo: which cached KV block goes first"),
    "--num-blocks": ("cache.num_blocks", int, "KV blocks (default: from --kv-cache-memory)"),
    "--host": ("server.host", str, "address to bind"),
    "--port": ("server.port", int, "port to bind"),
    "--api-key": ("server.api_key", str, "require this key on /v1/* (Authorization: Bearer KEY or x-api-key: KEY)"),
    "--tool-parser": ("server.tool_parser", str, "how tool calls are read from the output: auto | none | hermes | …"),
    "--replicas": ("distributed.replicas", int, "engine replicas on Ray Serve behind one endpoint (pip install llmserve[ray])"),
    "--router": ("distributed.router", str, "how a request picks its replica: prefix-aware | power-of-two | round-robin"),
    "--ray-address": ("distributed.ray_address", str, "join this Ray cluster (default: start a local one)"),
    "--reasoning-parser": ("server.reasoning_parser", str, "none | think (<think>…</think> → reasoning_content)"),
}

_PREFIX = "cfg_"  # a flag's dest: the prefix, then its key with "__" for "."


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config FILE, --set KEY=VALUE and the common override flags."""
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set scheduler.enable_chunked_prefill=false")
    g = p.add_argument_group("config overrides")
    for flag, (key, tp, help_) in CONFIG_FLAGS.items():
        g.add_argument(flag, dest=_PREFIX + key.replace(".", "__"), type=tp, default=None,
                       metavar=key.rsplit(".", 1)[-1].upper(), help=f"{help_} [{key}]")
    g.add_argument("--no-prefix-caching", dest=_PREFIX + "cache__enable_prefix_caching", action="store_const",
                   const=False, default=None, help="disable automatic prefix caching")
    g.add_argument("--no-chunked-prefill", dest=_PREFIX + "scheduler__enable_chunked_prefill",
                   action="store_const", const=False, default=None, help="compute each prompt in one step")
    for flag, key, help_ in (("--access-log", "server.access_log", "uvicorn's access log, a line per HTTP request"),
                             ("--log-requests", "server.log_requests",
                              "a line per request: id, route, status, tokens, latency")):
        g.add_argument(flag, dest=_PREFIX + key.replace(".", "__"), action="store_const", const=True, default=None,
                       help=f"{help_} [{key}]")


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The override flags given, as {dotted key: value} (not --set)."""
    return {k[len(_PREFIX):].replace("__", "."): v for k, v in vars(args).items()
            if k.startswith(_PREFIX) and v is not None}


def config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None):
    """Config file, then `defaults` for keys the file leaves unset, then flags and --set."""
    import yaml

    overrides = flag_overrides(args)
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise LLMServeError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(raw)
    return load_config(getattr(args, "config", None), overrides, defaults)
