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


# --- docs/configuration.md ---------------------------------------------------------------------

CONFIG_DOCS = ROOT / "docs" / "configuration.md"


def _yaml_default(value) -> str:
    """A default as the docs write it (YAML spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _documented_rows(text: str) -> dict[str, str]:
    """`key` → `default` of every two-backtick-cell table row."""
    return dict(re.findall(r"^\| `([^`]+)` \| (?:`([^`]*)`|—[^|]*) \|", text, flags=re.M))


def config_keys() -> dict[str, str]:
    """Every dotted key of every section of EngineConfig → its default, as the docs should spell it."""
    import dataclasses

    from llmserve.config import EngineConfig, SinkConfig

    keys = {}
    for section in dataclasses.fields(EngineConfig):
        if section.name == "source":
            continue
        for f in dataclasses.fields(section.default_factory()):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            keys[f"{section.name}.{f.name}"] = _yaml_default(default)
    for f in dataclasses.fields(SinkConfig):
        if f.default_factory is not dataclasses.MISSING:
            keys[f"metrics.sinks[].{f.name}"] = _yaml_default(f.default_factory())
        elif f.default is dataclasses.MISSING:
            keys[f"metrics.sinks[].{f.name}"] = ""  # required: documented with a dash
    return keys


def test_every_config_key_is_documented_with_its_default():
    rows = _documented_rows(CONFIG_DOCS.read_text())
    missing = sorted(k for k in config_keys() if k not in rows)
    assert not missing, f"docs/configuration.md has no row for: {missing}"
    wrong = {k: (rows[k], d) for k, d in config_keys().items() if rows[k] != d}
    assert not wrong, f"docs/configuration.md defaults differ from llmserve/config.py (docs, code): {wrong}"


def _option_table(heading: str) -> dict[str, str]:
    text = CONFIG_DOCS.read_text()
    m = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^### |\Z)", text, flags=re.M | re.S)
    assert m, f"docs/configuration.md has no section '### {heading}'"
    return _documented_rows(m.group(1))


def test_fake_backend_options_are_documented():
    import llmserve_fake

    assert _option_table("backend: fake") == {k: _yaml_default(v) for k, v in llmserve_fake._OPTIONS.items()}


def test_torch_backend_options_are_documented():
    backend = pytest.importorskip("llmserve_torch.backend")  # the torch plugin needs torch
    assert _option_table("backend: torch") == {k: _yaml_default(v) for k, v in backend.OPTIONS.items()}
