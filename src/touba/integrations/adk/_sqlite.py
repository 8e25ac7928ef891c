"""The SQLite backend of ToubaSessionService: touba's private file, WAL, an owned thread.

- **The file.** Opened with :func:`touba.history._files.open_private_sqlite`
  (0600 files in a directory only its owner may enter, symbolic links
  refused, WAL, ``synchronous=FULL``), on first use, by the thread that owns
  the connection (:class:`touba.history._sqlite.OwnedThread`). The file
  may be shared with touba's other SQLite stores: the tables are ``adk_*`` and
  the schema version is a row of ``touba_meta``.
- **Tables.** ``adk_sessions`` (one row per session: its state as a JSON
  object, times, revision, counts, expiry, hold; ``sid`` an integer key),
  ``adk_events`` (``WITHOUT ROWID``, primary key ``(sid, timestamp,
  event_id)``: the log in read order, so the newest k and those after a
  timestamp are one range read of that key; a unique ``(sid, event_id)``
  index finds a duplicate id), ``adk_app_states``, ``adk_user_states``.
  ``adk_sessions`` has ``(app_name, update_time, user_id, session_id)`` for
  ``list_sessions`` and a partial index on ``expires_at`` for the purge.
- **Atomicity.** Every write is one ``BEGIN IMMEDIATE`` transaction, so its
  checks and its writes see one state, across processes too: of two
  appends from one revision, the second to take the lock sees the first's
  revision. A read is one deferred transaction (one snapshot).
- **Cost.** An append reads the session row, probes the event-id index,
  inserts one event row and rewrites the session row (its state object,
  O(state)); the app/user state rows only when their delta is not empty. A
  create counts the live sessions (O(sessions)) only when ``max_sessions``
  is set.
- **Failures.** ``sqlite3`` and OS errors become
  ``DecisionHistoryStoreUnavailable`` in one place (chained); the failed
  transaction is rolled back, the previous state kept. ``kill -9`` during an
  append leaves the event whole or absent (SQLite's WAL).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._files import open_private_sqlite
from touba.history._sqlite import OwnedThread, describe, failure_kind, transaction
from touba.integrations.adk._backend import (
    AdkLimits,
    AppendRequest,
    AppendResult,
    JsonValue,
    SessionKey,
    SessionList,
    SessionRead,
    SessionRecord,
    StoredEvent,
)
from touba.integrations.adk._checks import (
    already_exists,
    check_event_bytes,
    check_hold,
    check_hold_for,
    check_session_bytes,
    check_sessions,
    check_stale,
    expires_at,
    hold_after,
    is_held,
    not_found,
)

__all__ = ["SqliteAdkBackend"]

R = TypeVar("R")

SCHEMA_NAME = "adk_sessions"  # its row in touba_meta
SCHEMA_VERSION = 1

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS adk_sessions (
        sid INTEGER PRIMARY KEY,
        app_name TEXT NOT NULL,
        user_id TEXT NOT NULL,
        session_id TEXT NOT NULL,
        state TEXT NOT NULL,
        create_time REAL NOT NULL,
        update_time REAL NOT NULL,
        revision INTEGER NOT NULL,
        event_count INTEGER NOT NULL,
        byte_count INTEGER NOT NULL,
        expires_at REAL,
        holder TEXT,
        hold_until REAL,
        UNIQUE (app_name, user_id, session_id)
    )""",
    "CREATE INDEX IF NOT EXISTS adk_sessions_by_update"
    " ON adk_sessions (app_name, update_time, user_id, session_id)",
    "CREATE INDEX IF NOT EXISTS adk_sessions_by_expiry"
    " ON adk_sessions (expires_at) WHERE expires_at IS NOT NULL",
    """CREATE TABLE IF NOT EXISTS adk_events (
        sid INTEGER NOT NULL,
        timestamp REAL NOT NULL,
        event_id TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (sid, timestamp, event_id)
    ) WITHOUT ROWID""",
    "CREATE UNIQUE INDEX IF NOT EXISTS adk_events_by_id ON adk_events (sid, event_id)",
    """CREATE TABLE IF NOT EXISTS adk_app_states (
        app_name TEXT PRIMARY KEY,
        state TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS adk_user_states (
        app_name TEXT NOT NULL,
        user_id TEXT NOT NULL,
        state TEXT NOT NULL,
        PRIMARY KEY (app_name, user_id)
    )""",
)

