"""The browser for the page's tests: Debian's chromium, driven by playwright through executable_path.

playwright's own browser download cannot work where the tests run, so the browser is the system's
(`make test` apt-installs it when missing and running as root). Without it the browser tests fail
under CI (CI=true), where a silent skip would hide that the page went untested, and skip elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import fake_server  # noqa: F401  (the pages' tests use the same test server)

ROOT = Path(__file__).resolve().parents[2]
# screenshots and page logs of a run; LLMSERVE_UPDATE_DOCS=1 also refreshes the ones in docs/img
OUTPUT = Path(os.environ.get("LLMSERVE_TEST_OUTPUT", ROOT / "build" / "test-output")) / "ui"


def find_chromium() -> str | None:
    """LLMSERVE_CHROMIUM, else chromium or chromium-browser on PATH."""
    return os.environ.get("LLMSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _unavailable(why: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the browser tests cannot run: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def browser():
    """A headless chromium (one for the session)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (it is in the dev extra: pip install -e '.[dev]')")
    exe = find_chromium()
    if exe is None:
        _unavailable("no chromium on PATH: apt-get install chromium (make test does, as root), "
                     "or set LLMSERVE_CHROMIUM to a Chromium binary")
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser, request):
    """A fresh page (its own storage) at 1280x800; console errors and page errors fail the test."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    problems: list[str] = []
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    pg.set_default_timeout(20_000)
    pg.problems = problems
    yield pg
    ctx.close()


def frames(url: str, n: int, **params):
    """The first n frames of url/stats/stream, as dicts."""
    out = []
    with httpx.stream("GET", url + "/stats/stream", params=params, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if len(out) == n:
                    return out
    return out
