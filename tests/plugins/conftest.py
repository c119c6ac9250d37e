"""Fixtures for the real entry-point path: installed example plugin and throwaway distributions.

importlib.metadata finds a distribution by its ``<name>.dist-info`` folder on sys.path (METADATA
plus entry_points.txt), which is exactly what pip leaves behind; so a tmp folder on sys.path is
a real installation as far as llmserve's plugin loader can tell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llmserve-example-plugin"


@pytest.fixture(autouse=True)
def _plugin_env(monkeypatch):
    """No plugin selection from the caller's shell leaks into these tests."""
    monkeypatch.delenv("LLMSERVE_PLUGINS", raising=False)
    monkeypatch.delenv("LLMSERVE_STRICT_PLUGINS", raising=False)


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    """The example plugin pip-installed (a real wheel build, offline) into a folder of its own.

    The source is copied first so the build leaves no build/ or egg-info in the repository.
    """
    src = tmp_path_factory.mktemp("example-src") / "llmserve-example-plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path_factory.mktemp("example-site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip install of the example plugin failed:\n{proc.stdout}\n{proc.stderr}"
    assert list(site.glob("llmserve_example_plugin-*.dist-info/entry_points.txt"))
    return site


def _forget_modules(names: set[str]) -> None:
    for mod in list(sys.modules):
        if mod.split(".")[0] in names:
            del sys.modules[mod]


@pytest.fixture
def installed_example(example_site, monkeypatch):
    """Put the installed example plugin on sys.path for one test (and forget its modules after)."""
    monkeypatch.syspath_prepend(str(example_site))
    yield example_site
    _forget_modules({"llmserve_example_plugin"})


class SiteDir:
    """A folder on sys.path where a test writes tiny plugin distributions."""

    def __init__(self, path: Path):
        self.path = path
        self.modules: set[str] = set()

    def add(self, entry_name: str, source: str, module: str | None = None, dist: str | None = None,
            version: str = "0.1") -> str:
        """Write module `module` (default: plugin_<entry_name>) and a dist-info declaring it as entry point `entry_name`."""
        module = module or f"plugin_{entry_name}"
        dist = dist or f"llmserve-test-{entry_name}"
        (self.path / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[llmserve]\n{entry_name} = {module}\n")
        self.modules.add(module)
        return module


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A SiteDir on sys.path; its modules are unloaded after the test."""
    d = tmp_path / "site-packages"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    s = SiteDir(d)
    yield s
    _forget_modules(s.modules)


@pytest.fixture
def subprocess_env(example_site):
    """Environment for `python -m llmserve` subprocesses: the source tree and the installed example."""
    env = dict(os.environ)
    env.pop("LLMSERVE_PLUGINS", None)
    env.pop("LLMSERVE_STRICT_PLUGINS", None)
    paths = [str(ROOT), str(ROOT / "plugins"), str(example_site)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
