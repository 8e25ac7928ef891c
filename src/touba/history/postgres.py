"""``PostgresHistoryStore``: conversations in PostgreSQL, shared by many workers.

Four tables derived from ``table`` (``<table>``: a row per key, its head and
its reservation; ``_messages``; ``_usage``: the capacity counters; ``_meta``):
their layout and every statement are :mod:`touba.history._pg_sql`'s.

No transaction stays open while ``operation`` runs. The reservation protocol is
:mod:`touba.history._reservations`'s and the tail cache
:mod:`touba.history._tail_cache`'s; this module gives the protocol its
primitives. A decision takes two transactions of one statement each, sent alone
on the store's own pool (autocommit: one round trip each, not three; in a READ
COMMITTED transaction on a pool given by the host): the reservation (refusing
at once with ``DecisionHistoryBusy`` when the key is reserved), which also
reads the usage and, unless this store object holds the conversation's tail at
the stored version, the tail as far back as the history layer read lately
(older exchanges, when asked, are read separately); then one statement saves
the head if its token still matches, stores the token as the version (unless
the rows were edited meanwhile), takes the growth from its shard's room,
appends the messages and releases. Reserving a stored, live conversation
updates its row only; a cache hit returns that row and no message. A session
operation on a cached tail is one statement without a reservation (``save_if``;
a pop's deletes the newest rows only if they are as many, and weigh as much, as
the tail says); when it only renews the expiry (a read: the head unchanged,
nothing added) its transaction commits with ``synchronous_commit = off``: a
server crash may undo the renewal, which leaves the conversation expiring when
it did before. A crash leaves the reservation in place: the key answers
``DecisionHistoryBusy`` until ``recover(key, worker_stopped=True)``. Expiry
uses the server's clock.

Capacity without a store-wide lock on every write (escrow): every committed
state keeps, for each limit the shards' room was shared out under, the sum over
shards of (what is held + room) equal to that limit. A write that grows (a new
key's place, a save's bytes) takes the growth from the room of one shard in
its own transaction, under that row's lock and only when the room was shared
out under limits no larger than its own; what a statement frees goes back to
a shard's room. Each keeps the sum, so whatever commits in whatever order,
what is held never exceeds the limit: two writers racing for the last place or
the last bytes cannot both fit. The shard is one that no other transaction
holds (``FOR UPDATE SKIP LOCKED``, the key's own first), for the growth and
for the triggers counting the change alike, so writers of different keys
never wait for each other, whatever their keys hash to (measured: 0 waits of
one conversation on another with 8 at once, ``tests/history/test_pg_no_queue.py``).
A growth that no free shard has room for is checked exactly instead: under an
exclusive advisory lock that every writer of the counters holds shared (taken
before its row locks, so there are no deadlocks), the transaction sees the
exact sums, refuses the write if it does not fit, and otherwise shares out all
that is free again. That happens on the first writes, when limits differ
between workers, and near the limits, where rooms run short; a refusal is made
only after expired rows were purged.

Expired, unreserved rows no other transaction holds are purged at most once a
minute per store object, and after each reservation while the store is 80%
full (so the usage an operation is given, and pressure events, leave them
out), in a transaction of their own; an expired, unreserved conversation is
also purged when its key is accessed. ``read``, ``list`` and ``usage`` with
``purge=False`` delete nothing (the read-only commands use them).

Errors: a connection or schema problem met while opening raises
``ConfigurationError`` chained to the driver error; a driver failure during
use (server gone, broken connection, pool timeout or closed by its owner)
raises ``DecisionHistoryStoreUnavailable``, chained, and whatever it
interrupted is in the state the transaction semantics leave it. The pool,
the schema check and that conversion are shared with the runtime's
PostgreSQL stores (:mod:`touba.history._pg`).
"""

from __future__ import annotations

import builtins
import json
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

try:
    import psycopg  # noqa: F401 - imported first so that a missing driver names the extra
    from psycopg import sql
    from psycopg_pool import AsyncConnectionPool
except ImportError as e:  # pragma: no cover - exercised in a test with psycopg hidden
    raise ImportError(
        'touba.history.postgres needs psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba._encryption import Encryption
from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
    ToubaError,
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
    recovered,
    require_worker_stopped,
)
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._pg import FAILURES, OwnedPool, PooledStore, Schema, table_parts
from touba.history._pg import Conn as _Conn
from touba.history._pg import row as _row
from touba.history._pg import rows as _rows
from touba.history._pg import run as _run
from touba.history._pg_sql import SCHEMA_VERSION, SHARDS, Statements, statements
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
from touba.history._store import (
    LogOperation,
    Operation,
    Record,
    StoredConversation,
    StoreUsage,
)