_SELECT_SESSIONS = (
    "SELECT sid, app_name, user_id, session_id, state, create_time, update_time, revision,"
    " event_count, byte_count, expires_at, holder, hold_until FROM adk_sessions"
)
_LIVE = "(expires_at IS NULL OR expires_at > ?)"
_SESSION = _SELECT_SESSIONS + " WHERE app_name = ? AND user_id = ? AND session_id = ?"
_LIVE_SESSION = _SESSION + " AND " + _LIVE
# list_sessions reads plain tuples of these columns, in this order (see _listed)
_SELECT_LISTED = (
    "SELECT user_id, session_id, state, create_time, update_time, revision, event_count,"
    " byte_count, expires_at, holder, hold_until FROM adk_sessions"
)
_LIST_APP = _SELECT_LISTED + (
    " WHERE app_name = ? AND " + _LIVE + " ORDER BY update_time, user_id, session_id"
)
_LIST_USER = _SELECT_LISTED + (
    " WHERE app_name = ? AND user_id = ? AND "
    + _LIVE
    + " ORDER BY update_time, user_id, session_id"
)
_COUNT_LIVE = "SELECT count(*) FROM adk_sessions WHERE expires_at IS NULL OR expires_at > ?"
_PURGE_EVENTS = (
    "DELETE FROM adk_events WHERE sid IN"
    " (SELECT sid FROM adk_sessions WHERE expires_at IS NOT NULL AND expires_at <= ?)"
)
_PURGE_SESSIONS = "DELETE FROM adk_sessions WHERE expires_at IS NOT NULL AND expires_at <= ?"


@dataclass(frozen=True, slots=True)
class _Scope:
    """The statements of one shared state table (app or user)."""

    what: str
    select: str
    insert: str
    update: str


_APP = _Scope(
    "app state",
    "SELECT state FROM adk_app_states WHERE app_name = ?",
    "INSERT INTO adk_app_states (app_name, state) VALUES (?, ?)",
    "UPDATE adk_app_states SET state = ? WHERE app_name = ?",
)
_USER = _Scope(
    "user state",
    "SELECT state FROM adk_user_states WHERE app_name = ? AND user_id = ?",
    "INSERT INTO adk_user_states (app_name, user_id, state) VALUES (?, ?, ?)",
    "UPDATE adk_user_states SET state = ? WHERE app_name = ? AND user_id = ?",
)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _loads(text: str, what: str) -> dict[str, JsonValue]:
    if text == "{}":  # most sessions' own state: no parse
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise DecisionHistoryRecordInvalid(
            f"the stored {what} is not JSON; the file was damaged or written by something else"
        ) from e
    if not isinstance(value, dict):
        raise DecisionHistoryRecordInvalid(f"the stored {what} is not a JSON object")
    return value


def _record(row: sqlite3.Row, now: float) -> SessionRecord:
    live = is_held(row["holder"], row["hold_until"], now)
    return SessionRecord(
        key=SessionKey(row["app_name"], row["user_id"], row["session_id"]),
        state=_loads(row["state"], "session state"),
        create_time=row["create_time"],
        update_time=row["update_time"],
        revision=row["revision"],
        event_count=row["event_count"],
        byte_count=row["byte_count"],
        expires_at=row["expires_at"],
        holder=row["holder"] if live else None,
    )


def _listed(app_name: str, row: tuple[Any, ...], now: float) -> SessionRecord:
    """A record from a plain tuple of ``_SELECT_LISTED`` (no name lookups: 5,000 rows a list)."""
    user_id, session_id, state, create, update, revision, events, size, expiry, holder, until = row
    return SessionRecord(
        key=SessionKey(app_name, user_id, session_id),
        state=_loads(state, "session state"),
        create_time=create,
        update_time=update,
        revision=revision,
        event_count=events,
        byte_count=size,
        expires_at=expiry,
        holder=holder if is_held(holder, until, now) else None,
    )


def _check_version(conn: sqlite3.Connection) -> None:
    """Refuse a file holding another version of this schema, without touching it."""
    sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'touba_meta'"
    if not conn.execute(sql).fetchone():
        return
    row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (SCHEMA_NAME,)).fetchone()
    if row is not None and row[0] != str(SCHEMA_VERSION):
        raise ConfigurationError(
            f"this SQLite file holds ADK session schema version {row[0]!r}; this touba reads "
            f"version {SCHEMA_VERSION}. Upgrade touba or use another file; it was not modified"
        )


