"""Default plugin: the `sqlite` response store, which keeps /v1/responses' stored answers in an SQLite file, so
they outlive the server process (server.response_store: sqlite; docs/responses.md)."""

from __future__ import annotations

from llmserve.hookspecs import hookimpl


@hookimpl
def register_response_stores(register):
    """Register the sqlite store: records in a file (options: path, max_responses)."""
    from llmserve_responses_sqlite.store import SqliteStore

    register("sqlite", SqliteStore.from_options)
