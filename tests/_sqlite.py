"""A second connection to a store's SQLite file, opened as another program would."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A separate connection to inspect or damage the file, closed after."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def set_schema_version(path: Path, name: str, value: str) -> None:
    """Writes ``value`` as the file's ``name`` row of ``touba_meta`` (another touba's file)."""
    with raw(path) as conn:
        conn.execute("UPDATE touba_meta SET value = ? WHERE name = ?", (value, name))
