"""The plans file: kernel plans timed on this machine, remembered beside the built kernels (quant-plans.json).

kernel_plan.py times and decides; what it keeps lands here only when the machine was quiet. This module imports no
torch, so `llmserve plan show` and `llmserve plan forget` read and clear the file at once.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from llmserve_torch import kernel_library

log = logging.getLogger("llmserve.torch")


def path() -> Path:
    """Beside the built kernels (the one rule for where they live: kernel_library.cache_dir)."""
    return kernel_library.cache_dir() / "quant-plans.json"


def entries(file: Path | None = None) -> dict[str, dict]:
    """Every remembered plan by its key ({} where there is no readable file); file: another plans file than path()."""
    try:
        known = json.loads((file or path()).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, dict)} if isinstance(known, dict) else {}


def recall(key: str, file: Path | None = None) -> dict | None:
    """What was timed earlier for the same key (None: time it now)."""
    return entries(file).get(key)


def remember(key: str, entry: dict, file: Path | None = None) -> bool:
    """Add or replace one plan (best effort: an unwritable cache only costs a re-timing); whether it was written."""
    known = entries(file)
    known[key] = entry
    return _write(known, file or path())


def forget() -> int:
    """Drop every remembered plan (each model's next start times its own again); how many there were."""
    n = len(entries())
    try:
        path().unlink()
    except FileNotFoundError:
        pass
    return n


def age(seconds: float) -> str:
    """3 s, 5 min, 2 h, 4 d: how old a plan is, for the start-up log and `llmserve plan show`."""
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit}"
    return f"{seconds:.0f} s"


def _write(known: dict, p: Path) -> bool:
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".quant-plans-")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, p)
        return True
    except OSError as e:
        log.info("could not remember the kernel plan in %s (%s)", p, e)
        return False
