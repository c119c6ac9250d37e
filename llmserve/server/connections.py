"""Connections: one server's open HTTP connections — the cap, the idle ones oldest first, the counts /stats shows."""

from __future__ import annotations

import collections
import logging
from typing import Protocol

log = logging.getLogger("llmserve.server")

# file descriptors the default cap leaves to everything else: the model's files, the engine's pipes,
# logs, and the connections being refused (each holds one while its client reads the 503)
_RESERVE_FDS = 256
# the default cap's ceiling: an open h11 connection costs the server some 6 KiB (measured), and
# more streams than this are past what one engine serves at once anyway
_MAX_DEFAULT = 16384


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as nginx and Go do at start; the soft limit after."""
    try:
        import resource
    except ImportError:  # Windows: no rlimits; asyncio's selector has its own bound
        return 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # macOS refuses past its OPEN_MAX: keep what we have
            log.info("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Evictable(Protocol):
    """What the table needs of a connection (transport.LimitedH11Protocol)."""

    def evict(self) -> None:
        """Answer this idle connection 503 and close it, to make room for a new one."""


class Connections:
    """The connections a server has admitted; its protocols report to it, /stats and /metrics read it."""

    def __init__(self, limit: int, per_client: int = 0, linger_limit: int = 64):
        self.limit = limit
        self.per_client = per_client  # 0: no per-address limit
        self.linger_limit = linger_limit  # refused connections left open to be read, at the most
        self._open: dict[Evictable, str] = {}  # connection → client address
        self._idle: dict[Evictable, None] = {}  # the idle ones, longest idle first (a dict keeps insertion order)
        self._by_client: collections.Counter[str] = collections.Counter()
        self.refused = {"max_connections": 0, "max_connections_per_client": 0}
        self.evicted = 0  # idle connections closed to make room for a new one
        self.timed_out = 0  # closed by header_timeout, request_read_timeout or (new ones) keep_alive_timeout
        self.lingering = 0  # refused connections still open while their clients read the answer

    @classmethod
    def for_server(cls, max_connections: int | None, per_client: int) -> Connections:
        """The table for a server about to start: the open-file limit raised, the cap sized from it unless set."""
        fds = raise_fd_limit()
        # all the descriptors but a reserve (an eighth, at least 256); refusals may linger in half of that
        limit = max_connections or max(16, min(_MAX_DEFAULT, fds - max(_RESERVE_FDS, fds // 8)))
        if limit > fds - 64:
            log.warning("max_connections=%d is near the open-file limit (%d): past it, new connections wait "
                        "in the listen queue unanswered", limit, fds)
        return cls(limit, per_client, linger_limit=max(64, min(_MAX_DEFAULT, (fds - limit) // 2)))

    def admit(self, conn: Evictable, client: str) -> str | None:
        """Take a new connection in (idle); or the name of the limit it is past, and count the refusal."""
        if self.per_client and self._by_client[client] >= self.per_client:
            self.refused["max_connections_per_client"] += 1
            return "max_connections_per_client"
        if len(self._open) >= self.limit:
            if not self._idle:
                self.refused["max_connections"] += 1
                return "max_connections"
            # the longest idle makes room: an attacker's silent connection, or a client's spare kept-alive
            # one, rather than a newcomer that is about to send (each one refused is told so: evict())
            oldest = next(iter(self._idle))
            self.forget(oldest)
            self.evicted += 1
            oldest.evict()
        self._open[conn] = client
        self._by_client[client] += 1
        self._idle[conn] = None
        return None

    def idle(self, conn: Evictable) -> None:
        """conn has no request in progress: in line for eviction behind those idle longer."""
        if conn in self._open and conn not in self._idle:
            self._idle[conn] = None

    def busy(self, conn: Evictable) -> None:
        """conn is receiving or being answered a request: never evicted."""
        self._idle.pop(conn, None)

    def forget(self, conn: Evictable) -> None:
        """conn has closed or been refused (idempotent)."""
        client = self._open.pop(conn, None)
        if client is None:
            return
        self._idle.pop(conn, None)
        self._by_client[client] -= 1
        if not self._by_client[client]:
            del self._by_client[client]

    def linger(self) -> bool:
        """Take a place for a refused connection to stay open in while it is read; False when none is left."""
        if self.lingering >= self.linger_limit:  # each holds a descriptor
            return False
        self.lingering += 1
        return True

    def lingered(self) -> None:
        """A refused connection that lingered has closed."""
        self.lingering -= 1

    def timed_out_one(self) -> None:
        """A connection was closed by a timeout (its first byte, its head, or its whole request)."""
        self.timed_out += 1

    def stats(self) -> dict:
        """The counts for /stats and /metrics."""
        return {"open": len(self._open), "idle": len(self._idle), "limit": self.limit,
                "per_client_limit": self.per_client, "refused": dict(self.refused), "evicted": self.evicted,
                "timed_out": self.timed_out, "lingering": self.lingering}
