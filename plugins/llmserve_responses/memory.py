"""The default response store: records in this process's memory, the least recently used dropped past a cap."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from llmserve.config import check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import ResponseStore

# server.response_store_options of the memory store, with their defaults
OPTIONS: dict[str, Any] = {"max_responses": 1000, "max_bytes": 64 * 1024 * 1024}


class MemoryStore(ResponseStore):
    """Records as JSON text, least recently used first out, within max_responses and max_bytes (of the text)."""

    def __init__(self, max_responses: int, max_bytes: int):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._records: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # put/get/delete run in worker threads

    @classmethod
    def from_options(cls, config, options: dict[str, Any]) -> MemoryStore:
        """A store from server.response_store_options (a ConfigError naming a bad one)."""
        o = check_options(options, OPTIONS, "server.response_store_options (memory)")
        for k in OPTIONS:
            if not isinstance(o[k], int) or isinstance(o[k], bool) or o[k] < 1:
                raise ConfigError(f"server.response_store_options.{k}: must be a positive integer, got {o[k]!r}")
        return cls(o["max_responses"], o["max_bytes"])

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        text = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._drop(response_id)
            if len(text) > self.max_bytes:  # would push out everything else and still not fit
                return
            self._records[response_id] = text
            self._bytes += len(text)
            while len(self._records) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._records)))

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            text = self._records.get(response_id)
            if text is None:
                return None
            self._records.move_to_end(response_id)  # read: recently used
        return json.loads(text)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        text = self._records.pop(response_id, None)
        if text is None:
            return False
        self._bytes -= len(text)
        return True
