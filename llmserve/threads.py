"""The rule that one thread owns torch for an engine, and the checks that make breaking it visible.

Why: libgomp (the OpenMP runtime torch's CPU build uses) keeps one worker pool per thread that
has run a parallel region, and counts every pool's threads as "managed". Once that count passes
the CPUs it may use, every barrier spins only ``gomp_throttled_spin_count`` (100) times before it
sleeps on a futex, and GOMP_SPINCOUNT cannot raise that cap. A decode step runs hundreds of
parallel regions, so each one then hands off through a sleep and a wake-up: on 2 cores, torch
work on a second thread runs at ~0.6x once the first has a pool. A single thread forced to the
throttled count (GOMP_SPINCOUNT=100) is exactly as slow, which is how the cause was confirmed.
So an engine is loaded, warmed up and stepped on one thread, and no other thread runs torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger("llmserve.threads")

ENGINE_THREAD_NAME = "llmserve-engine"  # 15 bytes: the longest name Linux keeps for a thread


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name, inherited by the OpenMP workers it starts (`top -H` shows it)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no libc symbols (static builds): names are cosmetic
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _os_names(tids) -> dict[int, str]:
    """tid → the thread's OS name, for those of tids still running (none where there is no /proc)."""
    out: dict[int, str] = {}
    for tid in tids:
        with contextlib.suppress(OSError, TypeError):  # ended meanwhile; not Linux (no native_id, no /proc)
            out[tid] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    return out


def native_threads() -> dict[int, str]:
    """Threads of this process that Python did not start (OpenMP and other native pools): tid → OS name."""
    try:
        tids = {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}
    except OSError:  # not Linux: nothing to report
        return {}
    return _os_names(tids)


def python_thread_names() -> dict[int, str]:
    """The OS names of the threads Python started: tid → name (a native thread started by one inherits it)."""
    return _os_names(t.native_id for t in threading.enumerate())


def warn_if_foreign_pool() -> bool:
    """At engine start-up (on the engine thread, before loading): warn when another thread already has an OpenMP pool."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False  # nobody ran torch yet: no pool can exist
    # torch itself starts one native thread on import and a pthreadpool of threads - 1 workers on
    # set_num_threads; more than that before the engine loads means some thread ran parallel
    # torch work and holds an OpenMP pool (threads - 1 more workers). All of them carry the OS name of the Python
    # thread that started them; native threads named otherwise belong to some library (a Ray worker runs ~18:
    # gRPC's, Ray's io) and are not counted
    inherited = set(python_thread_names().values())
    extra = [name for name in native_threads().values() if name in inherited]
    if len(extra) <= torch.get_num_threads():
        return False
    log.warning("%d native threads exist before the engine loads: another thread of this process has run "
                "parallel torch work and holds an OpenMP pool, so the engine's torch work will run at about "
                "0.6x (libgomp throttles spin-waiting once its threads outnumber the CPUs). Load and step "
                "the engine on one thread and run no torch on any other (docs/server.md).", len(extra))
    return True


class ThreadOwner:
    """Records the thread that built an object and every thread that stepped it (read for /stats and the guard)."""

    __slots__ = ("ident", "name", "step_threads", "_warned")

    def __init__(self) -> None:
        t = threading.current_thread()
        self.ident = t.ident
        self.name = t.name
        self.step_threads: dict[int, str] = {}
        self._warned = False

    def check(self) -> None:
        """Called once a step: note the stepping thread; warn once if it is not the owner."""
        ident = threading.get_ident()
        if ident in self.step_threads:
            return
        name = threading.current_thread().name
        self.step_threads[ident] = name
        if ident != self.ident and not self._warned:
            self._warned = True
            log.warning("the engine was built on thread %r and is stepped on %r: torch work on CPU runs at "
                        "about 0.6x this way; build and step it on one thread (AsyncEngine does, given a "
                        "factory)", self.name, name)

    def layout(self) -> dict:
        """Which thread loaded, which stepped, and whether they are one (every step on the loading thread)."""
        return {"load_thread": self.name, "step_threads": sorted(set(self.step_threads.values())),
                "one_thread": all(i == self.ident for i in self.step_threads)}
