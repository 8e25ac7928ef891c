"""``PostgresResourceBinding``: business resources in a PostgreSQL table many workers share.

Layout (schema version 1), every name derived from ``table`` and quoted with
``psycopg.sql.Identifier``: ``<table>`` holds one row per item, keyed by
(resource, scope, scope_key, key), the value as compact JSON text (as the
other bindings keep it) and ``updated_at`` from the server's clock;
``<table>_meta`` holds the schema version (a foreign table or another
version is refused untouched, ConfigurationError). The key columns use the
``"C"`` collation, so ``keys`` sorts by code point as Python and SQLite do,
whatever the database's locale.

Each operation is one statement in one READ COMMITTED transaction: ``put``
is an upsert (of concurrent writers of one key, the last to commit wins and
no write is half-applied), ``delete`` reports True to exactly one of
concurrent deleters. PostgreSQL text cannot hold NUL: ``put`` refuses a
resource, scope key or key containing ``\\x00`` with ConfigurationError
(nothing is written); ``get``, ``delete`` and ``keys`` find nothing there.

Errors: a connection or schema problem while opening raises
``ConfigurationError``; a lost server, broken connection or pool timeout
during use raises ``ResourceBindingUnavailable`` (transient), the driver's
error chained.

Encryption at rest (``encryption=``, :mod:`touba.runtime._sealing`): ``value`` is
sealed, bound to the table, the address and the key; the address, keys and
``updated_at`` stay plaintext (``keys`` filters and sorts them in SQL).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any, Final, LiteralString

try:
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool
except ImportError as e:  # pragma: no cover - exercised in a test with psycopg hidden
    raise ImportError(
        "touba.runtime.PostgresResourceBinding needs psycopg 3 and psycopg-pool: "
        'pip install "touba[postgres]"'
    ) from e

from touba._encryption import Encryption
from touba.errors import ConfigurationError, ResourceBindingUnavailable
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._model import JSON
from touba.history._pg import OwnedPool, PooledStore, Schema, has_nul, row, rows, run, table_parts
from touba.runtime._resources import ResourceAddress, ResourceItem, encode_value, scope_keys_of
from touba.runtime._sealing import Cursor, RowSeal, check_batch, rotate

__all__ = ["SCHEMA_VERSION", "PostgresResourceBinding"]

SCHEMA_VERSION: Final = 1


class _Statements:
    """Every statement of the binding, composed once from the table's identifiers."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        *schema, name = parts
        t = sql.Identifier(*schema, name)

        def q(text: LiteralString) -> sql.Composed:
            return sql.SQL(text).format(t=t)

        self.create = [
            q(
                "CREATE TABLE {t} ("
                ' resource text COLLATE "C" NOT NULL,'
                ' scope text COLLATE "C" NOT NULL,'
                ' scope_key text COLLATE "C" NOT NULL,'
                ' key text COLLATE "C" NOT NULL,'
                " value text NOT NULL,"
                " updated_at timestamptz NOT NULL,"
                " PRIMARY KEY (resource, scope, scope_key, key))"
            )
        ]
        self.get = q(
            "SELECT value, updated_at FROM {t}"
            " WHERE resource = %s AND scope = %s AND scope_key = %s AND key = %s"
        )
        self.put = q(
            "INSERT INTO {t} (resource, scope, scope_key, key, value, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, now())"
            " ON CONFLICT (resource, scope, scope_key, key)"
            " DO UPDATE SET value = EXCLUDED.value, updated_at = EXCLUDED.updated_at"
            " RETURNING updated_at"
        )
        self.delete = q(
            "DELETE FROM {t} WHERE resource = %s AND scope = %s AND scope_key = %s AND key = %s"
        )
        self.keys = q(
            "SELECT key FROM {t} WHERE resource = %s AND scope = %s AND scope_key = %s"
            " AND starts_with(key, %s) ORDER BY key LIMIT %s"
        )
        self.count_scope = q("SELECT COUNT(*) FROM {t} WHERE scope = %s AND scope_key = ANY(%s)")
        self.erase_scope = q("DELETE FROM {t} WHERE scope = %s AND scope_key = ANY(%s)")
        self.scope_items = q(
            "SELECT resource, key, value, updated_at FROM {t}"
            " WHERE scope = %s AND scope_key = %s AND (resource, key) > (%s, %s)"
            " ORDER BY resource, key LIMIT %s"
        )
        self.import_item = q(
            "INSERT INTO {t} (resource, scope, scope_key, key, value, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
        )
        self.stale = q(
            "SELECT resource, scope, scope_key, key, value FROM {t}"
            " WHERE (CAST(%s AS TEXT) IS NULL"
            " OR (resource, scope, scope_key, key) > (%s, %s, %s, %s))"
            " AND substr(value, 1, %s) <> %s"
            " ORDER BY resource, scope, scope_key, key LIMIT %s FOR UPDATE"
        )
        self.reseal = q(
            "UPDATE {t} SET value = %s"
            " WHERE resource = %s AND scope = %s AND scope_key = %s AND key = %s"
        )


