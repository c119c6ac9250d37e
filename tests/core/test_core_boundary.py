"""The core never imports a default plugin: they reach it only through the hooks (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from llmserve.plugins import DEFAULT_PLUGINS

CORE = Path(__file__).resolve().parents[2] / "llmserve"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_core_module_imports_a_default_plugin():
    offenders = {f"{path.relative_to(CORE.parent)}: {mod}"
                 for path in CORE.rglob("*.py") for mod in imported_modules(path)
                 if mod.split(".")[0] in DEFAULT_PLUGINS}
    assert not offenders, f"the core imports default plugins by name: {sorted(offenders)}"


def test_the_bench_command_comes_from_its_plugin():
    from llmserve.plugins import load_plugins

    bench = next(p for p in load_plugins().describe() if p["name"] == "llmserve_bench")
    assert bench["source"] == "default" and bench["hooks"] == ["register_commands"]
