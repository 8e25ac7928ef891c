"""``SqliteResourceBinding``: business resources in a private SQLite file.

One row per item, keyed by (resource, scope, scope_key, key), the value as
compact JSON text. The file is opened like every touba SQLite file
(:func:`touba.history._files.open_private_sqlite`: 0600 files, no symbolic
links, a private directory) and may be shared with the history and
checkpoint stores. Not encrypted. Every SQLite failure (the file locked past
``timeout``, a full or failing disk, a read-only file system) raises
``ResourceBindingUnavailable`` (retryable), chained, with nothing written.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Mapping
from contextlib import suppress
from datetime import UTC, datetime
from typing import Final, TypeVar

from touba.errors import ResourceBindingUnavailable
from touba.history._model import JSON
from touba.runtime._owned_sqlite import OwnedSqliteStore, SchemaVersion, write
from touba.runtime._resources import ResourceAddress, ResourceItem, encode_value, scope_keys_of

__all__ = ["SqliteResourceBinding"]

R = TypeVar("R")
SCHEMA_VERSION: Final = 1
_VERSION = SchemaVersion("resource_schema_version", SCHEMA_VERSION, "resource")
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS touba_resources (
        resource TEXT NOT NULL, scope TEXT NOT NULL, scope_key TEXT NOT NULL,
        key TEXT NOT NULL, value TEXT NOT NULL, updated_at TEXT NOT NULL,
        PRIMARY KEY (resource, scope, scope_key, key)) WITHOUT ROWID""",
)


def _where(address: ResourceAddress) -> tuple[str, str, str]:
    return (address.resource, address.scope, address.scope_key)