def _translate(error: Exception, timeout: float) -> Exception:
    """The typed error for a ``sqlite3`` or OS error: the one place they are converted."""
    kind = failure_kind(error)
    if kind is None:
        return error
    if kind == "misuse":
        return ConfigurationError(f"the ADK session store's connection cannot be used ({error})")
    cause = {
        "locked": f"the file stayed locked by another connection for over {timeout:g}s",
        "not_a_database": "the file is not a database",
        "corrupt": "a page read back damaged (a failing disk, or real damage: then restore "
        "a backup)",
        "io": "the disk may be full, failing or read-only",
    }[kind]
    return DecisionHistoryStoreUnavailable(
        f"the SQLite ADK session store failed ({describe(error)}): {cause}. Nothing was "
        "written and the previous state is kept; retry once that is fixed"
    )


class _Db:
    """The SQL, run on the owning thread only."""

    def __init__(self, conn: sqlite3.Connection, limits: AdkLimits) -> None:
        conn.row_factory = sqlite3.Row
        with transaction(conn):
            _check_version(conn)
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(
                "INSERT OR IGNORE INTO touba_meta (name, value) VALUES (?, ?)",
                (SCHEMA_NAME, str(SCHEMA_VERSION)),
            )
        self.conn = conn
        self.limits = limits

    # --- helpers (inside a transaction) ---

    def _session(self, key: SessionKey, now: float | None) -> sqlite3.Row | None:
        params: tuple[Any, ...] = (key.app_name, key.user_id, key.session_id)
        if now is None:
            row: sqlite3.Row | None = self.conn.execute(_SESSION, params).fetchone()
        else:
            row = self.conn.execute(_LIVE_SESSION, (*params, now)).fetchone()
        return row

    def _state(self, sql: str, params: tuple[Any, ...], what: str) -> dict[str, JsonValue]:
        row = self.conn.execute(sql, params).fetchone()
        return {} if row is None else _loads(row[0], what)

    def _app_state(self, app_name: str) -> dict[str, JsonValue]:
        return self._state(_APP.select, (app_name,), _APP.what)

    def _user_state(self, app_name: str, user_id: str) -> dict[str, JsonValue]:
        return self._state(_USER.select, (app_name, user_id), _USER.what)

    def _apply(self, scope: _Scope, where: tuple[str, ...], delta: Mapping[str, JsonValue]) -> None:
        if not delta:
            return
        row = self.conn.execute(scope.select, where).fetchone()
        if row is None:
            self.conn.execute(scope.insert, (*where, _dumps(dict(delta))))
            return
        state = _loads(row[0], scope.what)
        state.update(delta)
        self.conn.execute(scope.update, (_dumps(state), *where))

    def _purge(self, now: float) -> int:
        self.conn.execute(_PURGE_EVENTS, (now,))
        return self.conn.execute(_PURGE_SESSIONS, (now,)).rowcount

    def _delete(self, sid: int) -> None:
        self.conn.execute("DELETE FROM adk_events WHERE sid = ?", (sid,))
        self.conn.execute("DELETE FROM adk_sessions WHERE sid = ?", (sid,))

    # --- the operations ---

    def create(
        self,
        key: SessionKey,
        state: str,
        app_delta: Mapping[str, JsonValue],
        user_delta: Mapping[str, JsonValue],
        create_time: float,
        now: float,
    ) -> SessionRead:
        with transaction(self.conn):
            existing = self._session(key, None)
            if existing is not None:
                if existing["expires_at"] is None or existing["expires_at"] > now:
                    raise already_exists(key)
                self._delete(existing["sid"])
            if self.limits.max_sessions is not None:
                live = self.conn.execute(_COUNT_LIVE, (now,)).fetchone()[0]
                check_sessions(self.limits, live)
                self._purge(now)
            self.conn.execute(
                "INSERT INTO adk_sessions (app_name, user_id, session_id, state, create_time,"
                " update_time, revision, event_count, byte_count, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, 0, 0, 0, ?)",
                (
                    key.app_name,
                    key.user_id,
                    key.session_id,
                    state,
                    create_time,
                    create_time,
                    expires_at(self.limits, now),
                ),
            )
            self._apply(_APP, (key.app_name,), app_delta)
            self._apply(_USER, (key.app_name, key.user_id), user_delta)
            row = self._session(key, None)
            assert row is not None
            return SessionRead(
                session=_record(row, now),
                app_state=self._app_state(key.app_name),
                user_state=self._user_state(key.app_name, key.user_id),
            )

    def read(
        self, key: SessionKey, recent: int | None, after: float | None, now: float
    ) -> SessionRead | None:
        with transaction(self.conn, "BEGIN"):
            row = self._session(key, now)
            if row is None:
                return None
            events: list[StoredEvent] = []
            if recent != 0:
                sql = "SELECT timestamp, event_id, data FROM adk_events WHERE sid = ?"
                params: tuple[Any, ...] = (row["sid"],)
                if after is not None:
                    sql += " AND timestamp >= ?"
                    params += (after,)
                if recent is None:
                    sql += " ORDER BY timestamp, event_id"
                    rows = self.conn.execute(sql, params).fetchall()
                else:
                    sql += " ORDER BY timestamp DESC, event_id DESC LIMIT ?"
                    rows = self.conn.execute(sql, (*params, recent)).fetchall()
                    rows.reverse()
                events = [StoredEvent(r[1], r[0], r[2]) for r in rows]
            return SessionRead(
                session=_record(row, now),
                app_state=self._app_state(key.app_name),
                user_state=self._user_state(key.app_name, key.user_id),
                events=events,
            )

    def list_sessions(self, app_name: str, user_id: str | None, now: float) -> SessionList:
        with transaction(self.conn, "BEGIN"):
            cursor = self.conn.cursor()
            cursor.row_factory = None  # plain tuples
            if user_id is None:
                rows = cursor.execute(_LIST_APP, (app_name, now)).fetchall()
            else:
                rows = cursor.execute(_LIST_USER, (app_name, user_id, now)).fetchall()
            users: dict[str, Mapping[str, JsonValue]] = {}
            if user_id is not None:
                if rows:
                    users[user_id] = self._user_state(app_name, user_id)
            elif rows:
                wanted = {r[0] for r in rows}
                for u, text in self.conn.execute(
                    "SELECT user_id, state FROM adk_user_states WHERE app_name = ?", (app_name,)
                ):
                    if u in wanted:
                        users[u] = _loads(text, "user state")
            return SessionList(
                app_state=self._app_state(app_name),
                user_states=users,
                sessions=[_listed(app_name, r, now) for r in rows],
            )

    def read_user_state(self, app_name: str, user_id: str) -> dict[str, JsonValue]:
        return self._user_state(app_name, user_id)

    def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        ev = request.event
        with transaction(self.conn):
            row = self._session(key, request.now)
            if row is None:
                raise not_found(key)
            sid = row["sid"]
            if self.conn.execute(
                "SELECT 1 FROM adk_events WHERE sid = ? AND event_id = ?", (sid, ev.event_id)
            ).fetchone():
                return AppendResult(
                    False,
                    row["revision"],
                    row["update_time"],
                    row["event_count"],
                    row["byte_count"],
                )
            check_hold(key, row["holder"], row["hold_until"], request)
            check_stale(row["revision"], row["update_time"], request)
            size = len(ev.data.encode())
            check_event_bytes(self.limits, size)
            check_session_bytes(self.limits, row["byte_count"], size)
            self.conn.execute(
                "INSERT INTO adk_events (sid, timestamp, event_id, data) VALUES (?, ?, ?, ?)",
                (sid, ev.timestamp, ev.event_id, ev.data),
            )
            self._apply(_APP, (key.app_name,), request.app_delta)
            self._apply(_USER, (key.app_name, key.user_id), request.user_delta)
            state_text = row["state"]
            if request.session_delta:
                state = _loads(state_text, "session state")
                state.update(request.session_delta)
                state_text = _dumps(state)
            holder, until = hold_after(self.limits, row["holder"], row["hold_until"], request)
            result = AppendResult(
                True,
                row["revision"] + 1,
                request.update_time,
                row["event_count"] + 1,
                row["byte_count"] + size,
            )
            self.conn.execute(
                "UPDATE adk_sessions SET state = ?, update_time = ?, revision = ?,"
                " event_count = ?, byte_count = ?, expires_at = ?, holder = ?, hold_until = ?"
                " WHERE sid = ?",
                (
                    state_text,
                    result.update_time,
                    result.revision,
                    result.event_count,
                    result.byte_count,
                    expires_at(self.limits, request.now),
                    holder,
                    until,
                    sid,
                ),
            )
            return result

    def delete(self, key: SessionKey) -> None:
        with transaction(self.conn):
            row = self._session(key, None)
            if row is not None:
                self._delete(row["sid"])

    def hold(self, key: SessionKey, owner: str, now: float) -> None:
        with transaction(self.conn):
            row = self._session(key, now)
            if row is None:
                raise not_found(key)
            check_hold_for(key, row["holder"], row["hold_until"], owner, now)
            self.conn.execute(
                "UPDATE adk_sessions SET holder = ?, hold_until = ? WHERE sid = ?",
                (owner, now + self.limits.hold_seconds, row["sid"]),
            )

    def release(self, key: SessionKey, owner: str) -> bool:
        with transaction(self.conn):
            changed = self.conn.execute(
                "UPDATE adk_sessions SET holder = NULL, hold_until = NULL"
                " WHERE app_name = ? AND user_id = ? AND session_id = ? AND holder = ?",
                (key.app_name, key.user_id, key.session_id, owner),
            ).rowcount
            return bool(changed)

    def recover(self, key: SessionKey) -> bool:
        with transaction(self.conn):
            changed = self.conn.execute(
                "UPDATE adk_sessions SET holder = NULL, hold_until = NULL"
                " WHERE app_name = ? AND user_id = ? AND session_id = ? AND holder IS NOT NULL",
                (key.app_name, key.user_id, key.session_id),
            ).rowcount
            return bool(changed)

    def purge_expired(self, now: float) -> int:
        with transaction(self.conn):
            return self._purge(now)


