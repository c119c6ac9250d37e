"""SqliteStore: response records as JSON text in one table of an SQLite file, the oldest dropped past a cap."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from llmserve.config import check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import ResponseStore

# server.response_store_options of the sqlite store, with their defaults
OPTIONS: dict[str, Any] = {"path": "llmserve-responses.sqlite3", "max_responses": 100_000}

_SCHEMA = "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, record TEXT NOT NULL, at INTEGER NOT NULL)"


class SqliteStore(ResponseStore):
    """One row per response; a write past max_responses deletes the oldest rows (by when they were written)."""

    def __init__(self, path: str, max_responses: int):
        self.path, self.max_responses = path, max_responses
        self._lock = threading.Lock()  # one writer at a time from this process's worker threads
        with self._connect() as db:
            db.execute(_SCHEMA)

    @classmethod
    def from_options(cls, config, options: dict[str, Any]) -> SqliteStore:
        """A store from server.response_store_options (a ConfigError naming a bad one)."""
        o = check_options(options, OPTIONS, "server.response_store_options (sqlite)")
        if not isinstance(o["path"], str) or not o["path"]:
            raise ConfigError(f"server.response_store_options.path: must be a file path, got {o['path']!r}")
        n = o["max_responses"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"server.response_store_options.max_responses: must be a positive integer, got {n!r}")
        Path(o["path"]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            return cls(str(Path(o["path"]).expanduser()), n)
        except sqlite3.Error as e:
            raise ConfigError(f"server.response_store_options.path: cannot open {o['path']!r}: {e}") from None

    @contextlib.contextmanager
    def _connect(self):
        # a connection per call: calls come from any worker thread, and opening one costs well under a millisecond
        db = sqlite3.connect(self.path, timeout=10)
        try:
            with db:  # commits, or rolls back on an error
                yield db
        finally:
            db.close()

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        text = json.dumps(record, separators=(",", ":"))
        with self._lock, self._connect() as db:
            db.execute("INSERT OR REPLACE INTO responses (id, record, at) VALUES "
                       "(?, ?, (SELECT COALESCE(MAX(at), 0) + 1 FROM responses))", (response_id, text))
            db.execute("DELETE FROM responses WHERE at <= (SELECT MAX(at) FROM responses) - ?", (self.max_responses,))

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute("SELECT record FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str) -> bool:
        with self._lock, self._connect() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
