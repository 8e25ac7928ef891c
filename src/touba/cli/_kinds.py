"""Which touba store a SQLite file or a PostgreSQL name holds, found by reading only.

Every command checks its store this way before opening it, so that a store
of the wrong kind, or another application's database, is refused rather than
given touba's tables:

- A SQLite file is opened read-only (``mode=ro``; ``immutable=1`` when no
  ``-wal`` file sits beside it, so SQLite leaves no ``-wal``/``-shm`` behind)
  and its kinds are read from the ``<kind>_schema_version`` rows of the shared
  ``touba_meta`` table (``history``, ``memory``, ``checkpoint``, ...), each
  with its store's main table (``touba_history_sessions``,
  ``touba_memory_sessions``). One file may hold several kinds.
- A PostgreSQL history table ``T`` is ``T`` with ``T_meta`` and ``T_messages``;
  a memory prefix ``P`` is ``P_sessions`` with ``P_meta``. The ``_meta`` table
  records only a version, so the companion tables tell the kinds apart.
- A command that only reads also refuses what its store would change on
  opening: a file of an older schema version (opening migrates it) or one
  readable by group or others (opening resets it to 0600).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import urllib.parse
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["PgContents", "SqliteContents", "StoreKind", "pg_contents", "sqlite_contents"]

StoreKind = Literal["history", "memory"]
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


@dataclass(frozen=True, slots=True)
class PgContents:
    """What a PostgreSQL name holds: touba's kinds, whether a table of that very name
    exists (touba's or not), and the version its ``_meta`` table records."""

    kinds: list[StoreKind]
    main: bool
    version: str | None


async def pg_contents(conn: AsyncConnection[Any], name: str) -> PgContents:
    """What is stored under the PostgreSQL ``name`` (``schema.name`` allowed), read only."""
    from psycopg import sql

    *schema, last = name.split(".")
    suffixes = ("", "_meta", "_messages", "_sessions")
    names = [sql.Identifier(*schema, last + suffix).as_string(conn) for suffix in suffixes]
    query = "SELECT " + ", ".join(["to_regclass(%s) IS NOT NULL"] * len(names))
    row = await (await conn.execute(query, names)).fetchone()
    main, meta, messages, sessions = (bool(v) for v in row or (False,) * 4)
    kinds: list[StoreKind] = []
    if meta and main and messages:
        kinds.append("history")
    if meta and sessions:
        kinds.append("memory")
    version = None
    if meta:
        select = sql.SQL("SELECT value FROM {} WHERE name = 'schema_version'")
        found = await (
            await conn.execute(select.format(sql.Identifier(*schema, last + "_meta")))
        ).fetchone()
        version = None if found is None else str(found[0])
    return PgContents(kinds, main, version)