class SqliteAdkBackend:
    """ADK sessions in a private SQLite file (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: AdkLimits | None = None,
        *,
        timeout: float = 5.0,
    ) -> None:
        self._path = os.fspath(path)
        self._limits = limits if limits is not None else AdkLimits()
        self._timeout = timeout
        self._thread: OwnedThread | None = None
        self._db: _Db | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    def _open(self) -> _Db:
        conn = open_private_sqlite(self._path, timeout=self._timeout, check=_check_version)
        try:
            return _Db(conn, self._limits)
        except BaseException:
            conn.close()
            raise

    async def _run(self, job: Callable[[_Db], R]) -> R:
        """Run ``job`` on the owned thread (opening the file first, once); sqlite3 and OS
        errors become typed ones. Once handed over, a job runs to its end."""
        if self._closed:
            raise ConfigurationError("this ADK session backend is closed; create a new one")
        try:
            if self._db is None:
                async with self._lock:
                    if self._db is None:
                        thread = self._thread or OwnedThread("touba-adk-sqlite")
                        self._thread = thread
                        self._db = await thread.run(self._open)
            assert self._thread is not None
            db = self._db
            return await self._thread.run(lambda: job(db))
        except Exception as e:
            translated = _translate(e, self._timeout)
            if translated is e:
                raise
            raise translated from e

    async def create(
        self,
        key: SessionKey,
        *,
        state: Mapping[str, JsonValue],
        app_delta: Mapping[str, JsonValue],
        user_delta: Mapping[str, JsonValue],
        create_time: float,
        now: float,
    ) -> SessionRead:
        """See :meth:`AdkBackend.create`."""
        text = _dumps(dict(state))
        return await self._run(
            lambda db: db.create(key, text, app_delta, user_delta, create_time, now)
        )

    async def read(
        self, key: SessionKey, *, recent: int | None, after: float | None, now: float
    ) -> SessionRead | None:
        """See :meth:`AdkBackend.read`."""
        return await self._run(lambda db: db.read(key, recent, after, now))

    async def list_sessions(self, app_name: str, user_id: str | None, *, now: float) -> SessionList:
        """See :meth:`AdkBackend.list_sessions`."""
        return await self._run(lambda db: db.list_sessions(app_name, user_id, now))

    async def read_user_state(self, app_name: str, user_id: str) -> Mapping[str, JsonValue]:
        """See :meth:`AdkBackend.read_user_state`."""
        return await self._run(lambda db: db.read_user_state(app_name, user_id))

    async def append(self, key: SessionKey, request: AppendRequest) -> AppendResult:
        """See :meth:`AdkBackend.append`."""
        return await self._run(lambda db: db.append(key, request))

    async def delete(self, key: SessionKey) -> None:
        """See :meth:`AdkBackend.delete`."""
        await self._run(lambda db: db.delete(key))

    async def hold(self, key: SessionKey, owner: str, *, now: float) -> None:
        """See :meth:`AdkBackend.hold`."""
        await self._run(lambda db: db.hold(key, owner, now))

    async def release(self, key: SessionKey, owner: str) -> bool:
        """See :meth:`AdkBackend.release`."""
        return await self._run(lambda db: db.release(key, owner))

    async def recover(self, key: SessionKey) -> bool:
        """See :meth:`AdkBackend.recover`."""
        return await self._run(lambda db: db.recover(key))

    async def purge_expired(self, *, now: float) -> int:
        """See :meth:`AdkBackend.purge_expired`."""
        return await self._run(lambda db: db.purge_expired(now))

    async def close(self) -> None:
        """Close the file and stop its thread; idempotent. Later calls raise ConfigurationError."""
        if self._closed:
            return
        self._closed = True
        thread, db = self._thread, self._db
        self._thread = self._db = None
        if thread is None:
            return
        try:
            if db is not None:
                await thread.run(db.conn.close)
        finally:
            await asyncio.to_thread(thread.shutdown)
