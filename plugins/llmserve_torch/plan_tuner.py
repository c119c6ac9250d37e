"""Serve first, tune later: the kernel-plan timings a start deferred, run in a thread once the engine is idle.

A first start used to time every quantized kind before serving (a minute for a 0.5B model; and beside a busy
browser or build the timing was noise, so the next start timed again). Now a start with nothing remembered serves on
the safe plan (our kernels at every row count) and this thread times the deferred kinds when no step has run for a
while, judged as a start's timing is: a quiet one is remembered, a busy one is dropped and tried again later.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from llmserve_torch.kernel_plan import KernelPlan, tune_deferred

log = logging.getLogger("llmserve.torch")

IDLE_S = 2.0  # no step for this long: the timing disturbs no request (and no request disturbs it)
RETRY_S = 30.0  # after a timing on a busy machine
TRIES = 5  # then the safe plan stays for this run (`llmserve plan retime` times it on demand)


class PlanTuner:
    """A daemon thread timing plan's deferred kinds when idle() (seconds since the last step) reaches IDLE_S, each
    kind while holding `steps` (a step that comes meanwhile waits for that kind's timing, seconds at most)."""

    def __init__(self, plan: KernelPlan, idle: Callable[[], float], steps=None):
        # steps: the backend's lock around its steps, held while a kind is timed (never a kernel call beside a step's)
        self.plan, self.idle, self.steps = plan, idle, steps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-plan-tuner", daemon=True)

    def start(self) -> None:
        """Begin waiting for an idle moment."""
        self._thread.start()

    def stop(self) -> None:
        """Stop waiting (a timing under way finishes first)."""
        self._stop.set()

    def _run(self) -> None:
        for _ in range(TRIES):
            while not self._stop.is_set() and self.idle() < IDLE_S:
                self._stop.wait(min(IDLE_S, max(0.1, IDLE_S - self.idle())))
            if self._stop.is_set():
                return
            try:
                for line in tune_deferred(self.plan, self.steps or contextlib.nullcontext()):
                    log.info("kernel plan, timed in the background: %s", line)
            except Exception:  # a failed timing must not take the server down: the safe plan keeps serving
                log.exception("kernel plan: the background timing failed; the safe plan stays")
                return
            if not self.plan.pending or self._stop.wait(RETRY_S):
                return
        log.info("kernel plan: the machine stayed busy; the safe plan stays for this run (time it with `llmserve "
                 "plan retime`)")
