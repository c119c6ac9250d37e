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


def _can_build_wheels_offline() -> bool:
    """True when pip can build a setuptools project here without fetching anything.

    That needs setuptools >= 70.1 (bdist_wheel built in) or the `wheel` package; a fresh
    Python 3.11 venv has neither, so there the distribution is written by hand instead.
    """
    from importlib import metadata

    try:
        major, minor = (int(x) for x in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        metadata.version("wheel")
        return True
    except metadata.PackageNotFoundError:
        return False


def _write_dist_by_hand(project: Path, site: Path) -> None:
    """What pip would leave for `project` (its packages plus a dist-info), read from its pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    proj = meta["project"]
    for pkg in meta["tool"]["setuptools"]["packages"]:
        shutil.copytree(project / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
    lines = []
    for group, eps in proj.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def install_project(project: Path, site: Path) -> str:
    """Install the project at `project` into the folder `site`, offline; return "pip" or "by hand".

    With pip the real build runs (a broken pyproject.toml fails here); the source is copied
    first so the build leaves no build/ or egg-info behind in the repository.
    """
    if not _can_build_wheels_offline():
        _write_dist_by_hand(project, site)
        return "by hand"
    src = site.parent / f"{site.name}-src"
    shutil.copytree(project, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip install of {project.name} failed:\n{proc.stdout}\n{proc.stderr}"
    return "pip"


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    """The example plugin installed into a folder of its own (see install_project)."""
    site = tmp_path_factory.mktemp("example-site")
    install_project(EXAMPLE, site)
    assert list(site.glob("llmserve_example_plugin-*.dist-info/entry_points.txt"))
    return site


@pytest.fixture(scope="session")
def installer():
    """install_project, for tests that install a project of their own."""
    return install_project


@pytest.fixture(scope="session")
def write_dist_by_hand():
    """The by-hand installer (used where pip cannot build offline), for the test that compares it with pip."""
    return _write_dist_by_hand


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
