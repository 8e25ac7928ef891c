"""``SqliteHistoryStore``: conversations in a SQLite file that processes may share.

The file (schema version 2: a sessions table, a messages table, a usage row
kept exact by triggers, and the migration of a version-1 file) is laid out
and created by :mod:`touba.history._sqlite_schema`.

Every SQLite call runs on one worker thread per store, which owns the
connection; each call commits or rolls back before it returns, so no
transaction is open while an operation (a model call) runs. A decision is
two calls (:mod:`touba.history._reservations` runs the protocol): the
reservation, which in its write transaction also reads the conversation's
tail unless this store object holds it at the stored version already, and
the save. Processes sharing the file see each other's saves: a save by any
of them changes the version.

The reservation's commit does not wait for the disk (``synchronous=NORMAL``
for that transaction only): it outlives its process, ``kill -9`` included,
as a reservation must, but not always a power loss. It need not: a power
loss stops its holder too, and a reservation undone by it leaves the key as
it was before, free, which is what ``recover`` would make of a reservation
whose holder is gone (expired records it purged come back expired, and are
purged again). SQLite's log stays in order, so the save that follows
(``FULL``, like every other commit of this store) makes it durable anyway.
A save without a reservation that only renews the expiry (a read, the same
head, nothing appended or dropped) does not wait either: a power loss may
undo the renewal, which leaves the conversation as it was, expiring when it
did before.

Expired conversations: a key whose record expired is purged when it is
reserved or deleted; every expired, unreserved record is purged at most once
a minute per store object (by its clock), whenever the store is 80 % full or
a write would not fit otherwise (so expired records never refuse a write),
and by ``usage``, ``list`` and ``purge_expired``. ``usage``, ``list`` and
``read`` with ``purge=False`` write nothing (the read-only commands use them).

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
import builtins
import json
import math
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any, Final, TypeVar

from touba._closing import AsyncClosing
from touba._encryption import Encryption
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._backend import (
    Read,
    Reserved,
    Rows,
    Seen,
    Sizes,
    Write,
    dropped_elsewhere,
    parse_object,
)
from touba.history._common import (
    MiB,
    Reservation,
    busy,
    check_capacity,
    check_key,
    check_limits_config,
    check_sessions,
    iso,
    recovered,
    require_worker_stopped,
)
from touba.history._files import open_private_sqlite
from touba.history._record import join_record
from touba.history._repair import RawConversation, RawRow, RepairPlan, raw_int, raw_text
from touba.history._repair_write import write_repair
from touba.history._reservations import Reservations
from touba.history._sealed import (
    Rekeying,
    Sealer,
    check_encryption,
    require_sealer,
    sealed_backend,
)
from touba.history._sqlite import OwnedThread, describe, failure_kind, transaction
from touba.history._sqlite_kinds import require_sqlite_store
from touba.history._sqlite_schema import PAGE_SIZE, SCHEMA_VERSION, check_schema, init_schema
from touba.history._store import (
    LogOperation,
    Operation,
    Record,
    StoredConversation,
    StoreUsage,
)

__all__ = ["SCHEMA_VERSION", "SqliteHistoryStore"]

T = TypeVar("T")
R = TypeVar("R")

BUSY_TIMEOUT_SECONDS: Final = 5.0
PURGE_INTERVAL: Final = 60.0  # seconds between purges of every expired record
PURGE_NEAR_FULL: Final = 0.8  # ... or at each write while the store is this full
_LABEL = "SQLite"
_NO_END = 2**62

_INSERT_MESSAGE = """INSERT INTO touba_history_messages (conv, seq, exchange, bytes, body)
    VALUES (?, ?, ?, ?, ?)"""
_RESERVE = """UPDATE touba_history_sessions
    SET token = ?, worker_id = ?, pid = ?, host = ?, since = ?, version = ? WHERE id = ?"""
_SAVE = """UPDATE touba_history_sessions SET head = ?, split = ?,
    exchanges = ?, messages = ?, bytes = ?, updated_at = ?, expires_at = ?, version = ?,
    token = NULL, worker_id = NULL, pid = NULL, host = NULL, since = NULL WHERE id = ?"""
# Only when they change: setting the namespace rewrites its index entry even when equal.
_SAVE_IDENTITY = """UPDATE touba_history_sessions SET namespace = ?, identity = ?
    WHERE id = ? AND (namespace IS NOT ? OR identity IS NOT ?)"""
# The exchange bound lets the tail index find the newest rows in O(dropped), not O(rows).
_NEWEST = "FROM touba_history_messages WHERE conv = ? AND exchange >= ? AND seq >= ?"
_DROP_NEWEST = "DELETE " + _NEWEST
_WEIGH_NEWEST = "SELECT count(*), coalesce(sum(bytes), 0) " + _NEWEST
_UNRESERVE = """UPDATE touba_history_sessions
    SET token = NULL, worker_id = NULL, pid = NULL, host = NULL, since = NULL
    WHERE key = ? AND token """
_EXPIRED = "head IS NOT NULL AND token IS NULL AND expires_at <= ?"
_CONV = "(SELECT id FROM touba_history_sessions WHERE key = ?)"
_SIZES = f"""SELECT exchange, COUNT(*), SUM(bytes) FROM touba_history_messages
    WHERE conv = {_CONV} AND exchange >= ? AND exchange < ?
    GROUP BY exchange ORDER BY exchange"""  # noqa: S608 - constant text
_ROWS = f"""SELECT exchange, bytes, body FROM touba_history_messages
    WHERE conv = {_CONV} AND exchange >= ? AND exchange < ?
    ORDER BY exchange, seq"""  # noqa: S608 - constant text


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


def _recovered_meanwhile(key: str) -> DecisionHistoryBusy:
    return busy(key, " (its reservation was recovered while this one ran; nothing saved)")


# What ``list`` and ``list_recent`` read of a conversation (never its content), and the
# conversations the panel shows: held, or not expired (one parameter: now).
_LISTED: Final = (
    "SELECT key, identity, messages, bytes, updated_at, expires_at, token, worker_id, "
    "pid, host, since FROM touba_history_sessions "
)
_LIVE: Final = "WHERE token IS NOT NULL OR expires_at > ? "


def _listed(row: tuple[Any, ...], now: float) -> StoredConversation:
    """A row of ``_LISTED`` as the store lists it, expired or not at ``now``."""
    key, identity, messages, size, updated, expires, token, *held = row
    try:
        parsed = json.loads(identity) if identity is not None else None
    except ValueError:  # a damaged row is still listed, so it can be deleted
        parsed = None
    active = token is not None
    return StoredConversation(
        key=key,
        identity=parsed if isinstance(parsed, dict) else None,
        messages=messages,
        bytes=size,
        updated_at=iso(held[3] if updated is None else updated) or "",
        expires_at=iso(expires),
        active=active,
        reservation=Reservation(token, *held).describe() if active else None,
        expired=expires is not None and expires <= now,
    )


class _Db:
    """The store's SQL, run only on its worker thread."""

    def __init__(self, conn: sqlite3.Connection, store: SqliteHistoryStore) -> None:
        self.conn = conn
        self.store = store
        self.purged_at = -math.inf  # the store's clock at its last purge of every expired row

    def q(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self.conn.execute(sql, args)

    # -- helpers (inside a transaction) -----------------------------------------------

    def _usage(self) -> StoreUsage:
        """Places held (records and reservations of new keys) and bytes retained."""
        sessions, total = self.q("SELECT sessions, bytes FROM touba_history_usage").fetchone()
        return StoreUsage(sessions, self.store.max_sessions, total, self.store.max_store_bytes)

    def _purge_wanted(self, usage: StoreUsage, now: float, *, sessions: int = 0) -> bool:
        """Purge every expired record now? Once a minute, when the store is nearly
        full, or when what is about to be written would not fit otherwise."""
        return (
            not 0 <= now - self.purged_at < PURGE_INTERVAL
            or usage.fraction >= PURGE_NEAR_FULL
            or usage.sessions + sessions > usage.max_sessions
            or usage.bytes > usage.max_store_bytes
        )

    def _purge_all(self, now: float) -> int:
        self.purged_at = now
        return self.q(f"DELETE FROM touba_history_sessions WHERE {_EXPIRED}", now).rowcount  # noqa: S608

    def _sizes(self, key: str, start: int, stop: int) -> Sizes:
        return self.q(_SIZES, key, start, stop).fetchall() if start < stop else []

    def _rows(self, key: str, start: int, stop: int) -> Rows:
        return self.q(_ROWS, key, start, stop).fetchall() if start < stop else []

    def _record(self, key: str, head: str, split: bool, count: int) -> Record:
        rows = self._rows(key, 0, _NO_END) if split else []
        sealer = self.store._sealer
        if sealer is not None:
            head, rows = sealer.open_stored(key, head, rows)  # type: ignore[assignment]
        parsed = parse_object(head, key, "the stored record", _LABEL)
        if not split:
            return parsed
        exchanges: list[list[Record]] = [[] for _ in range(count)]
        for exchange, _size, body in rows:
            while len(exchanges) <= exchange:
                exchanges.append([])
            exchanges[exchange].append(parse_object(body, key, "a message", _LABEL))
        return join_record(parsed, exchanges)

    # -- the primitives of the reservation protocol -------------------------------------

    def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """Reserve ``key`` and read what ``read`` asks, in one write transaction
        (see :class:`touba.history._backend.Backend`): a failure reserves nothing.

        A new key takes its place among ``max_sessions`` in that transaction
        (``BEGIN IMMEDIATE`` serialises every writer of the file), or is refused
        with nothing reserved.
        """
        held = (
            reservation.token,
            reservation.worker_id,
            reservation.pid,
            reservation.host,
            reservation.since,
        )
        with transaction(self.conn, power_safe=False):
            now = self.store._clock()
            row = self.q(
                "SELECT id, head, split, exchanges, messages, bytes, version, token, expires_at "
                "FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is not None and row[7] is not None:
                raise busy(key)
            if row is not None and row[1] is not None and row[8] <= now:  # expired: gone
                self.q("DELETE FROM touba_history_sessions WHERE id = ?", row[0])
                row = None
            usage = self._usage()
            if self._purge_wanted(usage, now, sessions=int(row is None)):
                self._purge_all(now)
                usage = self._usage()
            if row is None:
                check_sessions(usage.sessions, self.store.max_sessions)
                self.q(
                    "INSERT INTO touba_history_sessions "
                    "(key, token, worker_id, pid, host, since, version) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    key,
                    *held,
                    reservation.token,
                )
                usage = replace(usage, sessions=usage.sessions + 1)
                return Reserved(None, False, 0, 0, 0, reservation.token, usage)
            conv, head, split, exchanges, messages, size, stored = row[:7]
            # A version is kept, or made (see the Backend docstring): a change of
            # the rows from now on clears it, which the save then sees.
            version = reservation.token if stored is None else stored
            self.q(_RESERVE, *held, version, conv)
            if head is None:  # a place held without a record (nothing to read)
                return Reserved(None, False, 0, 0, 0, version, usage)
            exchanges = exchanges if split else 0
            sizes: Sizes | None = []
            rows: Rows | None = []
            if read.whole:
                rows = self._rows(key, 0, _NO_END)
            elif read.cached is not None and read.cached == version:
                sizes = rows = None
            else:
                bodies = max(0, exchanges - read.bodies)
                sizes = self._sizes(key, max(0, exchanges - read.sizes), bodies)
                rows = self._rows(key, bodies, exchanges)
            return Reserved(
                head, bool(split), exchanges, messages, size, version, usage, sizes, rows
            )

    def peek(self, key: str, read: Read) -> Reserved | None:
        """What ``reserve`` reads, without reserving, in one write transaction that
        renews the expiry (reading is activity; the version and the head are kept):
        ``DecisionHistoryBusy`` while the key is held; a ``Reserved`` with no head
        when nothing live is stored (nothing is written then); None for a record
        that only a reservation reads (not split)."""
        with transaction(self.conn, power_safe=False):
            now = self.store._clock()
            row = self.q(
                "SELECT id, head, split, exchanges, messages, bytes, version, token, expires_at "
                "FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is not None and row[7] is not None:
                raise busy(key)
            if row is None or row[1] is None or row[8] <= now:  # nothing live: no place taken
                return Reserved(None, False, 0, 0, 0, None, self._usage())
            conv, head, split, exchanges, messages, size, version = row[:7]
            if not split or read.whole:
                return None
            self.q(
                "UPDATE touba_history_sessions SET updated_at = ?, expires_at = ? WHERE id = ?",
                now,
                now + self.store.ttl_seconds,
                conv,
            )
            if read.cached is not None and read.cached == version:
                sizes: Sizes | None = None
                rows: Rows | None = None
            else:
                bodies = max(0, exchanges - read.bodies)
                sizes = self._sizes(key, max(0, exchanges - read.sizes), bodies)
                rows = self._rows(key, bodies, exchanges)
            usage = self._usage()
            return Reserved(head, True, exchanges, messages, size, version, usage, sizes, rows)

    def save(self, key: str, token: str, write: Write) -> None:
        """Check the token, write, check capacity on the exact usage row: one transaction."""
        with transaction(self.conn):
            row = self.q(
                "SELECT id, token, version FROM touba_history_sessions WHERE key = ?", key
            ).fetchone()
            if row is None or row[1] != token:
                raise _recovered_meanwhile(key)
            # Rows changed by anyone else since the reservation keep the version cleared.
            intact = write.rewrite or row[2] == write.seen
            self._write(key, row[0], write, token if intact else None)

    def save_if(self, key: str, version: str, head: str, token: str, write: Write) -> bool:
        """Save ``write`` (a log write) without a reservation, in one transaction, if
        ``key`` is stored at ``version`` with the head text ``head``, unreserved and
        unexpired (and, for a drop, the rows it deletes are as many and weigh as
        much as the write says); its version is then ``token``. False (nothing
        changed) when it is not, or when the save would not fit: the reserved path
        then decides (and refuses) with the state as it is."""
        if write.rewrite:
            return False
        renewal = write.renews(head)  # a read
        try:
            with transaction(self.conn, power_safe=not renewal):
                row = self.q(
                    "SELECT id, token, version, expires_at, head FROM touba_history_sessions "
                    "WHERE key = ?",
                    key,
                ).fetchone()
                if (
                    row is None
                    or row[1] is not None
                    or row[2] != version
                    or row[4] != head
                    or row[3] <= self.store._clock()
                    or (write.dropped and not self._weighs(row[0], write))
                ):
                    return False
                self._write(key, row[0], write, token)
                return True
        except DecisionHistoryLimitExceeded:  # rolled back: nothing was written
            return False

    def _weighs(self, conv: int, write: Write) -> bool:
        """Whether the rows ``write``'s drop deletes are as many, and weigh as much,
        as the write says (its sizes were computed from a cached tail)."""
        count, size = self.q(_WEIGH_NEWEST, conv, write.dropped_from, write.kept).fetchone()
        return bool(count == write.dropped and size == write.dropped_bytes)

    def _write(self, key: str, conv: int, write: Write, version: str | None) -> None:
        """The writing part of a save, in the caller's transaction: rows, head, the
        fresh expiry, ``version``, the reservation cleared, then the capacity check
        on the exact usage row (its refusal rolls the transaction back)."""
        now = self.store._clock()
        if write.rewrite:
            self.q("DELETE FROM touba_history_messages WHERE conv = ?", conv)
        elif write.dropped:  # LogWrite.drop_last: the newest messages go first
            deleted = self.q(_DROP_NEWEST, conv, write.dropped_from, write.kept).rowcount
            if deleted != write.dropped:
                raise dropped_elsewhere(key, _LABEL, deleted, write.dropped)
        self.conn.executemany(
            _INSERT_MESSAGE,
            [(conv, seq, exchange, size, body) for seq, exchange, size, body in write.rows],
        )
        self.q(
            _SAVE_IDENTITY,
            write.namespace,
            write.identity,
            conv,
            write.namespace,
            write.identity,
        )
        self.q(
            _SAVE,
            write.head,
            write.split,
            write.exchanges,
            write.messages,
            write.bytes,
            now,
            now + self.store.ttl_seconds,
            version,
            conv,
        )
        usage = self._usage()  # exact: the triggers counted this write
        if self._purge_wanted(usage, now):
            self._purge_all(now)
            usage = self._usage()
        check_capacity(
            is_new=write.is_new,
            sessions=usage.sessions - 1,  # this key's place is counted (reserved, or stored)
            max_sessions=self.store.max_sessions,
            store_bytes_after=usage.bytes,
            max_store_bytes=self.store.max_store_bytes,
        )

    def delete_reserved(self, key: str, token: str) -> None:
        with transaction(self.conn):
            sql = "DELETE FROM touba_history_sessions WHERE key = ? AND token = ?"
            if not self.q(sql, key, token).rowcount:
                raise _recovered_meanwhile(key)

    def release(self, key: str, token: str) -> None:
        with transaction(self.conn):
            sql = "DELETE FROM touba_history_sessions WHERE key = ? AND token = ? AND head IS NULL"
            if not self.q(sql, key, token).rowcount:
                self.q(_UNRESERVE + "= ?", key, token)

    def sizes(self, key: str, start: int, stop: int) -> Sizes:
        return self._sizes(key, start, stop)

    def rows(self, key: str, start: int, stop: int) -> Rows:
        return self._rows(key, start, stop)

    # -- the other operations ---------------------------------------------------------

    def recover(self, key: str) -> bool:
        with transaction(self.conn):
            cleared = self.q(
                "DELETE FROM touba_history_sessions WHERE key = ? AND head IS NULL "
                "AND token IS NOT NULL",
                key,
            ).rowcount
            cleared += self.q(_UNRESERVE + "IS NOT NULL", key).rowcount
        return cleared > 0

    def read_raw(self, key: str) -> RawConversation | None:
        """The conversation as stored, refusing nothing (see ``read_raw``)."""
        with transaction(self.conn, "BEGIN"):
            row = self.q(
                "SELECT head, split, exchanges, messages, bytes, token, expires_at "
                "FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is None or row[0] is None or row[6] <= self.store._clock():
                return None
            head, split, exchanges, messages, size, token, _expires = row
            rows = self._rows(key, 0, _NO_END) if split else []
        raw = RawConversation(
            key,
            raw_text(head),
            bool(split),
            tuple(RawRow(raw_int(e), raw_int(b), raw_text(body)) for e, b, body in rows),
            exchanges if split else 0,
            messages,
            size,
            token is not None,
        )
        sealer = self.store._sealer
        return raw if sealer is None else sealer.open_raw(raw)  # plaintext, or not JSON

    def purge(self) -> int:
        now = self.store._clock()
        sql = f"SELECT 1 FROM touba_history_sessions WHERE {_EXPIRED} LIMIT 1"  # noqa: S608
        if not self.q(sql, now).fetchone():
            self.purged_at = now
            return 0  # the common case stays read-only
        with transaction(self.conn):
            return self._purge_all(now)

    def read(self, key: str, held: bool = False) -> Record | None:
        with transaction(self.conn, "BEGIN"):
            row = self.q(
                "SELECT head, split, exchanges, token, expires_at FROM touba_history_sessions "
                "WHERE key = ?",
                key,
            ).fetchone()
            if row is not None and row[3] is not None and not held:
                raise busy(key)
            if row is None or row[0] is None or row[4] <= self.store._clock():
                return None
            return self._record(key, row[0], bool(row[1]), row[2])

    def delete(self, key: str) -> bool:
        with transaction(self.conn):
            row = self.q(
                "SELECT id, head, token, expires_at FROM touba_history_sessions WHERE key = ?",
                key,
            ).fetchone()
            if row is None:
                return False
            if row[2] is not None:
                raise busy(key)
            self.q("DELETE FROM touba_history_sessions WHERE id = ?", row[0])
            return row[1] is not None and row[3] > self.store._clock()  # expired: purged

    def erase(self, keys: Sequence[str]) -> int:
        """Delete these conversations in one transaction with ``secure_delete`` on, then
        checkpoint the WAL (``touba.erase_user``); busy (nothing deleted) if one is held."""
        before = int(self.conn.execute("PRAGMA secure_delete").fetchone()[0])
        self.conn.execute("PRAGMA secure_delete=ON")
        try:
            with transaction(self.conn):
                erased = 0
                for key in keys:
                    row = self.q(
                        "SELECT id, token FROM touba_history_sessions WHERE key = ?", key
                    ).fetchone()
                    if row is None:
                        continue
                    if row[1] is not None:
                        raise busy(key)
                    self.q("DELETE FROM touba_history_sessions WHERE id = ?", row[0])
                    erased += 1
        finally:
            self.conn.execute(f"PRAGMA secure_delete={before}")
        with suppress(sqlite3.Error):  # a reader holds the WAL: the next checkpoint will do
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return erased

    def usage(self, purge: bool) -> StoreUsage:
        if purge:
            self.purge()
        return self._usage()

    def listing(self, namespace: str | None, purge: bool) -> list[StoredConversation]:
        if purge:
            self.purge()
        now = self.store._clock()
        rows = self.q(
            _LISTED + "WHERE ? IS NULL OR namespace = ? ORDER BY key", namespace, namespace
        )
        return [_listed(row, now) for row in rows]

    def recent(self, limit: int, offset: int) -> tuple[list[StoredConversation], int]:
        """``SqliteHistoryStore.list_recent``'s page and count."""
        now = self.store._clock()
        order = "ORDER BY coalesce(updated_at, since) DESC, key LIMIT ? OFFSET ?"
        rows = self.q(_LISTED + _LIVE + order, now, limit, offset)
        counted = "SELECT count(*) FROM touba_history_sessions " + _LIVE  # noqa: S608 - constant
        [(total,)] = self.q(counted, now)
        return [_listed(row, now) for row in rows], int(total)

    def stale(self, prefix: str, after: str, batch: int) -> list[str]:
        """Up to ``batch`` keys after ``after`` (in key order) of records holding a
        value that is not a token of the key ``prefix`` names."""
        n = len(prefix)
        return [
            key
            for (key,) in self.q(
                "SELECT key FROM touba_history_sessions AS s WHERE head IS NOT NULL "
                "AND key > ? AND (substr(head, 1, ?) <> ? OR EXISTS (SELECT 1 FROM "
                "touba_history_messages AS m WHERE m.conv = s.id AND substr(m.body, 1, ?) <> ?)) "
                "ORDER BY key LIMIT ?",
                after,
                n,
                prefix,
                n,
                prefix,
                batch,
            )
        ]

    def key_ids(self) -> dict[str | None, int]:
        """Stored heads and messages per key id (None: not sealed)."""
        counts: dict[str | None, int] = {}
        for column, table in (("head", "sessions"), ("body", "messages")):
            rows = self.q(
                f"SELECT CASE WHEN substr({column}, 1, 5) = 'tbe1.' THEN substr({column}, 6, "  # noqa: S608 - constant text
                f"instr(substr({column}, 6), '.') - 1) END, count(*) "
                f"FROM touba_history_{table} WHERE {column} IS NOT NULL GROUP BY 1"
            )
            for key_id, n in rows:
                counts[key_id] = counts.get(key_id, 0) + n
        return counts


class _Backend:
    """The protocol's primitives (:class:`touba.history._backend.Backend`): each one
    call to the store's thread."""

    driver_errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)
    label = _LABEL
    drops = True  # save honours Write.dropped
    drops_unreserved = True  # and save_if, checking what it deletes

    def __init__(self, store: SqliteHistoryStore) -> None:
        self._store = store

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """See :meth:`touba.history._backend.Backend.reserve`."""
        store = self._store
        try:
            return await store._run(key, lambda: store._db.reserve(key, reservation, read))
        except asyncio.CancelledError:
            # The reservation may be taken anyway: free it right after (same thread, in order).
            token = reservation.token
            store._thread.submit(lambda: store._call(key, lambda: store._db.release(key, token)))
            raise
        # Any other failure rolled the reservation's transaction back: nothing is held.

    async def peek(self, key: str, read: Read) -> Reserved | None:
        """``reserve``'s read without a reservation, for an operation that only reads
        (see :meth:`_Db.peek`): one transaction, which renews the expiry."""
        store = self._store
        return await store._run(key, lambda: store._db.peek(key, read))

    async def save(self, key: str, token: str, write: Write) -> None:
        """See :meth:`touba.history._backend.Backend.save`."""
        store = self._store
        await store._run(key, lambda: store._db.save(key, token, write))

    async def save_if(
        self, key: str, version: str, head: str, token: str, write: Write, seen: Seen | None
    ) -> bool:
        """See ``save_if`` in :mod:`touba.history._backend`."""
        store = self._store
        return await store._run(key, lambda: store._db.save_if(key, version, head, token, write))

    async def delete(self, key: str, token: str) -> None:
        """See :meth:`touba.history._backend.Backend.delete`."""
        store = self._store
        await store._run(key, lambda: store._db.delete_reserved(key, token))

    async def release(self, key: str, token: str) -> None:
        """See :meth:`touba.history._backend.Backend.release`."""
        store = self._store
        await store._run(key, lambda: store._db.release(key, token))

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        """See :meth:`touba.history._backend.Backend.read_sizes`."""
        store = self._store
        return await store._run(key, lambda: store._db.sizes(key, start, stop))

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        """See :meth:`touba.history._backend.Backend.read_rows`."""
        store = self._store
        return await store._run(key, lambda: store._db.rows(key, start, stop))


class SqliteHistoryStore(AsyncClosing):
    """SQLite store: durable, shared by processes, bounded, refusing when full.

    Give exactly one of ``filename`` or ``database``. With ``filename``, the
    location is checked, the file is created or reset to 0600 and its ``-wal``,
    ``-shm`` and ``-journal`` companions that exist are reset to 0600 before SQLite
    opens them (those SQLite creates get the file's mode:
    :mod:`touba.history._files`); the directory is not created: make it
    yourself, mode 0700. ``database`` is an open ``sqlite3.Connection`` made
    with ``check_same_thread=False`` that only this store uses until
    ``close()``; its pragmas, closing and file protection are the
    application's. ``create=False`` (with ``filename``) opens an existing store
    only: a missing file, or one holding no touba history store, raises
    ``ConfigurationError`` and nothing is created or changed (a file of an older
    schema version is still migrated on opening).

    The file is opened at construction (blocking briefly). A reservation
    outlives a crashed worker: the key answers ``DecisionHistoryBusy`` until
    ``recover(key, worker_stopped=True)``. Reserving a key that has no record
    claims its place among ``max_sessions`` at once; when every place is held
    (records and such reservations), it raises ``DecisionHistoryLimitExceeded``
    before the operation runs. Expired conversations are purged as the
    module docstring says (not a secure erase); ``purge_expired()`` does it
    now. Each store object keeps the parsed tails of the conversations it
    decided lately (:mod:`touba.history._tail_cache`: bounded, checked against
    the stored version at every reservation). Its ``transact_log`` honours
    ``LogWrite.drop_last`` (the newest messages deleted, in the save's
    transaction).

    ``encryption`` (a :class:`touba.Encryption`, ``touba[crypto]``) seals every head
    and message body at rest with AES-GCM, bound to this store's table, the
    conversation's key, the field and the message's position
    (:mod:`touba.history._sealed`); keys, identity, namespace, sizes (plaintext
    bytes), times and reservations stay plaintext. A value that does not open
    (plaintext, altered, moved, an unknown key) is refused with
    ``DecisionHistoryRecordInvalid``; so is a sealed value in a store opened
    without ``encryption``. Without it nothing is encrypted.
    """

    log_drops = True

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
        create: bool = True,
        encryption: Encryption | None = None,
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
        self._clock = clock
        self.encryption = check_encryption(encryption)
        self._sealer = None if encryption is None else Sealer(encryption, "touba_history", _LABEL)
        self._rekeying = Rekeying()
        self._owns_connection = database is None
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        # One thread owns the connection and runs every SQLite call, in order.
        self._thread = OwnedThread("touba-sqlite")
        try:
            self._db = self._thread.call(lambda: self._open(filename, database, create))
        except BaseException:
            self._thread.shutdown()
            raise
        backend = _Backend(self)
        self._reservations = Reservations(
            backend if self._sealer is None else sealed_backend(backend, self._sealer),
            self.worker_id,
        )

    def _open(
        self,
        filename: str | os.PathLike[str] | None,
        conn: sqlite3.Connection | None,
        create: bool,
    ) -> _Db:
        try:
            if conn is None:
                assert filename is not None
                if not create:
                    require_sqlite_store(
                        filename, "history", "SqliteHistoryStore", "decision history"
                    )
                conn = open_private_sqlite(
                    filename,
                    timeout=BUSY_TIMEOUT_SECONDS,
                    check=check_schema,
                    page_size=PAGE_SIZE,
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
            init_schema(conn)
            return _Db(conn, self)
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
        return await self._thread.run(lambda: self._call(key, job))

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
            return await self._reservations.transact(key, operation)

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact`` for the history layer: the head, the tail, appends only.

        Two calls to the store's thread (reserve, save) when this store object
        holds the conversation's tail or read as much of it lately. Raises as
        :meth:`transact` does.
        """
        check_key(key)
        with self._using():
            return await self._reservations.transact_log(key, operation)

    async def transact_log_optimistic(
        self, key: str, operation: LogOperation[T], *, drops: bool = False
    ) -> T:
        """``transact_log`` for an operation that may run twice (it only reads its
        snapshot and returns a write: a session's append or read, never a decision).

        When this store object holds the conversation's tail, the operation runs on
        it and its write is saved in one call to the store's thread, one commit, if
        the conversation is still at that version, unreserved and unexpired; else
        it runs again through :meth:`transact_log` (see
        ``touba.history._reservations.Reservations.transact_log_optimistic``). Raises as
        :meth:`transact_log` does.
        """
        check_key(key)
        with self._using():
            return await self._reservations.transact_log_optimistic(key, operation, drops=drops)

    async def read_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact_log`` for an operation that only reads its snapshot (its write is
        None or the unchanged head: a session's ``get_items``), without a reservation:
        a worker that dies inside it leaves nothing to recover.

        One atomic read of what a reservation would read (the cached tail's version
        honoured: then no message is sent) that renews the expiry, made again wider
        when the operation asks for more; each read is one consistent state (see
        ``touba.history._reservations.Reservations.read_log``).
        ``DecisionHistoryBusy`` while the key is held; raises as :meth:`transact_log`.
        """
        check_key(key)
        with self._using():
            return await self._reservations.read_log(key, operation)

    async def read(self, key: str, *, purge: bool = True) -> Record | None:
        """A detached copy of the record, or None if absent or expired (TTL not renewed).

        ``DecisionHistoryBusy`` while reserved; ``DecisionHistoryStoreUnavailable``
        when the file cannot be read. It never purges: ``purge`` is accepted for
        :class:`~touba.history._store.AdminStore`'s sake."""
        check_key(key)
        with self._using():
            return await self._run(key, lambda: self._db.read(key))

    async def read_saved(self, key: str) -> Record | None:
        """The record as last saved, even while a reservation holds ``key`` (what a
        holder that crashes would leave; ``touba copy --include-active`` copies it).

        None if absent, expired or only reserved (no record yet). Writes nothing,
        purges nothing. ``DecisionHistoryStoreUnavailable`` when the file cannot be
        read."""
        check_key(key)
        with self._using():
            return await self._run(key, lambda: self._db.read(key, held=True))

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; ``DecisionHistoryBusy`` if it is reserved (a
        reservation of this store object's that a failure left is released first),
        ``DecisionHistoryStoreUnavailable`` (nothing deleted) when the disk fails."""
        check_key(key)
        with self._using():
            await self._reservations.settle(key)
            return await self._run(key, lambda: self._db.delete(key))

    async def erase(self, keys: Collection[str]) -> int:
        """Delete the conversations ``keys`` (those absent skipped) in one transaction whose
        deleted bytes SQLite overwrites (``PRAGMA secure_delete``), then checkpoint the
        WAL so that it keeps no copy either (when no other connection is reading): what
        ``touba.erase_user`` uses. Returns how many were deleted. ``DecisionHistoryBusy``
        (nothing deleted) when one is reserved: recover it first;
        ``DecisionHistoryStoreUnavailable`` (nothing deleted) when the disk fails."""
        if isinstance(keys, str) or not isinstance(keys, Collection):
            raise ConfigurationError("keys must be a collection of session keys, not one str")
        ordered = list(dict.fromkeys(keys))
        for key in ordered:
            check_key(key)
        with self._using():
            return await self._run("", lambda: self._db.erase(ordered))

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation left by a stopped worker; the saved record is kept as is.

        True when a reservation was freed. ``DecisionHistoryStoreUnavailable``
        when it cannot be written (retry once the disk works)."""
        require_worker_stopped(worker_stopped)
        check_key(key)
        with self._using():
            return recovered(key, await self._run(key, lambda: self._db.recover(key)))

    async def read_raw(self, key: str) -> RawConversation | None:
        """The conversation as stored (head and row texts, the store's totals), or None
        when absent or expired: it refuses nothing, a reserved conversation included
        (``active`` says so), and changes nothing. For :func:`~touba.history.check_record`.
        ``DecisionHistoryStoreUnavailable`` when the file cannot be read.
        On an encrypted store each value comes opened in its place; one that does
        not open is never read as plaintext: it stays as text that is not JSON, an
        unreadable row (an unopened head: an unrepairable conversation), and
        ``missing_keys`` names the key ids it was sealed with that were not given."""
        check_key(key)
        with self._using():
            return await self._run(key, lambda: self._db.read_raw(key))

    async def repair(self, plan: RepairPlan) -> bool:
        """Write ``plan`` (:func:`~touba.history.plan_repair`) in one transaction under a
        reservation; True when it changed the conversation, False when the plan
        changes nothing. ``DecisionHistoryBusy`` (nothing written) when the
        conversation is reserved, or changed since ``plan`` was computed;
        ``DecisionHistoryLimitExceeded`` when the repaired record would not fit."""
        check_key(plan.key)
        with self._using():
            return await write_repair(self._reservations, self.read_raw, plan)

    async def purge_expired(self) -> int:
        """Delete expired, unreserved conversations now; return how many."""
        with self._using():
            return await self._run("", self._db.purge)

    async def usage(self, *, purge: bool = True) -> StoreUsage:
        """How full the store is now, over every process sharing the file.

        ``sessions`` counts stored conversations plus reservations of keys that
        have no record yet (a crashed worker's included, until ``recover``);
        ``bytes`` what the records retain (UTF-8 JSON of heads and messages).
        Expired conversations are purged first; with ``purge=False`` nothing is
        written and they are counted.
        """
        with self._using():
            return await self._run("", lambda: self._db.usage(purge))

    async def list(
        self, namespace: str | None = None, *, purge: bool = True
    ) -> list[StoredConversation]:
        """Sizes and reservations, never content. A key reserved before its first
        save has no identity yet: it is listed only when ``namespace`` is None.
        Expired conversations are purged first; with ``purge=False`` nothing is
        written and they are listed with ``expired=True``."""
        with self._using():
            return await self._run("", lambda: self._db.listing(namespace, purge))

    async def list_recent(
        self, *, limit: int, offset: int = 0
    ) -> tuple[builtins.list[StoredConversation], int]:
        """A page of the conversations held or not expired, the most recently updated
        first (a bare reservation by when it was taken): ``limit`` of them from
        ``offset``, and how many there are in all. Writes nothing. For the panel,
        which must not read every conversation to show 50."""
        if limit < 0 or offset < 0:
            raise ConfigurationError(f"limit and offset must be >= 0, got {limit}, {offset}")
        with self._using():
            return await self._run("", lambda: self._db.recent(limit, offset))

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with ``encryption.current`` up to ``batch`` conversations holding a
        value sealed with another key (or not sealed), each in one reservation of its
        own, so a concurrent writer waits or is refused busy, never lost; return how
        many were re-sealed, 0 when a whole pass re-sealed nothing (what is left is
        in use or does not open).

        Resumable: what was re-sealed stays so; a new store object starts over and
        finds only what is left. A conversation in use is skipped (a later call takes
        it); one that does not open is skipped and logged (repair it first). The
        expiry of a re-sealed conversation is renewed, as any save does.
        ``ConfigurationError`` without ``encryption`` or for a bad ``batch``.
        A value that is not sealed does not open: encrypt a plaintext store by
        copying it into a new encrypted one."""
        sealer = require_sealer(self._sealer, batch)
        with self._using():

            async def stale(after: str) -> tuple[list[str], str]:
                keys = await self._run("", lambda: self._db.stale(sealer.prefix, after, batch))
                return keys, keys[-1] if keys else ""

            return await self._rekeying.run(stale, self._reservations.transact, _LABEL)

    async def key_ids(self) -> dict[str | None, int]:
        """How many stored heads and messages each key id sealed (``None``: values not
        sealed), for a rotation's progress. Reads every row: not for a decision."""
        with self._using():
            return await self._run("", self._db.key_ids)

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
            self._thread.shutdown()
