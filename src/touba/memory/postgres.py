"""``PostgresMemoryStore``: chat turns, key events and extraction jobs in PostgreSQL.

Tables ``<prefix>_sessions``, ``_turns``, ``_events``, ``_history``, ``_jobs``,
``_configs`` (per-agent settings) and ``_meta`` (the schema version; version 1
tables are migrated to 2 in place), every name quoted with
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

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, LiteralString, Self, TypeVar

try:
    import psycopg
    from psycopg import AsyncConnection, IsolationLevel, sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import tuple_row
    from psycopg_pool import AsyncConnectionPool, PoolTimeout
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'touba.memory.postgres needs psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.memory._rows import COLUMNS, STATEMENTS, Row
from touba.memory._sql import Db, SqlMemoryStore
from touba.memory._store import Clock, check_clock, utc_now

__all__ = ["SCHEMA_VERSION", "PostgresMemoryStore"]

R = TypeVar("R")
SCHEMA_VERSION: Final = 2
_OPEN_TIMEOUT: Final = 10.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")
_Conn = AsyncConnection[Any]
_DDL: tuple[LiteralString, ...] = (
    "CREATE TABLE {sessions} (session_id text PRIMARY KEY, owner text NOT NULL,"
    " agent_ref text NOT NULL, mode text NOT NULL, created_at timestamptz NOT NULL,"
    " ended_at timestamptz, turns integer NOT NULL DEFAULT 0)",
    "CREATE INDEX {sessions_idx} ON {sessions} (owner, created_at)",
    "CREATE TABLE {turns} (session_id text NOT NULL, idx integer NOT NULL,"
    " user_text text NOT NULL, replies text NOT NULL, trace text NOT NULL, invocation_id text,"
    " created_at timestamptz NOT NULL, PRIMARY KEY (session_id, idx))",
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
    "CREATE TABLE {meta} (name text PRIMARY KEY, value text NOT NULL)",
)
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


def _prefix_parts(prefix: object) -> tuple[str, ...]:
    parts = prefix.split(".") if isinstance(prefix, str) else []
    if not 1 <= len(parts) <= 2 or not all(_NAME.fullmatch(p) for p in parts):
        raise ConfigurationError(
            "prefix must be a plain identifier such as 'touba_memory' or 'app.touba_memory' "
            f"(letters, digits, underscores; at most 40 characters each), got {prefix!r}"
        )
    return tuple(parts)


class _Db:
    """The open transaction on one pooled connection (``Db``)."""

    def __init__(self, conn: _Conn, statements: dict[str, sql.Composed]) -> None:
        self._conn = conn
        self._sql = statements

    async def all(self, name: str, params: Sequence[Any] = ()) -> list[Row]:
        async with self._conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(self._sql[name], params)
            return list(await cur.fetchall()) if cur.description else []

    async def one(self, name: str, params: Sequence[Any] = ()) -> Row | None:
        rows = await self.all(name, params)
        return rows[0] if rows else None

    async def run(self, name: str, params: Sequence[Any] = ()) -> int:
        async with self._conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(self._sql[name], params)
            return cur.rowcount


async def _configure(conn: _Conn) -> None:
    await conn.set_isolation_level(IsolationLevel.READ_COMMITTED)


class PostgresMemoryStore(SqlMemoryStore):
    """Chat memory in PostgreSQL (``touba.memory.MemoryStore``), shared by many workers.

    Give exactly one of ``dsn`` (the store opens and closes its own pool of 1
    to 4 connections) or ``pool`` (a ``psycopg_pool.AsyncConnectionPool`` you
    open and close). Tables are created on first use, or by ``await open()``.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        prefix: str = "touba_memory",
        clock: Clock = utc_now,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise ConfigurationError(
                "PostgresMemoryStore takes exactly one of dsn= (a connection string) or "
                "pool= (a psycopg_pool.AsyncConnectionPool)"
            )
        if dsn is not None:
            if not isinstance(dsn, str):
                raise ConfigurationError(f"dsn must be a str, got {type(dsn).__name__}")
            try:
                conninfo_to_dict(dsn)
            except psycopg.Error as e:
                raise ConfigurationError(f"dsn is not a PostgreSQL connection string: {e}") from e
        if pool is not None and not isinstance(pool, AsyncConnectionPool):
            raise ConfigurationError(
                f"pool must be a psycopg_pool.AsyncConnectionPool, got {type(pool).__name__}"
            )
        *schema, name = _prefix_parts(prefix)
        check_clock(clock)
        self.prefix = prefix
        self._clock = clock
        self._dsn = dsn
        self._pool = pool
        self._owns_pool = pool is None
        tables = {t: sql.Identifier(*schema, f"{name}_{t}") for t in _TABLE_NAMES}
        indexes = {f"{t}_idx": sql.Identifier(f"{name}_{t}_idx") for t in _TABLE_NAMES}
        indexes["sessions_created_idx"] = sql.Identifier(f"{name}_sessions_created_idx")
        indexes["jobs_updated_idx"] = sql.Identifier(f"{name}_jobs_updated_idx")
        self._names: dict[str, sql.Composable] = {**tables, **indexes}
        locks = {
            "for_update": sql.SQL(" FOR UPDATE"),
            "skip_locked": sql.SQL(" FOR UPDATE SKIP LOCKED"),
        }
        columns = {key: sql.SQL(value) for key, value in COLUMNS.items()}
        self._sql = {
            key: sql.SQL(text).format(**tables, **columns, **locks)
            for key, text in STATEMENTS.items()
        }
        digest = hashlib.sha256(f"touba.memory.postgres:{prefix}".encode()).digest()
        self._lock_key = int.from_bytes(digest[:8], "big", signed=True)
        self._open_lock = asyncio.Lock()
        self._users = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = False
        self._closed = False

    # -- the backend's part --------------------------------------------------------------

    def _enc(self, moment: datetime) -> datetime:
        return moment

    def _dec(self, value: Any) -> datetime:
        assert isinstance(value, datetime)
        return value.astimezone(UTC)

    async def _atomic(self, body: Callable[[Db], Awaitable[R]], *, write: bool = True) -> R:
        if self._closed:
            raise ConfigurationError("this PostgresMemoryStore is closed; create a new one")
        self._users += 1
        self._idle.clear()
        try:
            if not self._ready:
                await self.open()
            assert self._pool is not None
            async with self._pool.connection() as conn, conn.transaction():
                if conn.isolation_level != IsolationLevel.READ_COMMITTED:
                    await conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                return await body(_Db(conn, self._sql))
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as e:
            # The one place driver failures during use become touba errors.
            raise MemoryStoreUnavailable(
                f"PostgreSQL failed ({type(e).__name__}: {e}); the operation was rolled back. "
                "Check the server and retry"
            ) from e
        finally:
            self._users -= 1
            if not self._users:
                self._idle.set()

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and create (or check) the tables; idempotent, also done on first use."""
        async with self._open_lock:
            if self._closed:
                raise ConfigurationError("this PostgresMemoryStore is closed; create a new one")
            if self._ready:
                return
            try:
                pool = await self._open_pool()
                async with pool.connection() as conn, conn.transaction():
                    await self._prepare(conn)
            except BaseException as e:
                if self._owns_pool:
                    await self._drop_pool()
                if isinstance(e, psycopg.Error | PoolTimeout):
                    raise ConfigurationError(
                        f"PostgresMemoryStore could not open tables {self.prefix}_*: {e}. Check "
                        "that the server is reachable, the credentials and database are right, "
                        "and the role may create tables (or that they exist)"
                    ) from e
                raise
            self._ready = True

    async def _open_pool(self) -> AsyncConnectionPool[Any]:
        if self._pool is not None:
            if self._pool.closed:
                raise ConfigurationError(
                    "the pool given to PostgresMemoryStore is not open: `await pool.open()` first"
                )
            return self._pool
        assert self._dsn is not None
        options: dict[str, Any] = {}
        if "connect_timeout" not in conninfo_to_dict(self._dsn):
            options["connect_timeout"] = int(_OPEN_TIMEOUT)
        probe = await psycopg.AsyncConnection.connect(self._dsn, **options)  # fails fast
        await probe.close()
        self._pool = AsyncConnectionPool(
            self._dsn,
            open=False,
            min_size=1,
            max_size=4,
            configure=_configure,
            name=f"touba-memory-{self.prefix}",
        )
        await self._pool.open(wait=True, timeout=_OPEN_TIMEOUT)
        return self._pool

    async def _prepare(self, conn: _Conn) -> None:
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
        names = self._names
        cur = await conn.execute(
            "SELECT current_setting('server_encoding'), to_regclass(%s), to_regclass(%s)",
            (names["sessions"].as_string(conn), names["meta"].as_string(conn)),
        )
        found = await cur.fetchone()
        assert found is not None
        encoding, sessions, meta = found
        if encoding != "UTF8":
            raise ConfigurationError(
                f"the database uses {encoding}; PostgresMemoryStore needs UTF8"
            )
        if meta is None and sessions is not None:
            raise ConfigurationError(
                f"table {self.prefix}_sessions exists but is not touba's (no {self.prefix}_meta); "
                "nothing was modified. Choose another prefix"
            )
        if meta is None:
            for statement in (*_DDL, *_DDL_2):
                await conn.execute(sql.SQL(statement).format(**names))
            insert = sql.SQL("INSERT INTO {} (name, value) VALUES ('schema_version', %s)")
            await conn.execute(insert.format(names["meta"]), (str(SCHEMA_VERSION),))
            return
        query = sql.SQL("SELECT value FROM {} WHERE name = 'schema_version'").format(names["meta"])
        row = await (await conn.execute(query)).fetchone()
        if row is not None and row[0] == "1":
            for statement in (*_MIGRATE_1_TO_2, *_DDL_2):
                await conn.execute(sql.SQL(statement).format(**names))
            update = sql.SQL("UPDATE {} SET value = %s WHERE name = 'schema_version'")
            await conn.execute(update.format(names["meta"]), (str(SCHEMA_VERSION),))
            return
        if row is None or row[0] != str(SCHEMA_VERSION):
            raise ConfigurationError(
                f"tables {self.prefix}_* have chat memory schema version "
                f"{None if row is None else row[0]!r}; this touba reads versions 1 to "
                f"{SCHEMA_VERSION}. Upgrade touba or choose another prefix; nothing was modified"
            )

    async def _drop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def close(self) -> None:
        """Refuse new calls, let running ones finish, then close the pool if the store
        opened it (a pool given by you stays open). Idempotent."""
        self._closed = True
        await self._idle.wait()
        async with self._open_lock:
            self._ready = False
            if self._owns_pool:
                await self._drop_pool()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


_TABLE_NAMES = ("sessions", "turns", "events", "history", "jobs", "configs", "meta")
