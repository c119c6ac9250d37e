"""Meta-tests (after datasette): every hook spec is documented with its signature and has a test.

Adding a hook to llmserve/hookspecs.py without a section in docs/plugins.md and a test named
test_hook_<name> somewhere under tests/ makes these fail.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from llmserve import hookspecs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "plugins.md"
TESTS = ROOT / "tests"
SPEC_ATTR = f"{hookspecs.PROJECT}_spec"  # what pluggy's HookspecMarker sets on a spec function


def hook_specs() -> dict[str, object]:
    """name → function of every hook spec declared in llmserve.hookspecs."""
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if getattr(fn, SPEC_ATTR, None) is not None}


def doc_sections() -> dict[str, str]:
    """heading → body of every `## name(args)` section of docs/plugins.md."""
    text = DOCS.read_text()
    parts = re.split(r"^## (\w+\(.*\))\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def hook_tests() -> dict[str, list[tuple[Path, str]]]:
    """hook name → (file, source) of each test function named test_hook_<name> under tests/."""
    found: dict[str, list[tuple[Path, str]]] = {}
    for path in sorted(TESTS.rglob("test*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_hook_"):
                found.setdefault(node.name[len("test_hook_"):], []).append(
                    (path, ast.get_source_segment(source, node) or ""))
    return found


SPECS = hook_specs()


def test_hook_specs_are_found():
    # guards the two tests below against passing vacuously
    assert {"register_backends", "register_schedulers", "register_cache_allocators", "register_tokenizers",
            "register_metric_sinks", "register_routes", "register_commands"} <= set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_is_documented_with_its_signature(name):
    signature = f"{name}{inspect.signature(SPECS[name])}"
    sections = doc_sections()
    if signature not in sections:
        pytest.fail(f"docs/plugins.md has no section '## {signature}' for the hook spec {name} "
                    f"(sections: {sorted(sections)})")
    body = sections[signature]
    firstresult = bool(getattr(SPECS[name], SPEC_ATTR).get("firstresult"))
    expected = "**firstresult:** yes" if firstresult else "**firstresult:** no"
    assert expected in body, f"docs/plugins.md section {signature} must say '{expected}'"
    assert "```python" in body and f"def {name}(" in body, f"docs/plugins.md section {signature} needs an example"


def test_docs_describe_no_hook_that_does_not_exist():
    stale = [h for h in doc_sections() if h.split("(")[0] not in SPECS]
    assert not stale, f"docs/plugins.md documents hooks that llmserve.hookspecs does not declare: {stale}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_is_exercised_by_a_test(name):
    tests = hook_tests().get(name)
    if not tests:
        pytest.fail(f"no test named test_hook_{name} under tests/: every hook spec needs one")
    # the test must involve the hook itself, not just carry its name
    assert any(name in source.split(":", 1)[1] for _, source in tests), (
        f"test_hook_{name} does not mention {name} in its body")
