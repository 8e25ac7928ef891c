"""``PostgresMemoryStore``: chat turns, key events and extraction jobs in PostgreSQL.

Tables ``<prefix>_sessions``, ``_turns``, ``_events``, ``_history``, ``_jobs``,
``_configs`` (per-agent settings), ``_config_changes`` (their history) and
``_meta`` (the schema version; version 1 to 3 tables are migrated to 4 in
place), every name quoted with
``psycopg.sql.Identifier``; ``prefix`` may carry a schema (``app.touba_memory``).
A table of that name without touba's ``_meta``, or of another schema version,
is refused untouched. Each operation is one READ COMMITTED transaction; jobs
are claimed with ``FOR UPDATE SKIP LOCKED``, so many workers share one queue.
Timestamps are ``timestamptz`` from the store's clock (keep workers' clocks
in sync: lease expiry compares them).

Errors: a connection or schema problem while opening raises
``ConfigurationError``; a lost server, pool timeout or broken connection
during use raises ``MemoryStoreUnavailable``, the driver's error chained.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final, LiteralString, TypeVar

try:
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'touba.memory.postgres needs psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba._encryption import Encryption
from touba.errors import MemoryStoreUnavailable
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._pg import (
    Conn,
    OwnedPool,
    PooledStore,
    Schema,
    lock_key,
    row,
    rows,
    run,
    table_parts,
)
from touba.memory._rows import COLUMNS, STATEMENTS, Row
from touba.memory._sql import Db, SqlMemoryStore
from touba.memory._store import Clock, check_clock, utc_now

__all__ = ["SCHEMA_VERSION", "PostgresMemoryStore"]

R = TypeVar("R")
SCHEMA_VERSION: Final = 4
_DDL: tuple[LiteralString, ...] = (
    "CREATE TABLE {sessions} (session_id text PRIMARY KEY, owner text NOT NULL,"
    " agent_ref text NOT NULL, mode text NOT NULL, created_at timestamptz NOT NULL,"
    " ended_at timestamptz, turns integer NOT NULL DEFAULT 0)",
    "CREATE INDEX {sessions_idx} ON {sessions} (owner, created_at)",
    "CREATE TABLE {turns} (session_id text NOT NULL, idx integer NOT NULL,"
    " user_text text NOT NULL, replies text NOT NULL, trace text NOT NULL, invocation_id text,"
    " created_at timestamptz NOT NULL, context text, PRIMARY KEY (session_id, idx))",
    "CREATE TABLE {events} (id text PRIMARY KEY, owner text NOT NULL, type text NOT NULL,"
    " title text NOT NULL, status text NOT NULL, details text NOT NULL,"
    " created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,"
    " session_id text NOT NULL, touched bigint NOT NULL, op_id text UNIQUE)",
    "CREATE INDEX {events_idx} ON {events} (owner, touched)",
    "CREATE TABLE {history} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " event_id text NOT NULL, at timestamptz NOT NULL, session_id text NOT NULL,"
    " changes text NOT NULL, op_id text UNIQUE, actor text NOT NULL DEFAULT 'model')",
    "CREATE INDEX {history_idx} ON {history} (event_id, seq)",
    "CREATE TABLE {jobs} (id text PRIMARY KEY, session_id text NOT NULL, owner text NOT NULL,"
    " agent_ref text NOT NULL, transcript_ref text NOT NULL, status text NOT NULL,"
    " attempts integer NOT NULL, max_attempts integer NOT NULL,"
    " next_attempt_at timestamptz NOT NULL, created_at timestamptz NOT NULL,"
    " updated_at timestamptz NOT NULL, lease_owner text, lease_token text,"
    " lease_expires_at timestamptz, last_error text, ops text, result text)",
    "CREATE INDEX {jobs_idx} ON {jobs} (status, next_attempt_at)",
)  # and {meta}, which the shared schema check makes (``Schema.prepare``)
# Version 1 tables are brought to version 2 in place: the ``actor`` of each update
# history row ("model" for the old ones), the per-agent settings table, list indexes.
_MIGRATE_1_TO_2: tuple[LiteralString, ...] = (
    "ALTER TABLE {history} ADD COLUMN actor text NOT NULL DEFAULT 'model'",
)
_DDL_2: tuple[LiteralString, ...] = (
    "CREATE TABLE {configs} (agent_ref text PRIMARY KEY, config text NOT NULL,"
    " updated_at timestamptz NOT NULL)",
    "CREATE INDEX {sessions_created_idx} ON {sessions} (created_at)",
    "CREATE INDEX {jobs_updated_idx} ON {jobs} (updated_at)",
)
# Version 2 tables are brought to version 3 in place: each turn's ``context``, who saved
# the settings ("unknown" for the old ones) and the settings' history.
_MIGRATE_2_TO_3: tuple[LiteralString, ...] = ("ALTER TABLE {turns} ADD COLUMN context text",)
_DDL_3: tuple[LiteralString, ...] = (
    "ALTER TABLE {configs} ADD COLUMN saved_by text NOT NULL DEFAULT 'unknown'",
    "CREATE TABLE {changes} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " agent_ref text NOT NULL, before_config text, after_config text,"
    " at timestamptz NOT NULL, actor text NOT NULL)",
    "CREATE INDEX {changes_idx} ON {changes} (agent_ref, seq)",
)
# Version 3 tables get the indexes of retention (``purge_before``): old turns, turns that
# still hold a trace or a context, ended sessions, closed events.
_DDL_4: tuple[LiteralString, ...] = (
    "CREATE INDEX {turns_created_idx} ON {turns} (created_at)",
    "CREATE INDEX {turns_traced_idx} ON {turns} (created_at)"
    " WHERE trace <> '[]' OR context IS NOT NULL",
    "CREATE INDEX {sessions_ended_idx} ON {sessions} (ended_at)",
    "CREATE INDEX {events_closed_idx} ON {events} (updated_at) WHERE status = 'closed'",
)


class _Db:
    """The open transaction on one pooled connection (``Db``), over the shared helpers."""

    def __init__(self, conn: Conn, statements: dict[str, sql.Composed]) -> None:
        self._conn = conn
        self._sql = statements

    async def all(self, name: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await rows(self._conn, self._sql[name], params))

    async def one(self, name: str, params: Sequence[Any] = ()) -> Row | None:
        return await row(self._conn, self._sql[name], params)

    async def run(self, name: str, params: Sequence[Any] = ()) -> int:
        return await run(self._conn, self._sql[name], params)


class PostgresMemoryStore(PooledStore, SqlMemoryStore):
    """Chat memory in PostgreSQL (``touba.memory.MemoryStore``), shared by many workers.

    Give exactly one of ``dsn`` (the store opens and closes its own pool of 1
    to 4 connections) or ``pool`` (a ``psycopg_pool.AsyncConnectionPool`` you
    open and close). Tables are created on first use, or by ``await open()``;
    with ``create=False`` missing tables raise ``ConfigurationError`` there
    instead, and nothing is created.
    The pool, the schema check and the lifecycle are those of touba's other
    PostgreSQL stores (:class:`touba.history._pg.OwnedPool`). ``encryption`` (a
    :class:`touba.Encryption`): turns, key-event text and its update history, and
    extraction job ops and results are sealed at rest, bound to ``prefix`` (see
    :mod:`touba.memory._sealed`), a row that does not open raising
    ``DecisionHistoryRecordInvalid``; ``rekey()`` rotates keys.
    ``deadline_seconds`` (default 10) bounds each operation, waiting for a
    connection and every statement included: a network that goes silent fails it
    with ``MemoryStoreUnavailable`` (retryable) within that time.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        prefix: str = "touba_memory",
        clock: Clock = utc_now,
        create: bool = True,
        encryption: Encryption | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        *schema, name = table_parts(prefix, example="touba_memory", argument="prefix", longest=40)
        check_clock(clock)
        self._set_encryption(encryption, prefix)
        self.prefix = prefix
        self._clock = clock
        tables = {t: sql.Identifier(*schema, f"{name}_{s}") for t, s in _TABLE_NAMES.items()}
        indexes = {f"{t}_idx": sql.Identifier(f"{name}_{s}_idx") for t, s in _TABLE_NAMES.items()}
        indexes["sessions_created_idx"] = sql.Identifier(f"{name}_sessions_created_idx")
        indexes["jobs_updated_idx"] = sql.Identifier(f"{name}_jobs_updated_idx")
        for index in ("turns_created", "turns_traced", "sessions_ended", "events_closed"):
            indexes[f"{index}_idx"] = sql.Identifier(f"{name}_{index}_idx")
        names: dict[str, sql.Composable] = {**tables, **indexes}
        locks = {
            "for_update": sql.SQL(" FOR UPDATE"),
            "skip_locked": sql.SQL(" FOR UPDATE SKIP LOCKED"),
        }
        columns = {key: sql.SQL(value) for key, value in COLUMNS.items()}
        self._sql = {
            key: sql.SQL(text).format(**tables, **columns, **locks)
            for key, text in STATEMENTS.items()
        }

        def ddl(statements: Sequence[LiteralString]) -> list[sql.Composed]:
            return [sql.SQL(statement).format(**names) for statement in statements]

        self._pg = OwnedPool(
            "PostgresMemoryStore",
            dsn=dsn,
            pool=pool,
            schema=Schema(
                table=f"{prefix}_sessions",
                main=tables["sessions"],
                meta=tables["meta"],
                create=ddl((*_DDL, *_DDL_2, *_DDL_3, *_DDL_4)),
                version=SCHEMA_VERSION,
                what="chat memory",
                # The lock key of earlier releases, so that they and this one exclude
                # each other.
                lock=lock_key(f"touba.memory.postgres:{prefix}"),
                migrations={
                    1: ddl((*_MIGRATE_1_TO_2, *_DDL_2)),
                    2: ddl((*_MIGRATE_2_TO_3, *_DDL_3)),
                    3: ddl(_DDL_4),
                },
            ),
            unavailable=_unavailable,
            create=create,
            deadline=deadline_seconds,
        )
        self.deadline_seconds = self._pg.deadline

    # -- the backend's part --------------------------------------------------------------

    def _enc(self, moment: datetime) -> datetime:
        return moment

    def _dec(self, value: Any) -> datetime:
        assert isinstance(value, datetime)
        return value.astimezone(UTC)

    async def _atomic(self, body: Callable[[Db], Awaitable[R]], *, write: bool = True) -> R:
        async with self._pg.call() as conn:
            return await body(_Db(conn, self._sql))


def _unavailable(error: Exception) -> MemoryStoreUnavailable:
    # The one place driver failures during use become touba errors (chained by the pool).
    return MemoryStoreUnavailable(
        f"PostgreSQL failed ({type(error).__name__}: {error}); the operation was rolled back. "
        "Check the server and retry"
    )


# The tables by the name the statements use, and the suffix of each after the prefix.
_TABLE_NAMES = {
    **{t: t for t in ("sessions", "turns", "events", "history", "jobs", "configs", "meta")},
    "changes": "config_changes",
}
