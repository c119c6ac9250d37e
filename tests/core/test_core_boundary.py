"""The import contracts in .importlinter hold: no package has an import circle, the core never imports a default
plugin (they reach it only through the hooks), and the core and the torch backend keep their layers
(docs/architecture.md). import-linter counts every import, those inside functions included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from importlinter.api import read_configuration

from llmserve.plugins import DEFAULT_PLUGINS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".importlinter"


def test_the_contracts_cover_the_core_and_every_default_plugin():
    config = read_configuration(str(CONFIG))
    contracts = {c["id"]: c for c in config["contracts_options"]}
    everything = {"llmserve", *DEFAULT_PLUGINS}
    assert set(config["session_options"]["root_packages"]) == everything
    assert set(contracts["no-circles"]["ancestors"]) == everything
    assert contracts["core-boundary"]["source_modules"] == ["llmserve"]
    assert set(contracts["core-boundary"]["forbidden_modules"]) == set(DEFAULT_PLUGINS)


def test_the_import_contracts_hold():
    # its own process: lint-imports puts the working directory on sys.path and configures logging
    run = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--config", str(CONFIG), "--no-cache",
                          "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_bench_command_comes_from_its_plugin():
    from llmserve.plugins import load_plugins

    bench = next(p for p in load_plugins().describe() if p["name"] == "llmserve_bench")
    assert bench["source"] == "default" and bench["hooks"] == ["register_commands"]
