"""Which touba stores a SQLite file holds, found by reading only.

The file is opened read-only (``mode=ro``; ``immutable=1`` when no ``-wal``
file sits beside it, so SQLite leaves no ``-wal``/``-shm`` behind) and its
kinds are read from the ``<kind>_schema_version`` rows of the shared
``touba_meta`` table (``history``, ``memory``, ``checkpoint``, ...), each with
its store's main table (``touba_history_sessions``, ``touba_memory_sessions``).
One file may hold several kinds. The stores opened with ``create=False``
(:func:`require_sqlite_store`) and the CLI's checks (``touba.cli._kinds``) use it.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import urllib.parse
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from touba.errors import ConfigurationError
from touba.history._files import check_private_location

__all__ = ["SqliteContents", "require_sqlite_store", "sqlite_contents"]

_MAIN = {"history": "touba_history_sessions", "memory": "touba_memory_sessions"}
_SUFFIX = "_schema_version"


@dataclass(frozen=True, slots=True)
class SqliteContents:
    """What a SQLite file holds: touba's kinds (name to schema version), whether it
    holds any table at all, and its permission bits."""

    kinds: dict[str, str]
    tables: bool
    mode: int


def sqlite_contents(path: Path) -> SqliteContents:
    """Read what ``path`` holds without writing to it or beside it.

    Raises ``sqlite3.DatabaseError`` for a file that is not a SQLite database,
    ``OSError`` for one that cannot be read.
    """
    absolute = os.path.abspath(path)
    mode = stat.S_IMODE(os.stat(absolute).st_mode)
    # Without a -wal file every committed page is in the file itself, and immutable
    # reading creates nothing; with one (a live or crashed writer), SQLite must read it.
    flag = "mode=ro" if os.path.exists(absolute + "-wal") else "immutable=1"
    uri = f"file:{urllib.parse.quote(absolute)}?{flag}&nofollow=1"
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        names = {
            str(row[0])
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        rows: list[Any] = (
            conn.execute("SELECT name, value FROM touba_meta").fetchall()
            if "touba_meta" in names
            else []
        )
    kinds: dict[str, str] = {}
    for name, value in rows:
        kind = str(name).removesuffix(_SUFFIX)
        # A kind without a main table here (checkpoint, resource) counts by its row alone.
        if str(name).endswith(_SUFFIX) and _MAIN.get(kind, "touba_meta") in names:
            kinds[kind] = str(value)
    return SqliteContents(kinds, bool(names), mode)


def require_sqlite_store(
    filename: str | os.PathLike[str], kind: str, owner: str, what: str
) -> None:
    """``create=False``: refuse (``ConfigurationError``), creating and changing nothing,
    unless ``filename`` is a SQLite file that holds a touba store of ``kind``.

    The location is checked first as opening would (``DecisionHistoryStorageUnsafe``);
    a file that is not a database raises ``sqlite3.DatabaseError`` for the store to
    translate. ``owner`` names the store's class, ``what`` its data ("chat memory").
    """
    path = check_private_location(filename)
    if not os.path.lexists(path):
        raise ConfigurationError(
            f"{owner}(create=False): there is no file {path}; nothing was created. Check "
            "the path, or pass create=True to create the store"
        )
    if kind not in sqlite_contents(Path(path)).kinds:
        raise ConfigurationError(
            f"{owner}(create=False): {path} holds no touba {what} store; nothing was "
            "changed. Check the path, or pass create=True to add one to this file"
        )
