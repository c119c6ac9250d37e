"""The quantized linears' weights in 2 MiB pages (Linux transparent huge pages), one arena in the order a step reads.

A decode step of a few sequences streams every weight once: the default model's ~95 MB in 4 KiB pages is ~23,000
pages, each a TLB miss and a page the hardware prefetcher does not cross. Copied into one anonymous mapping that asks
for huge pages (madvise), the same bytes sit in ~46 pages, laid out in the order the layers read them, and a decode
step of a few sequences gets faster (docs/backend-torch.md, "Weights in huge pages", has the figures). torch's own
allocations are not asked for huge pages (THP is `madvise` on most distributions), and the per-matrix tensors are
mostly under 2 MiB, so they would not get them anyway.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes in a transparent huge page on x86-64 and arm64 (4 KiB base pages)
MODES = ("auto", "off")
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _slot(t: torch.Tensor) -> int:
    """Bytes t takes in an arena: its own, rounded up to 64 so the next tensor starts on a cache line."""
    return -(-t.numel() * t.element_size() // 64) * 64


def unavailable() -> str | None:
    """Why weights cannot be put in huge pages here (None when they can)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no transparent huge pages (madvise MADV_HUGEPAGE)"
    try:
        mode = _THP.read_text()
    except OSError:
        return f"{_THP} is not readable"
    if "[never]" in mode:
        return f"transparent huge pages are off ({_THP}: never)"
    return None


class Arena:
    """One private anonymous mapping, its start aligned to a huge page and asked for huge pages; tensors are copied
    into it one after the other (64-byte aligned), each copy a view that keeps the mapping alive."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)  # the tensor keeps the mapping alive
        self.start = self._buf.data_ptr()
        self._at = (-self.start) % HUGE
        self.used = 0
        self.granted = 0  # granted_bytes() once the tensors are in (place_linears)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """t's values in the arena: a tensor of the same dtype and shape."""
        n = t.numel() * t.element_size()
        view = self._buf[self._at:self._at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._at += _slot(t)
        self.used += n
        return view

    def granted_bytes(self) -> int:
        """Of the mapping, the bytes the kernel backs with huge pages now (/proc/self/smaps' AnonHugePages; reading
        it takes tens of milliseconds in a process that has loaded torch: not for a hot path).

        The kernel merges a mapping with a neighbour of the same flags (another arena), and smaps counts the merged
        one's huge pages: each mapping's count is taken up to the huge pages its overlap with this one holds."""
        end, total, overlap = self.start + len(self._map), 0, 0
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                        lo, hi = (int(v, 16) for v in head.split("-"))
                        overlap = max(0, min(hi, end) - max(lo, self.start)) // HUGE * HUGE
                    elif overlap and head == "AnonHugePages:":
                        total += min(int(line.split()[1]) * 1024, overlap)
        except OSError:
            return 0
        return total


def place_linears(linears: list) -> Arena | None:
    """Move the quantized linears' kernel tensors into one huge-page arena, in the order given; None if none."""
    tensors = [t for lin in linears for t in lin.kernel_tensors() if t is not None]
    if not tensors:
        return None
    arena = Arena(sum(_slot(t) for t in tensors))
    for lin in linears:
        lin.relocate(arena.copy)
    arena.granted = arena.granted_bytes()
    return arena
