"""Statistics that cross the plugin boundary as declared, typed values (never read with getattr)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class CacheStats:
    """A KV-cache allocator's state; the prefix counters and evictions are totals since start."""

    num_blocks: int
    block_size: int
    used_blocks: int  # held by at least one sequence
    free_blocks: int  # holding nothing worth keeping
    cached_free_blocks: int = 0  # held by no sequence but keeping a cached prefix (evictable)
    num_sequences: int = 0
    internal_fragmentation: float = 0.0  # reserved-but-unfilled slots / reserved slots
    external_fragmentation: float = 0.0  # free blocks a refused allocation could not use / all blocks
    prefix_caching: bool = False
    prefix_queries: int = 0  # prompt tokens looked up on first allocation
    prefix_hits: int = 0  # of those, served from cached blocks
    evictions: int = 0

    @property
    def usage(self) -> float:
        """Used blocks over all blocks."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "usage": self.usage, "prefix_hit_rate": self.prefix_hit_rate}


@dataclass(slots=True)
class SchedulerStats:
    """A scheduler's queues and its cache: what /stats, /metrics and the benches report."""

    num_running: int
    num_waiting: int
    cache: CacheStats
    num_preemptions: int = 0  # total since start
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    policy: str | None = None
    num_scheduler_steps: int | None = None  # the most forwards it offers a batch of decodes (capped by the backend's Forwards)
    extra: dict[str, Any] = field(default_factory=dict)  # plugin-specific facts, reported as they are

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cache": self.cache.to_dict()}
