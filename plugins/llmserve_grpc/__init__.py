"""The grpc backend plugin: a model in another process (or machine) behind worker.proto, and `llmserve worker`.

grpcio is an optional extra (`pip install llmserve[grpc]`): it is imported inside the factory and the command.
"""

from __future__ import annotations

from llmserve.hookspecs import hookimpl

DEFAULT_PORT = 50051  # gRPC's customary port: the worker's when neither --port nor the config names one


def _make_grpc_backend(config):
    """Factory: connect to the worker at backend.options.address (imports grpcio only now)."""
    from llmserve_grpc.backend import GrpcBackend

    return GrpcBackend(config)


@hookimpl
def register_backends(register):
    """Register the `grpc` backend (a model served by `llmserve worker`)."""
    register("grpc", _make_grpc_backend)


@hookimpl
def register_commands(subparsers):
    """Add `llmserve worker`: serve the configured model backend over gRPC for a server's `--backend grpc`."""
    from llmserve.config_args import add_config_arguments

    p = subparsers.add_parser("worker", help="serve a model backend over gRPC (for `serve --backend grpc`)",
                              description="Load the model with the configured backend (--backend, default torch) and "
                                          "serve it at --host/--port over the worker contract; a server started "
                                          "with --backend grpc --set backend.options.address=HOST:PORT keeps the "
                                          "scheduler and KV-cache accounting and sends it each step.")
    add_config_arguments(p)

    def run(args) -> int:
        from llmserve.config_args import config_from_args
        from llmserve.plugins import load_plugins
        from llmserve_grpc.worker import serve

        return serve(config_from_args(args, {"server": {"port": DEFAULT_PORT}}), load_plugins())

    p.set_defaults(func=run)
