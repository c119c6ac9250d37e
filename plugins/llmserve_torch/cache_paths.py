"""Where llmserve caches things on disk: one root that the GGUF conversions, the packaged models and the built
kernels each take a folder of.

Standard library only: kernel_library.py imports it, and setup.py runs that module before any dependency exists.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LLMSERVE_CACHE, else $XDG_CACHE_HOME/llmserve, else ~/.cache/llmserve."""
    if os.environ.get("LLMSERVE_CACHE"):
        return Path(os.environ["LLMSERVE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve"
