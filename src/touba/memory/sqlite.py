"""``SqliteMemoryStore``: chat turns, key events and extraction jobs in a private SQLite file.

The file goes through :func:`touba.history._files.open_private_sqlite`: the
database and its ``-wal``, ``-shm`` and ``-journal`` files are created or
reset to 0600 before SQLite opens them; symbolic links, foreign files and
group- or other-writable directories are refused
(``DecisionHistoryStorageUnsafe``). It may be the same file as a
``SqliteHistoryStore``'s: the tables are ``touba_memory_*``
(``touba_memory_configs`` holds the per-agent settings the memory panel
saves, ``touba_memory_config_changes`` their history) and the schema version
sits in the shared ``touba_meta`` table under its own name; a version-1 or
version-2 file is migrated to version 3 in place when opened.

One thread owns the connection and runs an event loop of its own: each
operation (one transaction, :mod:`touba.memory._sql`) is submitted to it
whole and awaits nothing but the connection there, so operations never
interleave. Writes are ``BEGIN IMMEDIATE`` transactions; several processes
may share the file (WAL). Timestamps are stored as integer microseconds
since the epoch, read back as aware UTC datetimes.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.history._files import open_private_sqlite
from touba.history._sqlite import describe, failure_kind, finish_leftover, rollback_quietly
from touba.history._sqlite_kinds import require_sqlite_store
from touba.memory._rows import COLUMNS, STATEMENTS, Row
from touba.memory._sql import Db, SqlMemoryStore
from touba.memory._store import Clock, check_clock, utc_now

__all__ = ["SCHEMA_VERSION", "SqliteMemoryStore"]

R = TypeVar("R")
SCHEMA_VERSION: Final = 3
# Versions this touba opens, older ones migrated in place: 2 added the ``actor`` of each
# update history row ("model" for the old ones) and the per-agent settings table; 3 each
# turn's ``context``, who saved the settings ("unknown" for the old ones) and their
# history. New tables and indexes come from ``_SCHEMA``; ``_ADDED`` are the columns.
_READABLE = ("1", "2", str(SCHEMA_VERSION))
BUSY_TIMEOUT_SECONDS: Final = 5.0
_VERSION_NAME = "memory_schema_version"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TABLES = {
    name: f"touba_memory_{name}"
    for name in ("sessions", "turns", "events", "history", "jobs", "configs")
} | {"changes": "touba_memory_config_changes"}
# The text filter, one Python call per column instead of three (lower, lower, strpos):
# a search across every owner's events reads them all, and each call costs. Same
# parameters, same answers (``lower(part) in lower(text)``).
_SHARED_SEARCH = "strpos(lower(title), lower(%s)) > 0 OR strpos(lower(details), lower(%s)) > 0"
_SEARCH = "touba_found(title, %s) OR touba_found(details, %s)"
assert _SHARED_SEARCH in COLUMNS["event_filters"]
_FILTERS = {"event_filters": COLUMNS["event_filters"].replace(_SHARED_SEARCH, _SEARCH)}
_SQL = {
    name: text.format(**_TABLES, **COLUMNS | _FILTERS, for_update="", skip_locked="").replace(
        "%s", "?"
    )
    for name, text in STATEMENTS.items()
}
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS touba_memory_sessions (session_id TEXT PRIMARY KEY,
        owner TEXT NOT NULL, agent_ref TEXT NOT NULL, mode TEXT NOT NULL,
        created_at INTEGER NOT NULL, ended_at INTEGER, turns INTEGER NOT NULL DEFAULT 0)""",
    "CREATE INDEX IF NOT EXISTS touba_memory_sessions_owner "
    "ON touba_memory_sessions (owner, created_at)",
    "CREATE INDEX IF NOT EXISTS touba_memory_sessions_created "
    "ON touba_memory_sessions (created_at)",
    """CREATE TABLE IF NOT EXISTS touba_memory_turns (session_id TEXT NOT NULL,
        idx INTEGER NOT NULL, user_text TEXT NOT NULL, replies TEXT NOT NULL,
        trace TEXT NOT NULL, invocation_id TEXT, created_at INTEGER NOT NULL, context TEXT,
        PRIMARY KEY (session_id, idx))""",
    """CREATE TABLE IF NOT EXISTS touba_memory_events (id TEXT PRIMARY KEY,
        owner TEXT NOT NULL, type TEXT NOT NULL, title TEXT NOT NULL, status TEXT NOT NULL,
        details TEXT NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
        session_id TEXT NOT NULL, touched INTEGER NOT NULL, op_id TEXT UNIQUE)""",
    "CREATE INDEX IF NOT EXISTS touba_memory_events_owner ON touba_memory_events (owner, touched)",
    """CREATE TABLE IF NOT EXISTS touba_memory_history (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL, at INTEGER NOT NULL,
        session_id TEXT NOT NULL, changes TEXT NOT NULL, op_id TEXT UNIQUE,
        actor TEXT NOT NULL DEFAULT 'model')""",
    "CREATE INDEX IF NOT EXISTS touba_memory_history_event ON touba_memory_history (event_id, seq)",
    """CREATE TABLE IF NOT EXISTS touba_memory_jobs (id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL, owner TEXT NOT NULL, agent_ref TEXT NOT NULL,
        transcript_ref TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL,
        max_attempts INTEGER NOT NULL, next_attempt_at INTEGER NOT NULL,
        created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, lease_owner TEXT,
        lease_token TEXT, lease_expires_at INTEGER, last_error TEXT, ops TEXT, result TEXT)""",
    "CREATE INDEX IF NOT EXISTS touba_memory_jobs_due "
    "ON touba_memory_jobs (status, next_attempt_at)",
    "CREATE INDEX IF NOT EXISTS touba_memory_jobs_updated ON touba_memory_jobs (updated_at)",
    """CREATE TABLE IF NOT EXISTS touba_memory_configs (agent_ref TEXT PRIMARY KEY,
        config TEXT NOT NULL, updated_at INTEGER NOT NULL,
        saved_by TEXT NOT NULL DEFAULT 'unknown')""",
    """CREATE TABLE IF NOT EXISTS touba_memory_config_changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, agent_ref TEXT NOT NULL,
        before_config TEXT, after_config TEXT, at INTEGER NOT NULL, actor TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS touba_memory_config_changes_agent "
    "ON touba_memory_config_changes (agent_ref, seq)",
)
# The columns each version added to tables an older file already has: (table, column,
# definition), added when missing (a table ``_SCHEMA`` just made has them all).
_ADDED: dict[int, tuple[tuple[str, str, str], ...]] = {
    2: (("touba_memory_history", "actor", "TEXT NOT NULL DEFAULT 'model'"),),
    3: (
        ("touba_memory_turns", "context", "TEXT"),
        ("touba_memory_configs", "saved_by", "TEXT NOT NULL DEFAULT 'unknown'"),
    ),
}


def _check_schema(conn: sqlite3.Connection) -> None:
    """Refuse a file whose memory tables another touba version wrote, reading only."""
    sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'touba_meta'"
    if not conn.execute(sql).fetchone():
        return
    row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (_VERSION_NAME,)).fetchone()
    if row is not None and row[0] not in _READABLE:
        raise ConfigurationError(
            f"this SQLite file holds chat memory schema version {row[0]!r}; this touba reads "
            f"versions 1 to {SCHEMA_VERSION}. Upgrade touba or use another file; it was not "
            "modified"
        )


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring an older file to the current version, inside the opening transaction."""
    row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (_VERSION_NAME,)).fetchone()
    if row is None or row[0] == str(SCHEMA_VERSION):
        return
    for version in range(int(row[0]) + 1, SCHEMA_VERSION + 1):
        for table, column, definition in _ADDED[version]:
            columns = {info[1] for info in conn.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    conn.execute(
        "UPDATE touba_meta SET value = ? WHERE name = ?", (str(SCHEMA_VERSION), _VERSION_NAME)
    )


def _translate(error: Exception) -> Exception:
    """The typed error for a ``sqlite3`` or OS error: the one place they are converted."""
    kind = failure_kind(error)
    if kind is None:
        return error
    if kind == "misuse":
        return ConfigurationError(f"the SQLite memory store's connection cannot be used ({error})")
    cause = {
        "locked": f"the file stayed locked by another connection for over "
        f"{BUSY_TIMEOUT_SECONDS:g}s",
        "not_a_database": "the file is not a database",
        "corrupt": "a page read back damaged (a failing disk, or real damage: then restore "
        "a backup)",
        "io": "the disk may be full, failing or read-only",
    }[kind]
    return MemoryStoreUnavailable(
        f"the SQLite memory store failed ({describe(error)}): {cause}. Nothing was written "
        "and the previous state is kept; retry once that is fixed"
    )


def _lower(value: str | None) -> str | None:
    return value.lower() if isinstance(value, str) else value


def _found(text: str | None, part: str | None) -> bool | None:
    """``strpos(lower(text), lower(part)) > 0`` in one call."""
    if not isinstance(text, str) or not isinstance(part, str):
        return None
    return part.lower() in text.lower()


def _strpos(text: str | None, part: str | None) -> int | None:
    if not isinstance(text, str) or not isinstance(part, str):
        return None
    return text.find(part) + 1


def _open(filename: str | os.PathLike[str], create: bool) -> sqlite3.Connection:
    conn = None
    try:
        if not create:
            require_sqlite_store(filename, "memory", "SqliteMemoryStore", "chat memory")
        conn = open_private_sqlite(filename, timeout=BUSY_TIMEOUT_SECONDS, check=_check_schema)
        # Unicode-aware, like PostgreSQL's (SQLite's own lower() folds ASCII only).
        conn.create_function("lower", 1, _lower, deterministic=True)
        conn.create_function("strpos", 2, _strpos, deterministic=True)
        conn.create_function("touba_found", 2, _found, deterministic=True)
        conn.execute("BEGIN IMMEDIATE")
        _check_schema(conn)
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.execute(
            "INSERT OR IGNORE INTO touba_meta (name, value) VALUES (?, ?)",
            (_VERSION_NAME, str(SCHEMA_VERSION)),
        )
        _migrate(conn)
        conn.execute("COMMIT")
    except Exception as e:
        if conn is not None:
            conn.close()
        translated = _translate(e)
        if translated is e:
            raise
        raise translated from e
    return conn


class _Db:
    """The open transaction, on the store's thread (``Db``)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def one(self, name: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self._conn.execute(_SQL[name], params).fetchall()
        return rows[0] if rows else None

    async def all(self, name: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._conn.execute(_SQL[name], params).fetchall()

    async def run(self, name: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(_SQL[name], params).rowcount


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # its caller may be gone (cancelled): do not report it as lost


class SqliteMemoryStore(SqlMemoryStore, AsyncClosing):
    """Chat memory in a private SQLite file (``touba.memory.MemoryStore``).

    ``filename``: a path in a private directory you created (mode 0700); the
    file is opened at construction. ``clock`` (returning aware datetimes)
    stamps every write and decides lease expiry and retry times. Close it with
    ``await store.close()`` or ``async with``. ``create=False`` opens an existing
    store only: a missing file, or one holding no touba chat memory, raises
    ``ConfigurationError`` and nothing is created or changed.
    """

    def __init__(
        self, filename: str | os.PathLike[str], *, clock: Clock = utc_now, create: bool = True
    ) -> None:
        if not isinstance(filename, str | os.PathLike):
            raise ConfigurationError(f"filename must be a path, got {type(filename).__name__}")
        check_clock(clock)
        self._clock = clock
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._in_body = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="touba-memory-sqlite", daemon=True
        )
        self._thread.start()
        try:
            self._conn = self._submit(self._call(lambda: _open(filename, create))).result()
        except BaseException:
            self._stop_thread()
            raise
        self._db = _Db(self._conn)

    # -- the backend's part --------------------------------------------------------------

    def _enc(self, moment: datetime) -> int:
        return (moment - _EPOCH) // timedelta(microseconds=1)

    def _dec(self, value: Any) -> datetime:
        return _EPOCH + timedelta(microseconds=value)

    def _submit(self, coro: Coroutine[Any, Any, R]) -> Future[R]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @staticmethod
    async def _call(job: Callable[[], R]) -> R:
        return job()

    async def _atomic(self, body: Callable[[Db], Awaitable[R]], *, write: bool = True) -> R:
        with self._lock:
            if self._closed:
                raise ConfigurationError("this SqliteMemoryStore is closed; create a new one")
            self._users += 1
        try:
            future = asyncio.wrap_future(self._submit(self._transaction(body, write)))
            future.add_done_callback(_retrieve)
            # Once started, the transaction finishes (commits or rolls back) even if we
            # are cancelled.
            return await asyncio.shield(future)
        finally:
            with self._lock:
                self._users -= 1

    async def _transaction(self, body: Callable[[Db], Awaitable[R]], write: bool) -> R:
        """One transaction, on the store's thread; ``body`` awaits only the connection.

        Like :func:`touba.history._sqlite.transaction`, for an async body: a failed
        commit is rolled back, and a rollback that failed is finished first.
        """
        conn = self._conn
        if self._in_body:  # a body suspended elsewhere: operations would interleave
            raise RuntimeError("a SqliteMemoryStore transaction awaited something else")
        self._in_body = True
        try:
            finish_leftover(conn)
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = await body(self._db)
                conn.execute("COMMIT")
            except BaseException:
                rollback_quietly(conn)
                raise
            return result
        except Exception as e:
            translated = _translate(e)
            if translated is e:
                raise
            raise translated from e
        finally:
            self._in_body = False

    async def _erase_atomic(self, body: Callable[[Db], Awaitable[R]]) -> R:
        """The erase transaction with ``PRAGMA secure_delete`` on (the deleted rows' bytes
        are overwritten with zeros, not left in free pages), then a WAL checkpoint
        (``TRUNCATE``) so the WAL file keeps no copy either, when no reader holds it."""
        conn = self._conn

        async def secured(db: Db) -> R:
            before = conn.execute("PRAGMA secure_delete").fetchone()[0]
            conn.execute("PRAGMA secure_delete=ON")
            try:
                return await body(db)
            finally:
                conn.execute(f"PRAGMA secure_delete={int(before)}")

        result = await self._atomic(secured)

        with self._lock:
            if self._closed:
                return result
            self._users += 1
        try:
            job = self._call(lambda: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
            await asyncio.wrap_future(self._submit(job))
        except sqlite3.Error:
            pass  # a reader holds the WAL: the next checkpoint overwrites it
        finally:
            with self._lock:
                self._users -= 1
        return result

    # -- lifecycle -----------------------------------------------------------------------

    def _stop_thread(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def close(self) -> None:
        """Let running operations finish, then close the file (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while self._users:  # noqa: ASYNC110 - a poll: callers may run on other event loops
            await asyncio.sleep(0.01)
        await asyncio.wrap_future(self._submit(self._call(self._conn.close)))
        self._stop_thread()
