"""The quantized linears' weights in one huge-page arena (huge_pages.py): where the platform has transparent huge
pages they all move there, in the order a step reads them, and every logit stays the same; where it does not, the
backend says why."""

from __future__ import annotations

import gc

import pytest
import torch
from torch_helpers import Driver, batch_of, make_backend

from llmserve.errors import ConfigError
from llmserve_torch.huge_pages import HUGE, Arena, unavailable


def _logits(backend):
    """A prompt chunk, then two decodes: float32 logits of each step."""
    d = Driver(backend, seed=4)
    ids = torch.randint(0, 200, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    plan = [[d.request("a", ids, 0, 7)], [d.request("a", ids, 7, 1)], [d.request("a", ids, 8, 1)]]
    return [backend.compute_logits(batch_of(reqs)) for reqs in plan]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_weights_move_to_one_arena_in_step_order_and_compute_the_same(qwen2_dir, quantization):
    path, _ = qwen2_dir
    placed = make_backend(str(path), quantization=quantization, options={"huge_pages": "auto"})
    plain = make_backend(str(path), quantization=quantization, options={"huge_pages": "off"})
    assert plain.huge_pages is None and plain.describe()["huge_pages"] == "off"
    why = unavailable()
    if why is not None:  # a platform without transparent huge pages keeps torch's tensors and says why
        assert placed.huge_pages is None and placed.describe()["huge_pages"] == why
    else:
        arena = placed.huge_pages
        tensors = [t for lin in placed.model.linears() for t in lin.kernel_tensors() if t is not None]
        ptrs = [t.data_ptr() for t in tensors]
        assert ptrs == sorted(ptrs) and ptrs[0] % HUGE == 0 and all(p % 64 == 0 for p in ptrs)
        assert ptrs[-1] + tensors[-1].numel() * tensors[-1].element_size() <= arena.start + len(arena._map)
        info = placed.describe()["huge_pages"]
        assert info["weights_bytes"] == sum(t.numel() * t.element_size() for t in tensors) == arena.used
        assert 0 <= info["granted_bytes"] <= len(arena._map) and info["granted_bytes"] % HUGE == 0
    for got, want in zip(_logits(placed), _logits(plain)):
        assert torch.equal(got, want)


def test_arena_copies_keep_their_values_and_the_mapping_alive():
    arena = Arena(1 << 20)
    a, b = torch.randn(100, 7), torch.arange(10, dtype=torch.int16)
    ca, cb = arena.copy(a), arena.copy(b)
    assert ca.dtype == a.dtype and ca.shape == a.shape and cb.dtype == torch.int16
    assert cb.data_ptr() - ca.data_ptr() == 2816  # 2800 bytes, rounded up to 64
    del arena
    gc.collect()
    assert torch.equal(ca, a) and torch.equal(cb, b)  # the views hold the mapping


def test_huge_pages_option(qwen2_dir):
    path, _ = qwen2_dir
    assert make_backend(str(path), quantization="int4", options={"huge_pages": False}).huge_pages is None  # YAML off
    dense = make_backend(str(path), options={"huge_pages": "auto"})  # float weights: nothing to place, and it says so
    assert dense.huge_pages is None
    assert dense.describe()["huge_pages"] == (unavailable() or "no quantized linears")
    with pytest.raises(ConfigError, match="huge_pages: must be one of auto, off"):
        make_backend(str(path), quantization="int4", options={"huge_pages": "on"})


def test_a_failed_mapping_leaves_the_weights_where_they_were(qwen2_dir, monkeypatch, caplog):
    """An mmap or madvise refused (no memory, a kernel without THP support): a warning, torch's tensors, the same
    logits."""
    import llmserve_torch.backend as backend
    import llmserve_torch.huge_pages as hp

    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(backend, "unavailable", lambda: None)  # as if this platform had them
    monkeypatch.setattr(hp, "Arena", refuse)
    path, _ = qwen2_dir
    b = make_backend(str(path), quantization="int4", options={"huge_pages": "auto"})
    assert b.huge_pages is None and "mapping failed" in b.describe()["huge_pages"]
    assert "huge-page mapping failed" in caplog.text
    plain = make_backend(str(path), quantization="int4", options={"huge_pages": "off"})
    for got, want in zip(_logits(b), _logits(plain)):
        assert torch.equal(got, want)


def test_granted_bytes_count_only_huge_pages_that_fit_the_arena(monkeypatch):
    """The kernel merges the arena's mapping with a neighbour of the same flags (another arena), and smaps then
    reports the merged mapping's huge pages: the arena counts at most the huge pages its own range holds."""
    import builtins
    import io

    arena = Arena(HUGE)  # a mapping of 2 huge pages' bytes: one whole aligned huge page at least
    start, end = arena.start, arena.start + len(arena._map)
    merged = (f"{start - 4 * HUGE:x}-{end:x} rw-p 00000000 00:00 0\nSize: 1 kB\nAnonHugePages: {6 * HUGE // 1024} kB\n"
              f"{end + HUGE:x}-{end + 2 * HUGE:x} rw-p 00000000 00:00 0\nAnonHugePages: {HUGE // 1024} kB\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: io.StringIO(merged) if p == "/proc/self/smaps"
                        else real_open(p, *a, **k))
    got = arena.granted_bytes()
    assert got == len(arena._map) // HUGE * HUGE  # the merged mapping's 6 huge pages, capped at the arena's 1