__all__ = ["PostgresHistoryStore"]

T = TypeVar("T")

PURGE_INTERVAL: Final = 60.0  # seconds between purges of every expired row, per store object
PURGE_NEAR_FULL: Final = 0.8  # ... or at each access while the store is this full
ALL_EXCHANGES: Final = 2**31 - 1  # read by transact: every exchange
_LABEL = "PostgreSQL"


# -- small helpers -----------------------------------------------------------------------


async def _held(conn: _Conn, s: Statements, key: str) -> Exception:
    """``DecisionHistoryBusy`` naming who holds ``key``, to find a crashed worker."""
    row = await _row(conn, s.holder, (key,))
    if row is None or row[0] is None:
        return busy(key)
    worker_id, pid, host, since = row
    return busy(key, f" (worker {worker_id}, pid {pid} on {host}, since {_iso(since)})")


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


def _decode(
    key: str, head: str | None, split: bool, rows: Rows, sealer: Sealer | None = None
) -> Record | None:
    """A stored record from its head and its ``(exchange, bytes, body)`` rows (opened
    first when the store is encrypted)."""
    if head is None:
        return None
    if sealer is not None:
        head, rows = sealer.open_stored(key, head, rows)
        assert head is not None
    record = parse_object(head, key, "the stored record", _LABEL)
    if not split:
        return record
    exchanges: list[list[Record]] = []
    for exchange, _size, body in rows:
        while len(exchanges) <= exchange:
            exchanges.append([])
        exchanges[exchange].append(parse_object(body, key, "a message", _LABEL))
    return join_record(record, exchanges)


def _columns(rows: Sequence[tuple[int, int, int, str]]) -> tuple[list[Any], ...]:
    """(seq, exchange, bytes, body) rows as four arrays, for ``unnest``."""
    return tuple(list(column) for column in zip(*rows, strict=True)) or ([], [], [], [])


def _reach(read: Read) -> tuple[int, int]:
    """How many trailing exchanges' sizes, and bodies, ``read`` asks for."""
    if read.whole:
        return ALL_EXCHANGES, ALL_EXCHANGES
    return read.sizes, read.bodies


# -- the primitives ----------------------------------------------------------------------


