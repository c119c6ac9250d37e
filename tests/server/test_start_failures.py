"""`llmserve serve` failing to start: a port in use in a second, a mistyped flag in one line, no leak reports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)


def test_a_port_in_use_fails_before_the_model_loads_with_one_line_that_suggests_another():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        # the default model's config: the port is checked before anything of the model is read or imported
        p = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--config", "configs/default.yaml", "--port",
                            str(port)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert p.returncode == 2 and took < 3, (p.returncode, took)
    assert p.stderr.splitlines() == [f"llmserve: error: port {port} on 127.0.0.1 is already in use; "
                                     "pass --port N (or stop the other server)"], p.stderr


def test_the_port_is_bound_before_torch_is_imported():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        p = _python("import sys\n"
                    "from llmserve.errors import ConfigError\n"
                    "from llmserve.config import config_from_dict\n"
                    "from llmserve.server import serve\n"
                    f"cfg = config_from_dict({{'server': {{'port': {held.getsockname()[1]}}}}})\n"
                    "try:\n    serve(cfg)\nexcept ConfigError as e:\n    print(e)\n"
                    "print('torch' in sys.modules)\n")
    assert p.stdout.splitlines()[-1] == "False" and "already in use" in p.stdout, p.stdout + p.stderr


# what serving a model imports (transformers imports triton, whose nanobind bindings print pages of "nanobind:
# leaked ..." when the interpreter's teardown meets what serve() froze), then a failure once the engine is built
_AFTER_LOAD = ("import sys, triton, uvicorn\n"
               "import llmserve.server.app as app\n"
               "{fail}\n"
               "from llmserve.cli import main\n"
               "sys.exit(main(['serve', '--backend', 'fake', '--port', '{port}']))\n")


@pytest.mark.parametrize(("fail", "code", "said"), [
    # uvicorn's own start-up failure (it exits 3)
    ("def run(self, sockets=None):\n    raise SystemExit(3)\nuvicorn.Server.run = run", 3, None),
    # an error the user can act on, once the engine is built
    ("from llmserve.errors import ConfigError\ndef create_app(*a):\n    raise ConfigError('no good')\n"
     "app.create_app = create_app", 2, "llmserve: error: no good"),
    # a bug: its traceback, then the same exit
    ("def run(self, sockets=None):\n    raise RuntimeError('a bug')\nuvicorn.Server.run = run", 1,
     "RuntimeError: a bug"),
])
def test_every_way_out_of_serving_leaves_without_leak_reports(fail, code, said):
    p = _python(_AFTER_LOAD.format(fail=fail, port=free_port()))
    assert p.returncode == code, p.stderr[-2000:]
    assert "leaked" not in p.stderr, p.stderr[-2000:]
    assert said is None or said in p.stderr.splitlines(), p.stderr[-2000:]


@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--prot", "9000"], "llmserve serve: error: unknown option --prot (did you mean --port?)"),
    (["--prot=9000"], "llmserve: error: unknown option --prot (did you mean --port?)"),
    (["bench", "offline", "--requestz", "3"],
     "llmserve bench offline: error: unknown option --requestz (did you mean --requests?)"),
    (["plugins", "--port", "1"], "llmserve plugins: error: unknown option --port (see llmserve plugins --help)"),
    (["serve", "stray"], "llmserve serve: error: unexpected argument 'stray' (see llmserve serve --help)"),
    (["serve", "--port", "abc"], "llmserve serve: error: argument --port: invalid int value: 'abc'"),
])
def test_a_command_line_mistake_is_one_line_without_the_usage_block(args, said):
    p = subprocess.run([sys.executable, "-m", "llmserve", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.splitlines() == [said], p.stderr


def test_the_command_line_loads_without_torch():
    """`llmserve --help`, `llmserve plugins` and a port check stay fast: no plugin imports torch at load."""
    p = _python("import sys\nfrom llmserve.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)")
    assert p.stdout.strip() == "False", p.stdout + p.stderr
