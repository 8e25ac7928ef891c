"""``SqliteHistoryStore``: conversations in a SQLite file that processes may share.

Layout (schema version 1, recorded in ``touba_meta``):

- ``touba_history_sessions``: one row per key: the record's head (the whole
  record when it is not touba-shaped, ``split = 0``), sizes, expiry, identity
  and namespace (for ``list``), and the reservation (``token``, ``worker_id``,
  ``pid``, ``host``, ``since``). ``head IS NULL`` marks a reservation on a key
  that has no record yet: it holds that conversation's place among
  ``max_sessions`` (taken in the reservation's write transaction, so two
  processes cannot both take the last one) and vanishes when released.
- ``touba_history_messages``: one row per message of a touba record (``key``,
  ``seq``, ``exchange``, ``bytes``, ``body``), indexed on ``(key, exchange,
  seq, bytes)``: a tail or its sizes cost the rows read, and a decision
  appends rows without rewriting any.

Every SQLite call runs on one worker thread per store, which owns the
connection; each call commits or rolls back before it returns, so no
transaction is open while an operation (a model call) runs. A decision is
two calls: the reservation, which in its write transaction also reads the
conversation's tail as far back as the history layer read lately (older
rows, when asked, cost a call each), and the save. Nothing is kept between
decisions, so processes sharing the file always see each other's saves.

Failures (:func:`_translate`, the one place ``sqlite3`` and OS errors become
touba errors, chained): a file locked past the busy timeout is
``DecisionHistoryBusy``; a corrupt file ``DecisionHistoryRecordInvalid``; a
full disk, an I/O error, a read-only file system or a file that cannot be
opened ``DecisionHistoryStoreUnavailable``, with the previous state kept
(SQLite rolls the failed transaction back). When a failure strikes while a
key is reserved, the store gives the key back at once, so the live worker
can retry; only when that release cannot be written either does the key
stay busy, and the error then says that ``recover`` is needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from types import TracebackType
from typing import Any, Final, Self, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._common import (
    MiB,
    Reservation,
    busy,
    check_capacity,
    check_key,
    check_limits_config,
    check_sessions,
    encode_checked_json,
    encode_json,
    encode_record,
    iso,
    recovered,
    require_worker_stopped,
)
from touba.history._files import open_private_sqlite
from touba.history._model import parse_json
from touba.history._record import join_record
from touba.history._sqlite import describe, failure_kind, transaction
from touba.history._store import (
    LogOperation,
    LogWrite,
    Operation,
    Record,
    StoredConversation,
    StoreUsage,
    check_appends,
)
from touba.history._window import ExchangeSize

__all__ = ["SCHEMA_VERSION", "SqliteHistoryStore"]

T = TypeVar("T")
R = TypeVar("R")
logger = logging.getLogger("touba.history")

SCHEMA_VERSION: Final = 1
BUSY_TIMEOUT_SECONDS: Final = 5.0
MAX_TAIL: Final = 1024  # most exchanges read ahead with a reservation
_VERSION_NAME = "history_schema_version"
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS touba_history_sessions (
        key TEXT PRIMARY KEY, head TEXT, split INTEGER NOT NULL DEFAULT 0,
        namespace TEXT, identity TEXT, exchanges INTEGER NOT NULL DEFAULT 0,
        messages INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL DEFAULT 0,
        updated_at REAL, expires_at REAL,
        token TEXT, worker_id TEXT, pid INTEGER, host TEXT, since REAL)""",
    "CREATE INDEX IF NOT EXISTS touba_history_sessions_expiry "
    "ON touba_history_sessions (expires_at)",
    "CREATE INDEX IF NOT EXISTS touba_history_sessions_namespace "
    "ON touba_history_sessions (namespace)",
    """CREATE TABLE IF NOT EXISTS touba_history_messages (
        id INTEGER PRIMARY KEY, key TEXT NOT NULL, seq INTEGER NOT NULL,
        exchange INTEGER NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS touba_history_messages_tail "
    "ON touba_history_messages (key, exchange, seq, bytes)",
)
_EXPIRED_KEYS = """SELECT key FROM touba_history_sessions
    WHERE head IS NOT NULL AND token IS NULL AND expires_at <= ?"""
_INSERT_MESSAGE = """INSERT INTO touba_history_messages (key, seq, exchange, bytes, body)
    VALUES (?, ?, ?, ?, ?)"""
_RESERVE = """UPDATE touba_history_sessions
    SET token = ?, worker_id = ?, pid = ?, host = ?, since = ? WHERE key = ?"""
_SAVE = """UPDATE touba_history_sessions SET head = ?, split = ?, namespace = ?, identity = ?,
    exchanges = ?, messages = ?, bytes = ?, updated_at = ?, expires_at = ?,
    token = NULL, worker_id = NULL, pid = NULL, host = NULL, since = NULL WHERE key = ?"""
_UNRESERVE = """UPDATE touba_history_sessions
    SET token = NULL, worker_id = NULL, pid = NULL, host = NULL, since = NULL
    WHERE key = ? AND token """


def _check_schema(conn: sqlite3.Connection) -> None:
    """Refuse a database written by a newer (or unknown) touba, reading only.

    ``DecisionHistoryRecordInvalid``, as for a record of a future version: the
    stored data is unreadable here, which no change of configuration fixes.
    """
    sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'touba_meta'"
    if not conn.execute(sql).fetchone():
        return
    row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (_VERSION_NAME,)).fetchone()
    if row is not None and row[0] != str(SCHEMA_VERSION):
        raise DecisionHistoryRecordInvalid(
            f"this SQLite file holds decision history schema version {row[0]!r}; this touba "
            f"reads version {SCHEMA_VERSION}. Upgrade touba or use another file; the file was "
            "not modified"
        )


def _parse(text: str, key: str, what: str) -> Record:
    try:
        value = parse_json(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise DecisionHistoryRecordInvalid(
            f"{what} of conversation {key} in the SQLite store is not a JSON object; it was "
            f"not modified. Inspect it with `touba history show {key}` or delete it"
        )
    return value


def _identity(head: Record) -> tuple[str | None, str | None]:
    """Namespace and identity JSON of a touba head (``None`` otherwise)."""
    identity = head.get("identity")
    if not isinstance(identity, dict):
        return None, None
    namespace = identity.get("namespace")
    encoded = encode_json(identity, "identity")
    return (namespace if isinstance(namespace, str) else None), encoded


def _translate(error: Exception, key: str) -> Exception:
    """The typed error for a ``sqlite3`` or OS error: the one place they are converted."""
    kind = failure_kind(error)
    if kind is None:
        return error
    if kind == "locked":
        return DecisionHistoryBusy(
            f"the SQLite database stayed locked by another connection for over "
            f"{BUSY_TIMEOUT_SECONDS:g}s ({error}); the step that waited wrote nothing. Retry, "
            "and keep other writers' transactions short",
            session_key=key,
        )
    if kind == "not_a_database":
        return DecisionHistoryRecordInvalid(
            f"the SQLite file is not a database ({describe(error)}); it was not modified. "
            "Check filename, or restore the file from a backup"
        )
    if kind == "misuse":
        return ConfigurationError(
            f"the SQLite connection cannot be used ({describe(error)}); with database=, keep "
            "the connection open (made with check_same_thread=False) until the store is closed"
        )
    if kind == "corrupt":
        return DecisionHistoryStoreUnavailable(
            f"the SQLite history store read a damaged page ({describe(error)}): a failing disk "
            "or real damage. Nothing was saved and the previous state is kept; retry, and if "
            "it persists restore the file from a backup."
        )
    return DecisionHistoryStoreUnavailable(
        f"the SQLite history store failed ({describe(error)}): the disk may be full, failing "
        "or read-only. Nothing was saved and the previous state is kept; fix the disk, then "
        "retry."
    )


def _stuck(key: str, error: BaseException) -> str:
    return (
        f"The reservation of conversation {key} could not be released either "
        f"({describe(error)}): it answers DecisionHistoryBusy until you run "
        f"store.recover(key, worker_stopped=True) (or `touba history recover {key}`) once the "
        "disk works again."
    )


class _Db:
    """The store's SQL, run only on its worker thread."""

    def __init__(self, conn: sqlite3.Connection, store: SqliteHistoryStore) -> None:
        self.conn = conn
        self.store = store

    def q(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self.conn.execute(sql, args)

    def init_schema(self) -> None:
        with transaction(self.conn):
            _check_schema(self.conn)
            for statement in _SCHEMA:
                self.q(statement)
            sql = "INSERT OR IGNORE INTO touba_meta (name, value) VALUES (?, ?)"
            self.q(sql, _VERSION_NAME, str(SCHEMA_VERSION))

    # -- helpers (inside a write transaction) ---------------------------------------

    def _purge(self) -> int:
        now = self.store._clock()
        self.q("DELETE FROM touba_history_messages WHERE key IN (" + _EXPIRED_KEYS + ")", now)  # noqa: S608
        sql = "DELETE FROM touba_history_sessions WHERE key IN (" + _EXPIRED_KEYS + ")"  # noqa: S608
        return self.q(sql, now).rowcount

    def _owned(self, key: str, token: str) -> tuple[str | None, int, int, int]:
        """Head, bytes, messages, exchanges of a key this token still reserves."""
        row = self.q(
            "SELECT head, bytes, messages, exchanges FROM touba_history_sessions "
            "WHERE key = ? AND token = ?",
            key,
            token,
        ).fetchone()
        if row is None:
            raise busy(key, " (its reservation was recovered while this one ran; nothing saved)")
        return row[0], row[1], row[2], row[3]

    def _usage(self) -> StoreUsage:
        """Places held (records and reservations of new keys) and bytes retained;
        one pass over the sessions table, never over the messages."""
        sessions, total = self.q(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM touba_history_sessions"
        ).fetchone()
        return StoreUsage(sessions, self.store.max_sessions, total, self.store.max_store_bytes)

    def _admit(self, *, is_new: bool, old_bytes: int, new_bytes: int) -> None:
        sessions, total = self.q(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM touba_history_sessions "
            "WHERE head IS NOT NULL"
        ).fetchone()
        check_capacity(
            is_new=is_new,
            sessions=sessions,
            max_sessions=self.store.max_sessions,
            store_bytes_after=total - old_bytes + new_bytes,
            max_store_bytes=self.store.max_store_bytes,
        )

    def _save(self, key: str, head: str, split: Record | None, sizes: tuple[int, ...]) -> None:
        """Store a head (``split``: the touba head it encodes), sizes (exchanges,
        messages, bytes) and a fresh expiry; clear the reservation."""
        now = self.store._clock()
        namespace, identity = _identity(split or {})
        values = (head, split is not None, namespace, identity, *sizes)
        self.q(_SAVE, *values, now, now + self.store.ttl_seconds, key)

    def _rows(self, key: str, start: int, stop: int = 2**62) -> list[list[Record]]:
        exchanges: list[list[Record]] = []
        for exchange, body in self.q(
            "SELECT exchange, body FROM touba_history_messages "
            "WHERE key = ? AND exchange >= ? AND exchange < ? ORDER BY exchange, seq",
            key,
            start,
            stop,
        ):
            while len(exchanges) <= exchange - start:
                exchanges.append([])
            exchanges[exchange - start].append(_parse(body, key, "a message"))
        return exchanges

    def _record(self, key: str, head: str, split: bool) -> Record:
        parsed = _parse(head, key, "the stored record")
        return join_record(parsed, self._rows(key, 0)) if split else parsed

    # -- reservation ------------------------------------------------------------------

    def reserve(
        self, key: str, reservation: Reservation, tail: int = 0
    ) -> tuple[tuple[str, bool, int] | None, StoreUsage, list[tuple[int, int, str]]]:
        """Reserve ``key``; return its stored head, split flag and exchange count (None
        for a key without a record), the store's usage with this reservation, and
        the ``(exchange, bytes, body)`` rows of its last ``tail`` exchanges (read in
        the reserving transaction, so a failure there reserves nothing).

        A new key takes its place among ``max_sessions`` in the same write
        transaction (``BEGIN IMMEDIATE`` serialises every writer of the file),
        or is refused with nothing reserved. The record itself is read by
        :meth:`load`, once the reservation is committed.
        """
        with transaction(self.conn):
            self._purge()
            row = self.q(
                "SELECT head, split, exchanges, token FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is not None and row[3] is not None:
                raise busy(key)
            usage = self._usage()
            if row is None:
                check_sessions(usage.sessions, self.store.max_sessions)
                self.q("INSERT INTO touba_history_sessions (key) VALUES (?)", key)
                usage = replace(usage, sessions=usage.sessions + 1)
            held = (reservation.worker_id, reservation.pid, reservation.host, reservation.since)
            self.q(_RESERVE, reservation.token, *held, key)
            rows: list[tuple[int, int, str]] = []
            if tail and row is not None and row[0] is not None and row[1] and row[2]:
                rows = self.q(
                    "SELECT exchange, bytes, body FROM touba_history_messages "
                    "WHERE key = ? AND exchange >= ? ORDER BY exchange, seq",
                    key,
                    max(0, row[2] - tail),
                ).fetchall()
        if row is None or row[0] is None:
            return None, usage, []
        return (row[0], bool(row[1]), row[2]), usage, rows

    def load(self, key: str, head: str, split: bool, whole: bool) -> Record:
        """The reserved key's whole record (``whole``) or its head, outside any write
        transaction (the reservation keeps other writers away)."""
        if whole:
            return self._record(key, head, split)
        return _parse(head, key, "the stored record")

    def release(self, key: str, token: str) -> None:
        with transaction(self.conn):
            sql = "DELETE FROM touba_history_sessions WHERE key = ? AND token = ? AND head IS NULL"
            self.q(sql, key, token)
            self.q(_UNRESERVE + "= ?", key, token)

    def recover(self, key: str) -> bool:
        with transaction(self.conn):
            cleared = self.q(
                "DELETE FROM touba_history_sessions WHERE key = ? AND head IS NULL "
                "AND token IS NOT NULL",
                key,
            ).rowcount
            cleared += self.q(_UNRESERVE + "IS NOT NULL", key).rowcount
        return cleared > 0

    # -- saves ------------------------------------------------------------------------

    def save_record(self, key: str, token: str, record: Record | None) -> None:
        """Generic path: replace the whole record (``None`` deletes it)."""
        encoded = None if record is None else encode_record(record)
        with transaction(self.conn):
            old_head, old_bytes, _, _ = self._owned(key, token)
            self.q("DELETE FROM touba_history_messages WHERE key = ?", key)
            if record is None or encoded is None:
                self.q("DELETE FROM touba_history_sessions WHERE key = ?", key)
                return
            self._purge()
            self._admit(is_new=old_head is None, old_bytes=old_bytes, new_bytes=encoded.bytes)
            rows: list[tuple[str, int, int, int, str]] = []
            for index, exchange in enumerate(encoded.exchanges):
                for body in exchange:
                    rows.append((key, len(rows), index, len(body.encode("utf-8")), body))
            self.conn.executemany(_INSERT_MESSAGE, rows)
            sizes = (len(encoded.exchanges), encoded.messages, encoded.bytes)
            self._save(key, encoded.head, record if encoded.split else None, sizes)

    def save_log(self, key: str, token: str, write: LogWrite) -> None:
        """Append ``write``'s messages and replace the head; no row is rewritten."""
        head = encode_checked_json(write.head, "head")
        bodies = [(index, encode_checked_json(m, "message")) for index, m in write.append]
        with transaction(self.conn):
            old_head, old_bytes, messages, exchanges = self._owned(key, token)
            check_appends(exchanges, write.append)
            rows = [
                (key, messages + n, index, len(body.encode("utf-8")), body)
                for n, (index, body) in enumerate(bodies)
            ]
            kept = old_bytes - len(old_head.encode("utf-8")) if old_head is not None else 0
            new_bytes = kept + len(head.encode("utf-8")) + sum(row[3] for row in rows)
            self._purge()
            self._admit(is_new=old_head is None, old_bytes=old_bytes, new_bytes=new_bytes)
            self.conn.executemany(_INSERT_MESSAGE, rows)
            count = max([exchanges] + [index + 1 for index, _ in bodies])
            self._save(key, head, write.head, (count, messages + len(rows), new_bytes))

    # -- reads during a log transaction (the key is reserved) -------------------------

    def sizes(self, key: str, start: int) -> list[ExchangeSize]:
        rows = self.q(
            "SELECT COUNT(*), SUM(bytes) FROM touba_history_messages "
            "WHERE key = ? AND exchange >= ? GROUP BY exchange ORDER BY exchange",
            key,
            start,
        )
        return [ExchangeSize(count, size) for count, size in rows]

    def exchanges(self, key: str, start: int, stop: int) -> list[list[Record]]:
        with transaction(self.conn, "BEGIN"):
            return self._rows(key, start, stop)

    # -- the other operations ---------------------------------------------------------

    def purge(self) -> int:
        if not self.q(_EXPIRED_KEYS + " LIMIT 1", self.store._clock()).fetchone():
            return 0  # the common case stays read-only
        with transaction(self.conn):
            return self._purge()

    def read(self, key: str) -> Record | None:
        self.purge()
        with transaction(self.conn, "BEGIN"):
            row = self.q(
                "SELECT head, split, token, expires_at FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is not None and row[2] is not None:
                raise busy(key)
            if row is None or row[0] is None or row[3] <= self.store._clock():
                return None
            return self._record(key, row[0], row[1])

    def delete(self, key: str) -> bool:
        with transaction(self.conn):
            self._purge()
            row = self.q("SELECT token FROM touba_history_sessions WHERE key = ?", key).fetchone()
            if row is None:
                return False
            if row[0] is not None:
                raise busy(key)
            self.q("DELETE FROM touba_history_messages WHERE key = ?", key)
            self.q("DELETE FROM touba_history_sessions WHERE key = ?", key)
            return True

    def usage(self) -> StoreUsage:
        self.purge()
        with transaction(self.conn, "BEGIN"):
            return self._usage()

    def listing(self, namespace: str | None) -> list[StoredConversation]:
        self.purge()
        rows = self.q(
            "SELECT key, identity, messages, bytes, updated_at, expires_at, token, worker_id, "
            "pid, host, since FROM touba_history_sessions "
            "WHERE ? IS NULL OR namespace = ? ORDER BY key",
            namespace,
            namespace,
        )
        out = []
        for key, identity, messages, size, updated, expires, token, *held in rows:
            try:
                parsed = json.loads(identity) if identity is not None else None
            except ValueError:  # a damaged row is still listed, so it can be deleted
                parsed = None
            active = token is not None
            out.append(
                StoredConversation(
                    key=key,
                    identity=parsed if isinstance(parsed, dict) else None,
                    messages=messages,
                    bytes=size,
                    updated_at=iso(held[3] if updated is None else updated) or "",
                    expires_at=iso(expires),
                    active=active,
                    reservation=Reservation(token, *held).describe() if active else None,
                )
            )
        return out


class _Snapshot:
    """A reserved conversation as ``transact_log`` shows it: the head and the tail read
    with the reservation (so a decision costs two hops to the store's thread: reserve,
    save), older rows on demand."""

    def __init__(
        self,
        store: SqliteHistoryStore,
        key: str,
        head: Record,
        count: int,
        rows: list[tuple[int, int, str]],
        tail: int,
    ) -> None:
        self._store = store
        self._key = key
        self._head = head
        self._count = count
        self._rows = rows  # (exchange, bytes, body) of exchanges self._tail ..
        self._tail = tail

    def _wants(self, start: int) -> bool:
        """True when ``start`` lies in the tail read ahead; remember how far back the
        history layer reads, plus one exchange: a conversation shorter than its
        window is read from its start, one exchange further back each decision."""
        store = self._store
        store._tail_hint = min(MAX_TAIL, max(store._tail_hint, self._count - start + 1))
        return start >= self._tail

    @property
    def head(self) -> Record:
        return self._head

    @property
    def exchange_count(self) -> int:
        return self._count

    async def sizes(self, start: int) -> list[ExchangeSize]:
        if self._wants(start):
            sizes: dict[int, list[int]] = {}
            for exchange, size, _body in self._rows:
                if exchange >= start:
                    weight = sizes.setdefault(exchange, [0, 0])
                    weight[0] += 1
                    weight[1] += size
            return [ExchangeSize(n, b) for n, b in sizes.values()]
        db = self._store._db
        return await self._store._run(self._key, lambda: db.sizes(self._key, start))

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        if self._wants(start):
            out: list[list[Record]] = []
            for exchange, _size, body in self._rows:
                if start <= exchange < stop:
                    while len(out) <= exchange - start:
                        out.append([])
                    out[exchange - start].append(_parse(body, self._key, "a message"))
            return out
        db = self._store._db
        return await self._store._run(self._key, lambda: db.exchanges(self._key, start, stop))


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # its caller may be gone (cancelled): do not report it as lost


class SqliteHistoryStore:
    """SQLite store: durable, shared by processes, bounded, refusing when full.

    Give exactly one of ``filename`` or ``database``. With ``filename``, the
    location is checked and the file and its ``-wal``, ``-shm`` and
    ``-journal`` companions are created or reset to 0600 before SQLite opens
    them (:mod:`touba.history._files`); the directory is not created: make it
    yourself, mode 0700. ``database`` is an open ``sqlite3.Connection`` made
    with ``check_same_thread=False`` that only this store uses until
    ``close()``; its pragmas, closing and file protection are the
    application's.

    The file is opened at construction (blocking briefly). A reservation
    outlives a crashed worker: the key answers ``DecisionHistoryBusy`` until
    ``recover(key, worker_stopped=True)``. Reserving a key that has no record
    claims its place among ``max_sessions`` at once; when every place is held
    (records and such reservations), it raises ``DecisionHistoryLimitExceeded``
    before the operation runs. Expired conversations are purged
    on the next access (not a secure erase); ``purge_expired()`` does it now.
    """

    def __init__(
        self,
        filename: str | os.PathLike[str] | None = None,
        *,
        database: sqlite3.Connection | None = None,
        max_sessions: int = 128,
        max_store_bytes: int = 32 * MiB,
        ttl_seconds: float = 86400,
        worker_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (filename is None) == (database is None):
            raise ConfigurationError(
                "SqliteHistoryStore needs exactly one of filename=... (a path) or "
                "database=... (an open sqlite3.Connection)"
            )
        if database is not None and not isinstance(database, sqlite3.Connection):
            raise ConfigurationError("database must be a sqlite3.Connection")
        check_limits_config(
            max_sessions=max_sessions, max_store_bytes=max_store_bytes, ttl_seconds=ttl_seconds
        )
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
            raise ConfigurationError("worker_id must be a non-empty str, or None")
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = ttl_seconds
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # How many trailing exchanges the history layer read lately: a
        # reservation reads that many ahead, in its own transaction.
        self._tail_hint = 0
        self._clock = clock
        self._owns_connection = database is None
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        # One thread owns the connection and runs every SQLite call, in order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="touba-sqlite")
        try:
            self._db = self._executor.submit(self._open, filename, database).result()
        except BaseException:
            self._executor.shutdown(wait=True)
            raise

    def _open(
        self, filename: str | os.PathLike[str] | None, conn: sqlite3.Connection | None
    ) -> _Db:
        try:
            if conn is None:
                assert filename is not None
                conn = open_private_sqlite(
                    filename, timeout=BUSY_TIMEOUT_SECONDS, check=_check_schema
                )
            else:
                try:
                    conn.execute("SELECT 1").fetchall()
                except sqlite3.ProgrammingError as e:
                    raise ConfigurationError(
                        f"database= cannot be used from the store's thread ({e}); pass an "
                        "open connection made with sqlite3.connect(..., check_same_thread=False)"
                    ) from e
                if conn.in_transaction:
                    raise ConfigurationError("database= has an open transaction; end it first")
            db = _Db(conn, self)
            db.init_schema()
            return db
        except Exception as e:
            if self._owns_connection and conn is not None:
                conn.close()
            translated = _translate(e, "")
            if translated is e:
                raise
            raise translated from e

    # -- plumbing -----------------------------------------------------------------------

    @contextmanager
    def _using(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise ConfigurationError("this SqliteHistoryStore is closed; create a new one")
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1

    def _call(self, key: str, job: Callable[[], R]) -> R:
        try:
            return job()
        except Exception as e:
            translated = _translate(e, key)
            if translated is e:
                raise
            raise translated from e

    async def _run(self, key: str, job: Callable[[], R]) -> R:
        """Run ``job`` on the store's thread; once started it finishes even if we are cancelled."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._call, key, job)
        future.add_done_callback(_retrieve)
        return await asyncio.shield(future)

    async def _reserve(
        self, key: str, reservation: Reservation, tail: int = 0
    ) -> tuple[tuple[str, bool, int] | None, StoreUsage, list[tuple[int, int, str]]]:
        try:
            return await self._run(key, lambda: self._db.reserve(key, reservation, tail))
        except asyncio.CancelledError:
            # The reservation may be taken anyway: free it right after (same thread, in order).
            self._executor.submit(self._call, key, lambda: self._db.release(key, reservation.token))
            raise
        # Any other failure rolled the reservation's transaction back: nothing is held.

    async def _released_after(self, error: BaseException, key: str, token: str) -> Exception | None:
        """Give ``key`` back after ``error`` struck while it was reserved.

        Returns None when the release was written (the key is free: the live
        worker may retry), or when ``error`` is not the store's and stays the
        error to raise (a note then says the key is held). When the store
        failed and the release could not be written either, returns the
        store's error to raise instead, restated with a message that says
        ``recover`` is needed.
        """
        try:
            await self._run(key, lambda: self._db.release(key, token))
            return None
        except Exception as e:
            logger.warning(
                "could not release the reservation of %s (%s); it stays busy until "
                "store.recover(key, worker_stopped=True)",
                key,
                type(e.__cause__ or e).__name__,
            )
            stuck = _stuck(key, e.__cause__ or e)
            if isinstance(error.__cause__, sqlite3.Error | OSError):  # made by _translate
                if isinstance(error, DecisionHistoryBusy):
                    return DecisionHistoryBusy(f"{error} {stuck}", session_key=key)
                if isinstance(
                    error,
                    DecisionHistoryStoreUnavailable | DecisionHistoryRecordInvalid,
                ):
                    return type(error)(f"{error} {stuck}")
            if isinstance(error, Exception):  # not the store's: its type and text stay
                error.add_note(stuck)
            return None

    # -- the contract -------------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Run ``operation`` on the record of ``key`` under a durable reservation.

        See :class:`~touba.history.HistoryStore`. Raises ``DecisionHistoryBusy``
        (held, or the file stayed locked), ``DecisionHistoryLimitExceeded``,
        ``DecisionHistoryRecordInvalid``, ``DecisionHistoryStoreUnavailable``
        (disk full, I/O error, read-only file system: nothing saved, and the
        key released when that can still be written) or what ``operation``
        raises; ``ConfigurationError`` for an invalid key.
        """
        check_key(key)
        with self._using():
            reservation = Reservation.new(self.worker_id)
            token = reservation.token
            found, _usage, _rows = await self._reserve(key, reservation)
            try:
                loaded = None
                if found is not None:
                    head, split, _count = found
                    loaded = await self._run(key, lambda: self._db.load(key, head, split, True))
                record, result = await operation(loaded)
                await self._run(key, lambda: self._db.save_record(key, token, record))
            except BaseException as e:
                replacement = await self._released_after(e, key, token)
                if replacement is None:
                    raise
                raise replacement from e.__cause__
            return result

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact`` for the history layer: the head, rows on demand, appends only.

        Raises as :meth:`transact` does.
        """
        check_key(key)
        with self._using():
            reservation = Reservation.new(self.worker_id)
            token = reservation.token
            hint = self._tail_hint
            found, usage, rows = await self._reserve(key, reservation, hint)
            try:
                snapshot = None
                if found is not None:
                    text, split, count = found
                    head = _parse(text, key, "the stored record")
                    tail = max(0, count - hint) if hint and split else count
                    snapshot = _Snapshot(self, key, head, count, rows, tail)
                write, result = await operation(snapshot, usage)
                if write is None:
                    await self._run(key, lambda: self._db.release(key, token))
                else:
                    await self._run(key, lambda: self._db.save_log(key, token, write))
            except BaseException as e:
                replacement = await self._released_after(e, key, token)
                if replacement is None:
                    raise
                raise replacement from e.__cause__
            return result

    async def read(self, key: str) -> Record | None:
        """A detached copy of the record, or None if absent or expired (TTL not renewed).

        ``DecisionHistoryBusy`` while reserved; ``DecisionHistoryStoreUnavailable``
        when the file cannot be read."""
        check_key(key)
        with self._using():
            return await self._run(key, lambda: self._db.read(key))

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; ``DecisionHistoryBusy`` if it is reserved,
        ``DecisionHistoryStoreUnavailable`` (nothing deleted) when the disk fails."""
        check_key(key)
        with self._using():
            return await self._run(key, lambda: self._db.delete(key))

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation left by a stopped worker; the saved record is kept as is.

        True when a reservation was freed. ``DecisionHistoryStoreUnavailable``
        when it cannot be written (retry once the disk works)."""
        require_worker_stopped(worker_stopped)
        check_key(key)
        with self._using():
            return recovered(key, await self._run(key, lambda: self._db.recover(key)))

    async def purge_expired(self) -> int:
        """Delete expired, unreserved conversations now; return how many."""
        with self._using():
            return await self._run("", self._db.purge)

    async def usage(self) -> StoreUsage:
        """How full the store is now, over every process sharing the file.

        ``sessions`` counts stored conversations plus reservations of keys that
        have no record yet (a crashed worker's included, until ``recover``);
        ``bytes`` what the records retain (UTF-8 JSON of heads and messages).
        Expired conversations are purged first.
        """
        with self._using():
            return await self._run("", self._db.usage)

    async def list(self, namespace: str | None = None) -> list[StoredConversation]:
        """Sizes and reservations, never content. A key reserved before its first
        save has no identity yet: it is listed only when ``namespace`` is None."""
        with self._using():
            return await self._run("", lambda: self._db.listing(namespace))

    async def close(self) -> None:
        """Wait for running operations to save or release, then close what it opened."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # A poll, not an asyncio.Event: the store may serve more than one event loop.
        while self._users:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        try:
            if self._owns_connection:
                await self._run("", self._db.conn.close)
        finally:
            self._executor.shutdown(wait=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