class _Backend:
    """The protocol's primitives (:class:`touba.history._backend.Backend`): each one
    transaction, of one statement on the common path."""

    driver_errors: tuple[type[BaseException], ...] = FAILURES
    label = _LABEL
    drops = True  # save honours Write.dropped
    drops_unreserved = True  # and save_if, checking what it deletes

    def __init__(self, store: PostgresHistoryStore) -> None:
        self._store = store
        self._sql = store._sql

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """Reserve ``key`` in its own committed transaction, or refuse at once."""
        try:
            async with self._store._pg.round():  # one deadline for the whole reservation
                return await self._reserve(key, reservation, read)
        except ToubaError as e:
            if isinstance(e, DecisionHistoryStoreUnavailable):  # the commit may have happened
                await self._release_after(e, key, reservation.token)
            raise  # refused: nothing was reserved
        except BaseException as e:  # the commit may have happened: do not leave the key held
            await self._release_after(e, key, reservation.token)
            raise

    async def _reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        store, s = self._store, self._sql
        holder = (
            reservation.token,
            reservation.worker_id,
            reservation.pid,
            reservation.host,
            datetime.fromtimestamp(reservation.since, UTC),
        )
        sizes, bodies = _reach(read)
        # A live conversation keeps its place: reserving it updates its row only,
        # and reads the usage and the tail (or every message) in the same statement.
        async with store._statement() as conn:
            found = await _rows(
                conn,
                s.claim_live,
                (*holder, holder[0], key, key, read.cached, sizes, bodies, bodies),
            )
        if found:
            _, exchanges, messages, size, head, split, version, sessions, used = found[0]
            hit = read.cached is not None and read.cached == version
            reserved = Reserved(
                head,
                split,
                exchanges if split else 0,
                messages,
                size,
                version,
                store._usage_of(sessions, used),
                None if hit else [(r[1], r[2], r[3]) for r in found if r[0] == 1],
                None if hit else [(r[1], r[3], r[4]) for r in found if r[0] == 2],
            )
        else:
            # A new key (or an expired or held one), in a transaction of its own:
            # the UPDATE above may keep a lock on a row it rechecked without updating.
            reserved = await store._in_room(
                lambda exact: self._reserve_new(key, holder, read, exact)
            )
        if store._purge_wanted(reserved.usage):
            # The operation is given the usage without expired rows; ours is reserved.
            await store._purge()
            async with store._transaction() as conn:
                reserved = replace(reserved, usage=await store._usage(conn))
        return reserved

    async def peek(self, key: str, read: Read) -> Reserved | None:
        """What ``reserve`` reads, without reserving, for an operation that only
        reads: one statement (one snapshot) that renews the expiry, as a save of the
        unchanged head would. Raises ``DecisionHistoryBusy`` while the key is held;
        a ``Reserved`` with no head when nothing live is stored (nothing written);
        None for a record that only a reservation reads (not split)."""
        store, s = self._store, self._sql
        if read.whole:
            return None
        sizes, bodies = read.sizes, read.bodies
        params = (key, store.ttl_seconds, read.cached, sizes, bodies, read.cached, bodies)
        async with store._statement() as conn:
            found = await _rows(conn, s.peek, params)
        if not found:
            return Reserved(None, False, 0, 0, 0, None, await self._usage_now())
        _, exchanges, messages, size, head, split, version, held, gone, sessions, used = found[0]
        if held:
            raise busy(key)
        usage = store._usage_of(sessions, used)
        if gone:
            return Reserved(None, False, 0, 0, 0, None, usage)
        if not split:
            return None
        hit = read.cached is not None and read.cached == version
        return Reserved(
            head,
            True,
            exchanges,
            messages,
            size,
            version,
            usage,
            None if hit else [(r[1], r[2], r[3]) for r in found if r[0] == 1],
            None if hit else [(r[1], r[3], r[4]) for r in found if r[0] == 2],
        )

    async def _usage_now(self) -> StoreUsage:
        store = self._store
        async with store._transaction() as conn:
            return await store._usage(conn)

    async def _reserve_new(
        self, key: str, holder: tuple[Any, ...], read: Read, exact: bool
    ) -> Reserved:
        """Reserve a key that had no live, unreserved row: a new key takes a place."""
        store, s = self._store, self._sql
        async with store._transaction() as conn:
            if exact:
                await _run(conn, s.lock_exclusive)
            await _run(conn, s.purge_key, (key,))
            row = await _row(conn, s.claim, (key, *holder, holder[0]))
            if row is None:
                raise await _held(conn, s, key)
            head, split, exchanges, messages, size, version = row
            new = head is None  # a new row: its place comes from its shard's seats
            if new and not exact and not await _run(conn, s.take_seat, (store.max_sessions, key)):
                raise _NoRoom
            usage = await store._usage(conn)
            if new and exact:  # our new row is counted: refuse one too many
                check_sessions(usage.sessions - 1, store.max_sessions)
                await store._share(conn, usage)
            if head is None:
                return Reserved(None, False, 0, 0, 0, version, usage)
            count = exchanges if split else 0
            if not split or (read.cached is not None and read.cached == version):
                return Reserved(head, split, count, messages, size, version, usage, [], [])
            sizes, bodies = _reach(read)
            first = max(0, count - bodies)
            found_sizes = await _rows(conn, s.range_sizes, (key, max(0, count - sizes), first))
            found_rows = await _rows(conn, s.range_rows, (key, first, ALL_EXCHANGES))
            return Reserved(
                head, split, count, messages, size, version, usage, found_sizes, found_rows
            )

    async def save(self, key: str, token: str, write: Write) -> None:
        """Check token and capacity, then write, in one transaction."""
        async with self._store._pg.round():  # one deadline, whatever _in_room retries
            await self._store._in_room(lambda exact: self._save(key, token, write, exact))

    async def _save(self, key: str, token: str, write: Write, exact: bool) -> None:
        store, s = self._store, self._sql
        if not write.rewrite and not write.dropped and not exact:
            return await self._append(key, token, write)
        async with store._transaction() as conn:
            if exact:
                await _run(conn, s.lock_exclusive)
            current = await _row(conn, s.lock_row, (key,))
            if current is None or current[0] != token:
                raise _recovered(key)
            if write.rewrite and current[4]:
                await _run(conn, s.delete_messages, (key,))
            elif write.dropped:  # LogWrite.drop_last: the newest messages go first
                deleted = await _run(conn, s.drop_messages, (key, write.kept))
                if deleted != write.dropped:
                    raise dropped_elsewhere(key, _LABEL, deleted, write.dropped)
            saved = (
                write.namespace,
                write.identity,
                write.head,
                write.split,
                write.exchanges,
                write.messages,
                write.bytes,
                store.ttl_seconds,
                write.rewrite,
                write.seen,
                key,
            )
            growth = write.bytes - int(current[5])
            if exact or growth <= 0:
                await _run(conn, s.save, saved)
            elif not await _run(conn, s.save_in_room, (growth, store.max_store_bytes, key, *saved)):
                raise _NoRoom
            if exact:  # this transaction alone changes the counters now: their sum is exact
                usage = await store._usage(conn)
                check_capacity(
                    is_new=current[1] is None,
                    sessions=usage.sessions - 1,
                    max_sessions=store.max_sessions,
                    store_bytes_after=usage.bytes,
                    max_store_bytes=store.max_store_bytes,
                )
                await store._share(conn, usage)
            if write.rows:
                await _run(conn, s.insert_messages, (key, *_columns(write.rows)))

    async def _append(self, key: str, token: str, write: Write) -> None:
        """A log write in one statement, a transaction by itself, within its shard's
        room (``_NoRoom``, nothing written, if not)."""
        held, saved = await self._appended(self._sql.append, key, (token,), write, write.seen)
        if not held:
            raise _recovered(key)
        if not saved:
            raise _NoRoom

    async def save_if(
        self, key: str, version: str, head: str, token: str, write: Write, seen: Seen | None
    ) -> bool:
        """A log write without a reservation, one statement: saved (the version then
        ``token``) only if ``key`` is unreserved, live, at ``version`` and holds the
        head text ``head``, and the write fits its shard's room; else False and
        nothing changed (the reserved path then decides, with the exact sums when
        room is short)."""
        if write.rewrite or (write.dropped and write.rows):
            return False  # the reserved path's
        renewal = write.renews(head)  # a read
        statement = self._sql.renew_unreserved if renewal else self._sql.append_unreserved
        holds: tuple[Any, ...] = (version, head)
        if write.dropped:  # a pop: the rows it deletes must be those the write weighed
            statement = self._sql.drop_unreserved
            holds += (key, write.kept, write.dropped, write.dropped_bytes, key, write.kept)
        held, saved = await self._appended(statement, key, holds, write, token)
        return bool(held and saved)

    async def _appended(
        self,
        statement: bytes,
        key: str,
        holds: tuple[Any, ...],
        write: Write,
        version: str | None,
    ) -> tuple[int, int]:
        """Run ``append`` (``holds``: the reservation's token, ``version``: the one it
        saw) or an ``*_unreserved`` statement (``holds``: the version and head the row
        must have, and a drop's weights; ``version``: the new one): (rows held, rows
        saved)."""
        store, growth = self._store, write.growth
        async with store._statement() as conn:
            row = await _row(
                conn,
                statement,
                (
                    key,
                    *holds,
                    growth,
                    store.max_store_bytes,
                    key,
                    write.namespace,
                    write.identity,
                    write.head,
                    write.exchanges,
                    write.messages,
                    write.bytes,
                    store.ttl_seconds,
                    version,
                    growth,
                    key,
                    *_columns(write.rows),
                ),
            )
        assert row is not None
        held, saved = row
        return int(held), int(saved)

    async def delete(self, key: str, token: str) -> None:
        """Delete the reserved record: one statement."""
        async with self._store._statement() as conn:
            if not await _run(conn, self._sql.delete_reserved, (key, token)):
                raise _recovered(key)

    async def release(self, key: str, token: str) -> None:
        """Give the key back untouched (a bare reservation row goes away): one
        statement, or two for a key with a record, each a transaction by itself
        (each acts only while ``token`` holds the key)."""
        async with self._store._statement() as conn:
            if not await _run(conn, self._sql.release_bare, (key, token)):
                await _run(conn, self._sql.release, (key, token))

    async def _release_after(self, error: BaseException, key: str, token: str) -> None:
        try:
            await self.release(key, token)
        except Exception as e:
            error.add_note(
                f"touba: could not release the reservation of {key} ({e!r}); if it was taken, "
                "this store object releases it before its next operation on the key (else "
                "recover(key, worker_stopped=True))"
            )

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        if start >= stop:
            return []
        async with self._store._statement() as conn:
            return await _rows(conn, self._sql.range_sizes, (key, start, stop))

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        if start >= stop:
            return []
        async with self._store._statement() as conn:
            return await _rows(conn, self._sql.range_rows, (key, start, stop))