class _Db:
    """The binding's SQL (its schema installed when made); runs only on the binding's
    thread, one transaction per write."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        _VERSION.install(self.conn, _SCHEMA)

    def _write(self, job: Callable[[], R]) -> R:
        return write(self.conn, job)

    def get(self, address: ResourceAddress, key: str) -> tuple[str, str] | None:
        row = self.conn.execute(
            "SELECT value, updated_at FROM touba_resources "
            "WHERE resource = ? AND scope = ? AND scope_key = ? AND key = ?",
            (*_where(address), key),
        ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def put(self, address: ResourceAddress, key: str, value: str, at: str) -> None:
        def job() -> None:
            self.conn.execute(
                "INSERT INTO touba_resources (resource, scope, scope_key, key, value, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (resource, scope, "
                "scope_key, key) DO UPDATE SET value = excluded.value, "
                "updated_at = excluded.updated_at",
                (*_where(address), key, value, at),
            )

        self._write(job)

    def delete(self, address: ResourceAddress, key: str) -> bool:
        def job() -> bool:
            cursor = self.conn.execute(
                "DELETE FROM touba_resources "
                "WHERE resource = ? AND scope = ? AND scope_key = ? AND key = ?",
                (*_where(address), key),
            )
            return cursor.rowcount > 0

        return self._write(job)

    def keys(self, address: ResourceAddress, prefix: str, limit: int) -> list[str]:
        rows = self.conn.execute(
            "SELECT key FROM touba_resources WHERE resource = ? AND scope = ? "
            "AND scope_key = ? AND substr(key, 1, ?) = ? ORDER BY key LIMIT ?",
            (*_where(address), len(prefix), prefix, limit),
        ).fetchall()
        return [str(row[0]) for row in rows]

    def count_scope_keys(self, scope_keys: dict[str, frozenset[str]]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for scope, keys in scope_keys.items():
            for scope_key in keys:
                row = self.conn.execute(
                    "SELECT COUNT(*) FROM touba_resources WHERE scope = ? AND scope_key = ?",
                    (scope, scope_key),
                ).fetchone()
                if row[0]:
                    counts[scope] = counts.get(scope, 0) + int(row[0])
        return counts

    def erase_scope_keys(self, scope_keys: dict[str, frozenset[str]]) -> dict[str, int]:
        before = int(self.conn.execute("PRAGMA secure_delete").fetchone()[0])
        self.conn.execute("PRAGMA secure_delete=ON")
        try:

            def job() -> dict[str, int]:
                counts = self.count_scope_keys(scope_keys)
                for scope, keys in scope_keys.items():
                    for scope_key in keys:
                        self.conn.execute(
                            "DELETE FROM touba_resources WHERE scope = ? AND scope_key = ?",
                            (scope, scope_key),
                        )
                return counts

            erased = self._write(job)
        finally:
            self.conn.execute(f"PRAGMA secure_delete={before}")
        with suppress(sqlite3.Error):  # a reader holds the WAL: the next checkpoint will do
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return erased

    # -- export and import (touba.data) --------------------------------------------------

    def scope_items(
        self, scope: str, scope_key: str, after: tuple[str, str], limit: int
    ) -> list[tuple[str, str, str, str]]:
        rows = self.conn.execute(
            "SELECT resource, key, value, updated_at FROM touba_resources "
            "WHERE scope = ? AND scope_key = ? AND (resource, key) > (?, ?) "
            "ORDER BY resource, key LIMIT ?",
            (scope, scope_key, *after, limit),
        ).fetchall()
        return [(str(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]

    def import_item(self, address: ResourceAddress, key: str, value: str, at: str) -> bool:
        def job() -> bool:
            cursor = self.conn.execute(
                "INSERT INTO touba_resources (resource, scope, scope_key, key, value, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (*_where(address), key, value, at),
            )
            return cursor.rowcount > 0

        return self._write(job)


class SqliteResourceBinding(OwnedSqliteStore[_Db]):
    """Resources in a SQLite file, durable and shared by processes.

    Give exactly one of ``filename`` (checked and opened like
    :class:`~touba.runtime.SqliteCheckpointStore`'s: files created or reset to
    0600 before opening, symbolic links and group- or other-writable
    directories refused with ``DecisionHistoryStorageUnsafe``; create the
    directory yourself, mode 0700) or ``database`` (an open
    ``sqlite3.Connection`` made with ``check_same_thread=False``, whose
    closing and file protection stay yours). One thread owns the connection;
    close with ``close()`` or ``async with``.
    """

    _owner = "SqliteResourceBinding"
    _version = _VERSION
    _unavailable = ResourceBindingUnavailable

    def _build(self, conn: sqlite3.Connection) -> _Db:
        return _Db(conn)

    async def get(self, address: ResourceAddress, key: str) -> ResourceItem | None:
        """The item under ``key`` (a detached copy), or None."""
        row = await self._run(lambda: self._db.get(address, key))
        if row is None:
            return None
        return ResourceItem(key, json.loads(row[0]), datetime.fromisoformat(row[1]))

    async def put(self, address: ResourceAddress, key: str, value: JSON) -> ResourceItem:
        """Store ``value`` under ``key`` in one transaction, replacing any value there;
        the item as stored. ConfigurationError when ``value`` is not JSON data;
        ResourceBindingUnavailable when the file fails or stays locked past
        ``timeout``; nothing is written then."""
        text, at = encode_value(value), datetime.now(UTC)
        await self._run(lambda: self._db.put(address, key, text, at.isoformat()))
        return ResourceItem(key, json.loads(text), at)

    async def delete(self, address: ResourceAddress, key: str) -> bool:
        """Remove ``key`` in one transaction; False when it was not there (of concurrent
        deleters, in any process, exactly one gets True)."""
        return await self._run(lambda: self._db.delete(address, key))

    async def keys(self, address: ResourceAddress, *, prefix: str, limit: int) -> list[str]:
        """The keys starting with ``prefix``, sorted by code point, at most ``limit``."""
        return await self._run(lambda: self._db.keys(address, prefix, limit))

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def count_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """How many values are kept under these scope keys (scope ``run``, ``session`` or
        ``user`` to its keys), by scope (none left out). ConfigurationError for another
        scope; ResourceBindingUnavailable when the file fails."""
        wanted = scope_keys_of(scope_keys)
        return await self._run(lambda: self._db.count_scope_keys(wanted))

    async def erase_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """Delete every value of every resource under these scope keys in one transaction
        whose deleted bytes SQLite overwrites (``PRAGMA secure_delete``), then checkpoint
        the WAL; how many, by scope. ResourceBindingUnavailable (nothing deleted) when the
        file fails."""
        wanted = scope_keys_of(scope_keys)
        return await self._run(lambda: self._db.erase_scope_keys(wanted))

    # -- export and import (touba.data) --------------------------------------------------

    async def scope_items(
        self, scope: str, scope_key: str, *, after: tuple[str, str] = ("", ""), limit: int = 100
    ) -> list[tuple[ResourceAddress, ResourceItem]]:
        """The items of every resource under ``scope`` / ``scope_key``, ordered by
        (resource, key), the first ``limit`` after ``after`` (a (resource, key) cursor).
        ResourceBindingUnavailable when the file fails."""
        found = await self._run(
            lambda: self._db.scope_items(scope, scope_key, after, max(limit, 0))
        )
        return [
            (
                ResourceAddress(resource, scope, scope_key),  # type: ignore[arg-type]
                ResourceItem(key, json.loads(text), datetime.fromisoformat(at)),
            )
            for resource, key, text, at in found
        ]

    async def import_item(
        self, address: ResourceAddress, key: str, value: JSON, updated_at: datetime
    ) -> bool:
        """Store ``value`` under ``key`` with its ``updated_at`` (an export's) in one
        transaction, unless a value is there; False, changing nothing, when one is.
        ConfigurationError when ``value`` is not JSON data; ResourceBindingUnavailable
        (nothing written) when the file fails."""
        text, at = encode_value(value), updated_at.astimezone(UTC).isoformat()
        return await self._run(lambda: self._db.import_item(address, key, text, at))
