"""Test set-up: import the source tree (core and default plugins) without installing it."""

import os
import sys
from pathlib import Path

# The Triton kernels (the CUDA path) run on the CPU through Triton's interpreter where there is no NVIDIA GPU; it
# must be chosen before triton is first imported (torch cannot be asked here: tests/torch would shadow it).
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "plugins"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
