"""The README and docs as a new user reads them: links stay inside the repository, commands are called one way,
a `--json` command shows JSON, and the README's Python snippet runs as pasted from the repository root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<(https?://[^>]+)>")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _code_blocks(text: str) -> list[list[str]]:
    blocks, cur = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if cur is None:
                cur = []
            else:
                blocks.append(cur)
                cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_stay_inside_the_repository_and_resolve(page):
    for m in LINK.finditer(page.read_text()):
        target = m.group(1) or m.group(2)
        assert not re.match(r"[a-z][a-z0-9+.-]*:", target), f"{_name(page)} links outside the repository: {target}"
        path = target.split("#", 1)[0]
        if path:
            assert (page.parent / path).exists(), f"{_name(page)}: {target} does not exist"


def _anchors(page: Path) -> set[str]:
    """The fragments a link may name on a page: GitHub's slug of each heading outside code blocks (lower case,
    punctuation dropped, spaces as hyphens, a repeated slug suffixed -1, -2, …) and every explicit id="…"."""
    text, slugs, seen, in_code = page.read_text(), set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs | set(re.findall(r'\bid="([^"]+)"', text))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_link_anchors_name_a_heading_of_their_page(page):
    for m in LINK.finditer(page.read_text()):
        target = m.group(1)
        if not target or "#" not in target or re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, fragment = target.split("#", 1)
        linked = (page.parent / path) if path else page
        if linked.suffix == ".md":
            assert fragment in _anchors(linked), f"{_name(page)}: {target} names no heading of {linked.name}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_installed_commands_are_called_one_way(page):
    """`source .venv/bin/activate` once (the README says so), then `llmserve`, `python`, `pip`: never .venv/bin/…"""
    text = page.read_text()
    assert ".venv/bin/" not in text.replace("source .venv/bin/activate", ""), \
        f"{_name(page)} calls a command through .venv/bin/; the docs activate the virtualenv instead"


def test_the_readme_says_how_to_activate_the_virtualenv():
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_a_command_shown_with_json_shows_json(page):
    for block in _code_blocks(page.read_text()):
        for i, line in enumerate(block):
            if line.startswith("$ ") and re.search(r"\s--json\b", line.split("#", 1)[0]):
                shown = [ln for ln in block[i + 1:] if ln.strip()]
                if shown and not shown[0].startswith("$ "):
                    assert shown[0].lstrip()[:1] in "{[", f"{_name(page)}: {line!r} is shown with non-JSON output"


def _readme_engine_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(s for s in snippets if "Engine.from_config" in s)


def test_the_readme_engine_snippet_runs_from_the_repository_root():
    """As a user pastes it into `python` in the checkout: the checkout's own directories come first on
    sys.path there, so each import must resolve to a regular package (a namespace package has no __file__)."""
    snippet = _readme_engine_snippet()
    check = ("\nimport llmserve, llmserve.engine, llmserve_fake, llmserve_scheduler, llmserve_paged_cache\n"
             "for m in (llmserve, llmserve_fake, llmserve_scheduler, llmserve_paged_cache):\n"
             "    assert m.__file__ is not None, (m.__name__, 'is a namespace package', list(m.__path__))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, nothing added
    r = subprocess.run([sys.executable, "-"], input=snippet + check, cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ids = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own snippet's printed list
    assert len(ids) == 1 and len(ids[0]) == 8 and all(isinstance(t, int) for t in ids[0])
