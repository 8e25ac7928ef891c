"""Which touba store a SQLite file or a PostgreSQL name holds, found by reading only.

Every command checks its store this way before opening it, so that a store
of the wrong kind, or another application's database, is refused rather than
given touba's tables:

- A SQLite file is read by :func:`touba.history._sqlite_kinds.sqlite_contents`
  (read-only, leaving no side file): its kinds are the ``<kind>_schema_version``
  rows of the shared ``touba_meta`` table, each with its store's main table.
  One file may hold several kinds.
- A PostgreSQL history table ``T`` is ``T`` with ``T_meta`` and ``T_messages``;
  a memory prefix ``P`` is ``P_sessions`` with ``P_meta``. The ``_meta`` table
  records only a version, so the companion tables tell the kinds apart.
- A command that only reads also refuses what its store would change on
  opening: a file of an older schema version (opening migrates it) or one
  readable by group or others (opening resets it to 0600).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from touba.history._sqlite_kinds import SqliteContents, sqlite_contents

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["PgContents", "SqliteContents", "StoreKind", "pg_contents", "sqlite_contents"]

StoreKind = Literal["history", "memory"]


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