def _where(address: ResourceAddress) -> tuple[str, str, str]:
    return (address.resource, address.scope, address.scope_key)


def _unavailable(e: Exception) -> ResourceBindingUnavailable:
    return ResourceBindingUnavailable(
        f"PostgreSQL failed ({type(e).__name__}: {e}). Check the server and retry; the "
        "operation was rolled back unless the connection broke while it committed"
    )


class PostgresResourceBinding(PooledStore):
    """Resources in PostgreSQL, durable and shared by every worker using the table.

    Give exactly one of ``dsn`` (the binding creates, opens and closes its
    own pool of 1 to 4 connections) or ``pool`` (a
    ``psycopg_pool.AsyncConnectionPool`` you open and close). ``table`` is a
    plain identifier, optionally schema-qualified; anything else raises
    ConfigurationError at construction. Tables are created on first use, or
    by ``await binding.open()`` (``async with`` opens too). ``encryption`` (a
    :class:`touba.Encryption`): each value is sealed at rest (see the module
    notes); a value that does not open raises ``DecisionHistoryRecordInvalid``;
    ``rekey()`` rotates keys. Bounds (``max_value_bytes``) count the plaintext.
    ``deadline_seconds`` (default 10) bounds each operation, waiting for a
    connection and every statement included: a network that goes silent fails it
    with ``ResourceBindingUnavailable`` (retryable) within that time.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        table: str = "touba_resources",
        encryption: Encryption | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        parts = table_parts(table, example="touba_resources")
        self._seal = RowSeal(encryption, "touba.resources", table, "value")
        self._rekey_after: Cursor = None
        self._sql = _Statements(parts)
        self._pg = OwnedPool(
            "PostgresResourceBinding",
            dsn=dsn,
            pool=pool,
            schema=Schema.of(parts, self._sql.create, version=SCHEMA_VERSION, what="resource"),
            unavailable=_unavailable,
            deadline=deadline_seconds,
        )
        self.deadline_seconds = self._pg.deadline
        self.table = table

    async def get(self, address: ResourceAddress, key: str) -> ResourceItem | None:
        """The item under ``key`` (a detached copy), or None.
        ResourceBindingUnavailable when the server fails."""
        if has_nul(*_where(address), key):
            return None
        async with self._pg.call() as conn:
            found = await row(conn, self._sql.get, (*_where(address), key))
        if found is None:
            return None
        text, at = found
        opened = self._seal.open(text, *_where(address), key)
        return ResourceItem(key, json.loads(opened), at.astimezone(UTC))

    async def put(self, address: ResourceAddress, key: str, value: JSON) -> ResourceItem:
        """Store ``value`` under ``key``, replacing any value there, committed when this
        returns; the item as stored (``updated_at`` from the server's clock).

        ConfigurationError, with nothing written: ``value`` is not JSON data,
        or a name or key holds NUL. ResourceBindingUnavailable when the
        server fails.
        """
        text = encode_value(value)
        if has_nul(*_where(address), key):
            raise ConfigurationError(
                "PostgreSQL text cannot hold NUL (\\x00): the resource name, scope key and "
                "key must not contain it; nothing was written"
            )
        async with self._pg.call() as conn:
            sealed = self._seal.seal(text, *_where(address), key)
            found = await row(conn, self._sql.put, (*_where(address), key, sealed))
        assert found is not None
        at: datetime = found[0]
        return ResourceItem(key, json.loads(text), at.astimezone(UTC))

    async def delete(self, address: ResourceAddress, key: str) -> bool:
        """Remove ``key``; False when it was not there (of concurrent deleters, exactly
        one gets True). ResourceBindingUnavailable when the server fails."""
        if has_nul(*_where(address), key):
            return False
        async with self._pg.call() as conn:
            return await run(conn, self._sql.delete, (*_where(address), key)) > 0

    async def keys(self, address: ResourceAddress, *, prefix: str, limit: int) -> list[str]:
        """The keys under ``address`` starting with ``prefix``, sorted by code point, at
        most ``limit``. ResourceBindingUnavailable when the server fails."""
        if has_nul(*_where(address), prefix):
            return []
        async with self._pg.call() as conn:
            found = await rows(conn, self._sql.keys, (*_where(address), prefix, limit))
        return [str(r[0]) for r in found]

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def count_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """How many values are kept under these scope keys (scope ``run``, ``session`` or
        ``user`` to its keys), by scope (none left out). ConfigurationError for another
        scope; ResourceBindingUnavailable when the server fails."""
        wanted = _no_nul(scope_keys_of(scope_keys))
        counts: dict[str, int] = {}
        async with self._pg.call() as conn:
            for scope, keys in wanted.items():
                found = await row(conn, self._sql.count_scope, (scope, keys))
                if found is not None and found[0]:
                    counts[scope] = int(found[0])
        return counts

    async def erase_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """Delete every value of every resource under these scope keys in one transaction;
        how many, by scope. The deleted rows stay in the table's dead tuples until
        PostgreSQL vacuums it. ResourceBindingUnavailable (nothing deleted) when the
        server fails."""
        wanted = _no_nul(scope_keys_of(scope_keys))
        counts: dict[str, int] = {}
        async with self._pg.call() as conn:
            for scope, keys in wanted.items():
                erased = await run(conn, self._sql.erase_scope, (scope, keys))
                if erased:
                    counts[scope] = erased
        return counts

    # -- export and import (touba.data) --------------------------------------------------

    async def scope_items(
        self, scope: str, scope_key: str, *, after: tuple[str, str] = ("", ""), limit: int = 100
    ) -> list[tuple[ResourceAddress, ResourceItem]]:
        """The items of every resource under ``scope`` / ``scope_key``, ordered by
        (resource, key) by code point, the first ``limit`` after ``after`` (a (resource,
        key) cursor), each value opened (``DecisionHistoryRecordInvalid`` for one that does
        not). ResourceBindingUnavailable when the server fails."""
        if has_nul(scope, scope_key, *after):
            return []
        params = (scope, scope_key, *after, max(limit, 0))
        async with self._pg.call() as conn:
            found = await rows(conn, self._sql.scope_items, params)
        return [
            (
                ResourceAddress(str(r[0]), scope, scope_key),  # type: ignore[arg-type]
                ResourceItem(
                    str(r[1]),
                    json.loads(self._seal.open(r[2], str(r[0]), scope, scope_key, str(r[1]))),
                    r[3].astimezone(UTC),
                ),
            )
            for r in found
        ]

    async def import_item(
        self, address: ResourceAddress, key: str, value: JSON, updated_at: datetime
    ) -> bool:
        """Store ``value`` under ``key`` with its ``updated_at`` (an export's), sealed
        for its place with ``encryption=``, unless a value is there; False, changing
        nothing, when one is. ConfigurationError when ``value`` is not JSON data or a
        name holds NUL; ResourceBindingUnavailable when the server fails."""
        text = encode_value(value)
        if has_nul(*_where(address), key):
            raise ConfigurationError(
                "PostgreSQL text cannot hold NUL (\\x00): the resource name, scope key and "
                "key must not contain it; nothing was written"
            )
        sealed = self._seal.seal(text, *_where(address), key)
        params = (*_where(address), key, sealed, updated_at)
        async with self._pg.call() as conn:
            return await run(conn, self._sql.import_item, params) > 0

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with the current key up to ``batch`` values sealed with another, in one
        transaction (rows locked meanwhile); how many (0: rotation is done). Resumable:
        call it until it returns 0; older keys stay needed until then.
        ``ConfigurationError`` without ``encryption=`` or for a ``batch`` under 1;
        ``DecisionHistoryRecordInvalid`` (nothing changed) for a value that does not
        open."""
        check_batch(batch)
        stale = self._seal.stale()

        async def one_batch(after: Cursor) -> tuple[int, Cursor]:
            start = (None,) * 4 if after is None else after
            async with self._pg.call() as conn:
                params = (start[0], *start, *stale, batch)
                found = await rows(conn, self._sql.stale, params)
                for *where, value in found:
                    await run(conn, self._sql.reseal, (self._seal.again(value, *where), *where))
            return len(found), (tuple(found[-1][:4]) if found else after)

        done, self._rekey_after = await rotate(one_batch, self._rekey_after, batch)
        return done


def _no_nul(scope_keys: dict[str, frozenset[str]]) -> dict[str, list[str]]:
    """The scope keys PostgreSQL can hold (one with NUL was never stored)."""
    return {scope: sorted(k for k in keys if not has_nul(k)) for scope, keys in scope_keys.items()}