# -- the store ---------------------------------------------------------------------------


class PostgresHistoryStore(PooledStore):
    """PostgreSQL store: durable reservations, bounded, expiring, refusing when full.

    Give exactly one of ``dsn`` (the store creates, opens and closes its own
    pool of 1 to 4 connections) or ``pool`` (an ``AsyncConnectionPool`` you
    open and close). Tables are created on first use, or by
    ``await store.open()``; with ``create=False`` missing tables raise
    ``ConfigurationError`` there instead, and nothing is created (an older schema
    version is still migrated). Defaults: 128 conversations, 32 MiB, 24 hours of
    inactivity. ``worker_id`` names this worker in reservations (default
    ``host:pid``), so an operator can find a crashed one. Reserving a key that
    has no record claims its place among ``max_sessions`` at once; when every
    place is held (records and such reservations), it raises
    ``DecisionHistoryLimitExceeded`` before the operation runs. Each store
    object keeps the parsed tails of the conversations it decided lately
    (:mod:`touba.history._tail_cache`: bounded, checked against the stored
    version at every reservation). Its ``transact_log`` honours
    ``LogWrite.drop_last`` (the newest messages deleted, in the save's
    transaction).

    ``encryption`` (a :class:`touba.Encryption`, ``touba[crypto]``) seals every head
    and message body at rest with AES-GCM, bound to ``table``, the conversation's
    key, the field and the message's position (:mod:`touba.history._sealed`); keys,
    identity, namespace, sizes (plaintext bytes), times and reservations stay
    plaintext. A value that does not open (plaintext, altered, moved, an unknown
    key) is refused with ``DecisionHistoryRecordInvalid``; so is a sealed value in
    a store opened without ``encryption``. Without it nothing is encrypted.

    ``deadline_seconds`` (default 10) bounds each store step: a reservation, a
    save, a release, a read, each waiting for a connection and every statement
    included. A network that goes silent fails the step with
    ``DecisionHistoryStoreUnavailable`` (retryable) within it; the release a
    failure triggers gets what is left of the failed step's deadline (see
    :mod:`touba.history._pg`). A reservation whose reply was lost stays, as a
    crashed worker's does, until ``recover``.
    """

    log_drops = True

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        table: str = "touba_history",
        max_sessions: int = 128,
        max_store_bytes: int = 32 * MiB,
        ttl_seconds: float = 86400,
        worker_id: str | None = None,
        create: bool = True,
        encryption: Encryption | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        parts = table_parts(table, example="touba_history")
        check_limits_config(
            max_sessions=max_sessions, max_store_bytes=max_store_bytes, ttl_seconds=ttl_seconds
        )
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
            raise ConfigurationError(f"worker_id must be a non-empty str, got {worker_id!r}")
        self._sql = statements(parts)
        self._pg = OwnedPool(
            "PostgresHistoryStore",
            dsn=dsn,
            pool=pool,
            schema=Schema.of(
                parts,
                self._sql.create,
                version=SCHEMA_VERSION,
                what="history",
                mismatch=DecisionHistoryRecordInvalid,
                migrations={
                    1: [],
                    2: self._sql.upgrade_to_3,
                    3: self._sql.upgrade_to_4,
                    4: self._sql.upgrade_to_5,
                    5: self._sql.upgrade_to_6,
                },
            ),
            unavailable=_unavailable,
            create=create,
            deadline=deadline_seconds,
        )
        self.deadline_seconds = self._pg.deadline
        self.table = table
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = float(ttl_seconds)
        self.worker_id = worker_id
        self._purged_at = -math.inf  # time.monotonic() of this object's last full purge
        self.encryption = check_encryption(encryption)
        self._sealer = None if encryption is None else Sealer(encryption, table, _LABEL)
        self._rekeying = Rekeying()
        backend = _Backend(self)
        self._reservations = Reservations(
            backend if self._sealer is None else sealed_backend(backend, self._sealer),
            worker_id or f"{socket.gethostname()}:{os.getpid()}",
        )

    def _using(self) -> AbstractAsyncContextManager[None]:
        """One public call: refused once closing, awaited by ``close()`` otherwise."""
        return self._pg.using()

    def _transaction(self) -> AbstractAsyncContextManager[_Conn]:
        """One transaction on a pooled connection (inside :meth:`_using`)."""
        return self._pg.transaction()

    def _statement(self) -> AbstractAsyncContextManager[_Conn]:
        """One statement that is a transaction by itself (see ``OwnedPool.statement``)."""
        return self._pg.statement()

    # -- capacity -----------------------------------------------------------------------

    def _usage_of(self, sessions: int, size: int) -> StoreUsage:
        return StoreUsage(int(sessions), self.max_sessions, int(size), self.max_store_bytes)

    async def _usage(self, conn: _Conn) -> StoreUsage:
        """The sum of the counters, as this transaction sees them."""
        row = await _row(conn, self._sql.usage)
        assert row is not None
        return self._usage_of(*row)

    async def _in_room(self, attempt: Callable[[bool], Awaitable[T]]) -> T:
        """``attempt(exact=False)``, within its shard's room; when that lacks room,
        ``attempt(exact=True)``, which checks the sums under the exclusive lock and
        shares out the room again; when that refuses, once more after purging
        expired rows, so that expired rows never refuse a write."""
        try:
            return await attempt(False)
        except _NoRoom:
            pass
        try:
            return await attempt(True)
        except DecisionHistoryLimitExceeded:
            if not await self._purge():
                raise
        return await attempt(True)

    async def _share(self, conn: _Conn, usage: StoreUsage) -> None:
        """Share what ``usage`` leaves free among the shards, under this store's
        limits; inside the transaction holding the exclusive lock."""
        free_sessions = self.max_sessions - usage.sessions
        free_bytes = self.max_store_bytes - usage.bytes
        seats, extra_seats = divmod(max(free_sessions, 0), SHARDS)
        room, extra_room = divmod(max(free_bytes, 0), SHARDS)
        await _run(
            conn,
            self._sql.share,
            (
                seats,
                extra_seats,
                room,
                extra_room,
                self.max_sessions if free_sessions >= 0 else None,
                self.max_store_bytes if free_bytes >= 0 else None,
            ),
        )

    def _purge_wanted(self, usage: StoreUsage) -> bool:
        """Purge every expired row now? Once a minute, or when the store is nearly full."""
        return (
            time.monotonic() - self._purged_at >= PURGE_INTERVAL
            or usage.fraction >= PURGE_NEAR_FULL
        )

    async def _purge(self) -> int:
        """Delete every expired, unreserved row no one has locked, in a transaction
        of its own; how many."""
        async with self._transaction() as conn:
            return await self._purge_in(conn)

    async def _purge_in(self, conn: _Conn) -> int:
        self._purged_at = time.monotonic()
        await _run(conn, self._sql.lock_shared)
        return await _run(conn, self._sql.purge_all)

    # -- the contract -------------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """``HistoryStore.transact`` under a durable reservation; raises
        ``DecisionHistoryBusy`` at once while another worker holds ``key``."""
        check_key(key)
        async with self._using():
            return await self._reservations.transact(key, operation)

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``LogStore.transact_log`` under a durable reservation; the save appends
        only the new messages (``drop_last`` honoured in the same transaction)."""
        check_key(key)
        async with self._using():
            return await self._reservations.transact_log(key, operation)

    async def transact_log_optimistic(
        self, key: str, operation: LogOperation[T], *, drops: bool = False
    ) -> T:
        """``transact_log`` for an operation that may run twice (it only reads its
        snapshot and returns a write: a session's append or read, never a decision).

        When this store object holds the conversation's tail, the operation runs on
        it and its write is saved in one statement if the conversation is still at
        that version, unreserved and live, and fits; else it runs again through
        :meth:`transact_log` (see
        ``touba.history._reservations.Reservations.transact_log_optimistic``). Raises as
        :meth:`transact_log` does.
        """
        check_key(key)
        async with self._using():
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
        async with self._using():
            return await self._reservations.read_log(key, operation)

    async def read(self, key: str, *, purge: bool = True) -> Record | None:
        """A detached copy, or None if absent or expired; the TTL is not renewed.

        An expired conversation is purged first, unless ``purge`` is False."""
        return await self._read(key, purge=purge, held=False)

    async def read_saved(self, key: str) -> Record | None:
        """The record as last saved, even while a reservation holds ``key`` (what a
        holder that crashes would leave; ``touba copy --include-active`` copies it).

        None if absent, expired or only reserved (no record yet). Deletes nothing."""
        return await self._read(key, purge=False, held=True)

    async def _read(self, key: str, *, purge: bool, held: bool) -> Record | None:
        check_key(key)
        s = self._sql
        async with self._pg.call() as conn:
            if purge:
                await _run(conn, s.purge_key, (key,))
            row = await _row(conn, s.read_row, (key,))
            if row is None:
                return None
            token, head, split, expired = row
            if token is not None and not held:
                raise await _held(conn, s, key)
            if expired or head is None:
                return None
            rows = await _rows(conn, s.all_messages, (key,)) if split else []
        return _decode(key, head, split, rows, self._sealer)

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; False when absent. ``DecisionHistoryBusy``
        while reserved (a reservation of this store object's that a failure left
        is released first)."""
        check_key(key)
        s = self._sql
        async with self._pg.using():
            await self._reservations.settle(key)
            async with self._pg.statement() as conn:  # unreserved: one statement
                deleted = await _row(conn, s.delete_unreserved, (key,))
            if deleted is not None:
                return bool(deleted[0])  # an expired one was purged: it was absent
            return await self._delete_held(key)

    async def _delete_held(self, key: str) -> bool:
        """``delete`` of a key found absent or reserved: which, in a transaction."""
        s = self._sql
        async with self._pg.transaction() as conn:
            await _run(conn, s.lock_shared)  # before the row lock: it deletes
            await _run(conn, s.purge_key, (key,))
            row = await _row(conn, s.delete_row, (key,))
            if row is None:
                return False
            if row[0] is not None:
                raise await _held(conn, s, key)
            await _run(conn, s.delete, (key,))
            return True

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation left by a crashed worker; the saved record is untouched."""
        require_worker_stopped(worker_stopped)
        check_key(key)
        async with self._pg.call() as conn:
            await _run(conn, self._sql.lock_shared)  # before the row lock: it may delete
            row = await _row(conn, self._sql.recover, (key,))
            if row is None:
                return False
            if row[0]:  # a bare reservation: the key had no record
                await _run(conn, self._sql.delete, (key,))
        return recovered(key, True)

    async def read_raw(self, key: str) -> RawConversation | None:
        """The conversation as stored (head and row texts, the table's totals), or
        None when absent or expired: it refuses nothing, a reserved conversation
        included (``active`` says so), and changes nothing (the head row is read
        ``FOR SHARE``, so the rows read after it are those of one save). For
        :func:`~touba.history.check_record`.
        On an encrypted store each value comes opened in its place; one that does
        not open is never read as plaintext: it stays as text that is not JSON, an
        unreadable row (an unopened head: an unrepairable conversation), and
        ``missing_keys`` names the key ids it was sealed with that were not given."""
        check_key(key)
        s = self._sql
        head_sql = sql.SQL(
            "SELECT head, split, exchanges, messages, bytes, token IS NOT NULL,"
            " coalesce(expires_at <= now(), false) FROM {t} WHERE key = %s FOR SHARE"
        ).format(t=s.table)
        async with self._pg.call() as conn:
            row = await _row(conn, head_sql, (key,))
            if row is None or row[0] is None or row[6]:
                return None
            head, split, exchanges, messages, size, active, _expired = row
            rows = await _rows(conn, s.all_messages, (key,)) if split else []
        raw = RawConversation(
            key,
            raw_text(head),
            bool(split),
            tuple(RawRow(raw_int(e), raw_int(b), raw_text(body)) for e, b, body in rows),
            exchanges if split else 0,
            messages,
            size,
            bool(active),
        )
        return raw if self._sealer is None else self._sealer.open_raw(raw)  # or not JSON

    async def repair(self, plan: RepairPlan) -> bool:
        """Write ``plan`` (:func:`~touba.history.plan_repair`) in one transaction under a
        reservation; True when it changed the conversation, False when the plan
        changes nothing. ``DecisionHistoryBusy`` (nothing written) when the
        conversation is reserved, or changed since ``plan`` was computed;
        ``DecisionHistoryLimitExceeded`` when the repaired record would not fit."""
        check_key(plan.key)
        async with self._using():
            return await write_repair(self._reservations, self.read_raw, plan)

    async def purge_expired(self) -> int:
        """Delete every expired, unreserved conversation now; returns how many."""
        async with self._using():
            return await self._purge()

    async def usage(self, *, purge: bool = True) -> StoreUsage:
        """How full the table is now, over every worker sharing it.

        ``sessions`` counts stored conversations plus reservations of keys that
        have no record yet (a crashed worker's included, until ``recover``);
        ``bytes`` what the records retain (UTF-8 JSON of heads and messages).
        Expired, unreserved conversations are not counted (they are purged
        first), unless ``purge`` is False: then nothing is deleted and they count.
        The figures are the sums of counters that triggers keep exact.
        """
        async with self._pg.call() as conn:
            if purge:
                await self._purge_in(conn)
            return await self._usage(conn)

    async def list(
        self, namespace: str | None = None, *, purge: bool = True
    ) -> list[StoredConversation]:
        """Sizes and reservations, never content. Bare reservations (a key that had no
        record when its worker crashed) are listed only without ``namespace``.
        Expired conversations are purged first; with ``purge=False`` nothing is
        deleted and they are listed with ``expired=True``."""
        s = self._sql
        async with self._pg.call() as conn:
            if purge:
                await self._purge_in(conn)
            if namespace is None:
                rows = await _rows(conn, s.list_all)
            else:
                rows = await _rows(conn, s.list_namespace, (namespace,))
        return [_listed(row) for row in rows]

    async def list_recent(
        self, *, limit: int, offset: int = 0
    ) -> tuple[builtins.list[StoredConversation], int]:
        """A page of the conversations held or not expired, the most recently updated
        first (a bare reservation by when it was taken): ``limit`` of them from
        ``offset``, and how many there are in all. Deletes nothing. For the panel,
        which must not read every conversation to show 50: a statement with
        ``LIMIT``, and one count, however many are stored (PostgreSQL still sorts
        the live rows to find the newest: a top-N sort, no index)."""
        if limit < 0 or offset < 0:
            raise ConfigurationError(f"limit and offset must be >= 0, got {limit}, {offset}")
        s = self._sql
        async with self._pg.call() as conn:
            rows = await _rows(conn, s.list_recent, (limit, offset))
            total = await _row(conn, s.count_recent)
        assert total is not None
        return [_listed(row) for row in rows], int(total[0])

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with ``encryption.current`` up to ``batch`` conversations holding a
        value sealed with another key, each in one reservation of its own (a
        concurrent writer waits or is refused busy, never lost); how many were
        re-sealed, 0 when a whole pass re-sealed nothing. See
        :meth:`touba.history.sqlite.SqliteHistoryStore.rekey`."""
        sealer = require_sealer(self._sealer, batch)
        async with self._using():

            async def stale(after: str) -> tuple[list[str], str]:
                async with self._pg.call() as conn:
                    found = await _rows(
                        conn, self._sql.stale, (after, sealer.prefix, sealer.prefix, batch)
                    )
                keys = [row[0] for row in found]
                return keys, keys[-1] if keys else ""

            return await self._rekeying.run(stale, self._reservations.transact, _LABEL)

    async def key_ids(self) -> dict[str | None, int]:
        """How many stored heads and messages each key id sealed (``None``: values not
        sealed), for a rotation's progress. Reads every row: not for a decision."""
        async with self._using(), self._pg.call() as conn:
            rows = await _rows(conn, self._sql.key_ids)
        return {key_id: int(n) for key_id, n in rows}


