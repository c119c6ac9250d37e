"""Each forward's tokens handed on while the C call that runs several forwards is still making the next ones.

A call of eight forwards takes eight forwards' time; handing its tokens on only when it returns made them reach a
stream in bursts of eight. The call (csrc/decode_layers.cpp, Step::progress) stores how many forwards are done after
each one and writes a byte to a pipe; the relay's thread, asleep in a read of that pipe until then, hands the new
forwards' tokens to the listener (the engine's replay of a forward: its outputs go to their streams at once). ctypes
releases the GIL for the call, so the relay runs meanwhile, on whatever core is free of the call's team.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger("llmserve.torch")

# a forward's index and its tokens (one a row); called in order 0, 1, ... on the relay's thread
Listener = Callable[[int, list[int]], None]


class ForwardRelay:
    """The pipe, the progress word the call stores into, and the thread that hands forwards on."""

    def __init__(self):
        self.progress = np.zeros(1, dtype=np.int32)  # forwards done, as the call stores it
        self.progress_at = self.progress.ctypes.data
        self._read, self.notify_fd = os.pipe()
        os.set_blocking(self.notify_fd, False)  # the call never waits on the pipe
        self._lock = threading.Lock()  # held while a listener runs, and to open and close a call
        self._listener: Listener | None = None  # None: no call open (or its listener failed)
        self._tokens = np.empty((0, 0), dtype=np.int64)
        self._handed = 0
        threading.Thread(target=self._run, name="llmserve-forward-relay", daemon=True).start()

    def open(self, listener: Listener, tokens: np.ndarray) -> None:
        """Before a call: hand `tokens`' rows ([forwards, rows], which the call fills) to listener as they are made."""
        with self._lock:
            self.progress[0] = 0
            self._listener, self._tokens, self._handed = listener, tokens, 0

    def close(self) -> int:
        """After the call: no more hand-offs once this returns (none runs then); how many forwards were handed."""
        with self._lock:
            self._listener = None
            return self._handed

    def _run(self) -> None:
        while True:
            try:
                os.read(self._read, 4096)  # one byte a forward; several at once where the relay fell behind
            except OSError:
                return
            with self._lock:
                done = int(self.progress[0])
                while self._listener is not None and self._handed < done:
                    try:
                        self._listener(self._handed, self._tokens[self._handed].tolist())
                    except Exception:  # noqa: BLE001 - the caller replays what was not handed, when the call returns
                        log.exception("handing forward %d on failed; the rest follow when the call returns",
                                      self._handed)
                        self._listener = None
                        break
                    self._handed += 1
