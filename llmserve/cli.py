"""The `llmserve` command: serve (the default), plugins, config, and the plugins' commands (bench, …).

Heavy imports (torch, transformers, the server) happen inside the commands that need them,
so `llmserve --help` and `llmserve plugins` stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import traceback
from typing import NoReturn

from llmserve.config import closest
from llmserve.config_args import add_config_arguments, config_from_args
from llmserve.errors import LLMServeError, PluginError
from llmserve.plugins import load_plugins, loaded_once

class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: no usage block first, and an unknown flag names the closest known one."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        parser = self  # the (sub)command parser that reads each token: the top one until a command is named
        for a in args:
            if a == "--":
                break
            commands = next((x for x in parser._actions if isinstance(x, argparse._SubParsersAction)), None)
            if commands is not None and a in commands.choices:
                parser = commands.choices[a]
            elif a.startswith("-") and not a[1:].replace(".", "", 1).isdigit():  # (a negative number is a value)
                flag = a.split("=", 1)[0]
                if flag not in parser._option_string_actions:
                    match = closest(flag, list(parser._option_string_actions))
                    parser.error(f"unknown option {flag} " +
                                 (f"(did you mean {match}?)" if match else f"(see {parser.prog} --help)"))
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser.error(f"unexpected argument {extras[0]!r} (see {parser.prog} --help)")
        return ns


# --log-level, which every command takes (before or after its name)
_COMMON = _Parser(prog="llmserve", add_help=False)
_COMMON.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                    help="log level (default info; for serve it also sets server.log_level)")


class _Commands(argparse._SubParsersAction):
    """Subcommands that parse into the namespace the flags before them filled, and take --log-level.

    argparse's own action parses a command into a fresh namespace and copies all of it back, so
    the command's defaults overwrote flags given before it (`llmserve --port 9001 serve`).
    """

    def add_parser(self, name, **kwargs):
        kwargs.setdefault("parents", [_COMMON])
        kwargs.setdefault("allow_abbrev", False)
        return super().add_parser(name, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        command = self._name_parser_map.get(values[0])
        if command is None:
            return super().__call__(parser, namespace, values, option_string)  # argparse's "invalid choice"
        if self.dest is not argparse.SUPPRESS:
            setattr(namespace, self.dest, values[0])
        # defaults fill only what is unset; `--set` appends to the list begun before the command
        _, rest = command.parse_known_args(values[1:], namespace)
        vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(rest)


# --- commands ---------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible HTTP server."""
    cfg = config_from_args(args)
    if args.log_level:
        cfg.server.log_level = args.log_level  # one flag for our logs and uvicorn's
    if cfg.distributed.replicas:  # N engine replicas behind one endpoint (the ray plugin by default)
        return load_plugins().get("launcher", cfg.distributed.launcher).factory(cfg)
    from llmserve.server import serve

    try:
        code = serve(cfg)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it once it has shut down
        code = 130
    except LLMServeError as e:  # the port, the model: reported as main() reports it, then the same exit
        code = _report(e)
    except SystemExit as e:  # uvicorn's, when its start-up fails
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a bug: its traceback, then the same exit (the teardown would bury it in leak reports)
        traceback.print_exc()
        code = 1
    _leave_after_serving(code)


def _report(e: LLMServeError) -> int:
    """Print an error the user can act on as one line (no traceback); the exit status it gets."""
    print(f"llmserve: error: {e}", file=sys.stderr)
    return 2


def _leave_after_serving(code: int) -> NoReturn:
    """End the process without the interpreter's teardown, which frees nothing anyone needs after serving.

    serve() froze what start-up made (gc.freeze); finalizing, the frozen objects are never freed and Triton's nanobind
    bindings (imported with transformers, through torch._dynamo) print pages of "nanobind: leaked ..."; unfrozen,
    the teardown's collection over everything torch and transformers made took ~1 s more after the drain."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_plugins(args: argparse.Namespace) -> int:
    """List plugins, their hooks and the components they register."""
    info = load_plugins().describe()
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


def build_parser() -> argparse.ArgumentParser:
    """The built-in commands, then those the plugins register."""
    # no abbreviations: a command's own flag (bench offline --n) must never match a global one's prefix
    parser = _Parser(prog="llmserve", parents=[_COMMON], allow_abbrev=False,
                                     description="A plugin-based LLM serving engine with an OpenAI-compatible "
                                                 "API. With no command, `llmserve --config FILE` serves.")
    add_config_arguments(parser)
    # no top-level default for func: a command's own would then not be set (see _Commands)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=_Commands)

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

    try:
        load_plugins().pm.hook.register_commands(subparsers=sub)
    except PluginError as e:  # the commands that need plugins report it; these need none
        parser.epilog = f"Plugin commands are missing: {e}"
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `llmserve` command; return its exit status."""
    # logging first (from a first look at --log-level): loading the plugins may log their errors
    level = _COMMON.parse_known_args(argv)[0].log_level or "info"
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with loaded_once():  # the parser, the command and its engines share one plugin set
            args = build_parser().parse_args(argv)
            return int(getattr(args, "func", cmd_serve)(args) or 0)
    except LLMServeError as e:
        return _report(e)
    except KeyboardInterrupt:
        if any(t.daemon and t.is_alive() for t in threading.enumerate()):
            # Ctrl-C while the engine thread is still starting: finalizing the interpreter under it while it is in
            # torch's native start-up can abort the process ("terminate called without an active exception",
            # SIGABRT); leave without finalizing, as a quiet 130
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
