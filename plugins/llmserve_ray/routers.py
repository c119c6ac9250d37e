"""The built-in routers: plain objects that rank replicas; no Ray here (the bench simulation runs them too).

A request is known by its leading block keys: the allocator's own block hashes (block_hash, the
same chain over token ids and the cache salt), shortened to 8 bytes. A replica reports the keys of
the blocks it holds, so the prefix-aware router knows, rather than guesses, how much of a prompt
each replica would serve from its cache.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

from llmserve.config import check_options
from llmserve.interfaces import ReplicaLoad, Router
from llmserve_paged_cache.allocator import block_hash


def short_key(digest: bytes) -> int:
    """The 8-byte form of a block key that replicas report and routers compare."""
    return int.from_bytes(digest[:8], "little")


def request_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None, limit: int = 256) -> list[int]:
    """The short keys of the prompt's full blocks, as the allocator would name them (never its last token)."""
    keys, parent = [], None
    for i in range(min((len(token_ids) - 1) // block_size, limit)):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        keys.append(short_key(parent))
    return keys


def _least_loaded(replicas: Sequence[ReplicaLoad], among: Sequence[int]) -> list[list[int]]:
    return [sorted(among, key=lambda i: replicas[i].in_flight)]


class RoundRobin(Router):
    """Each request to the next replica in turn."""

    def __init__(self, options: dict[str, Any] | None = None):
        check_options(options or {}, {}, "distributed.options (round-robin)")
        self._turn = itertools.count()

    def rank(self, keys, replicas):
        n = len(replicas)
        first = next(self._turn) % n
        return [[first], [i for i in range(n) if i != first]]


class PowerOfTwo(Router):
    """Two replicas at random, the less loaded one first (balanced load, blind to caches)."""

    def __init__(self, options: dict[str, Any] | None = None):
        o = check_options(options or {}, {"seed": None}, "distributed.options (power-of-two)")
        self._rng = random.Random(o["seed"])

    def rank(self, keys, replicas):
        n = len(replicas)
        pair = self._rng.sample(range(n), min(2, n))
        pair.sort(key=lambda i: replicas[i].in_flight)
        return [[pair[0]], pair[1:], [i for i in range(n) if i not in pair]]


class PrefixAware(Router):
    """The replica holding the longest cached run of the request's leading blocks, unless it is overloaded.

    imbalance: how many more requests in flight than the least loaded replica the best match may
    have before load wins. Keys of a request just routed count as held by its replica until the
    replica's next report (`remember_s`), so a burst sharing a new prefix does not scatter.
    """

    def __init__(self, options: dict[str, Any] | None = None):
        o = check_options(options or {}, {"imbalance": 8, "remember_s": 5.0, "seed": None},
                          "distributed.options (prefix-aware)")
        self.imbalance, self.remember_s = int(o["imbalance"]), float(o["remember_s"])
        self._recent: dict[str, dict[int, float]] = {}  # replica id → key → when routed there
        self._fallback = PowerOfTwo({"seed": o["seed"]})
        self.clock = time.monotonic  # the bench simulation sets its virtual clock

    def _matched(self, keys: Sequence[int], r: ReplicaLoad, now: float) -> int:
        recent = self._recent.get(r.replica_id, {})
        n = 0
        for k in keys:
            if k not in r.keys and now - recent.get(k, -1e18) > self.remember_s:
                break
            n += 1
        return n

    def rank(self, keys, replicas):
        least = min(r.in_flight for r in replicas)
        if keys:
            now = self.clock()
            match = [self._matched(keys, r, now) for r in replicas]
            best = max(range(len(replicas)), key=lambda i: (match[i], -replicas[i].in_flight))
            if match[best] and replicas[best].in_flight - least <= self.imbalance:
                return [[best], *_least_loaded(replicas, [i for i in range(len(replicas)) if i != best])]
        return self._fallback.rank(keys, replicas)

    def routed(self, keys, replica_id):
        now = self.clock()
        recent = self._recent.setdefault(replica_id, {})
        if len(recent) > 65536:  # forget expired entries now and then
            for k in [k for k, t in recent.items() if now - t > self.remember_s]:
                del recent[k]
        for k in keys:
            recent[k] = now