def _parsed_identity(text: str | None) -> dict[str, str] | None:
    """The identity column; a damaged one still lists its row, so it can be deleted."""
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _unavailable(e: Exception) -> DecisionHistoryStoreUnavailable:
    return DecisionHistoryStoreUnavailable(
        f"PostgreSQL failed ({type(e).__name__}: {e}). Check the server and retry; "
        "a conversation whose reservation could not be released is released by this "
        "store object's next operation on it, or by store.recover(key, worker_stopped=True)"
    )


def _listed(row: tuple[Any, ...]) -> StoredConversation:
    """A row of ``_LISTED`` as the store lists it."""
    key, identity, messages, size, updated, expires, active, *holder, expired = row
    worker_id, pid, host, since = holder
    return StoredConversation(
        key=key,
        identity=_parsed_identity(identity),
        messages=messages,
        bytes=size,
        updated_at=_iso(updated) or _iso(since) or "",
        expires_at=_iso(expires),
        active=active,
        reservation=(
            {"worker_id": worker_id, "pid": pid, "host": host, "since": _iso(since)}
            if active
            else None
        ),
        expired=bool(expired),
    )


class _NoRoom(Exception):
    """A growth its shard has no room for: the caller retries it exactly."""


def _recovered(key: str) -> Exception:
    return busy(key, " (its reservation was recovered while this one ran; nothing saved)")
