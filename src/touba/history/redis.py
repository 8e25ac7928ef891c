"""``RedisHistoryStore``: conversations in Redis, shared by many workers and hosts.

Layout. Every key starts with ``prefix`` followed by one hash tag for the whole
store (``{<10 hex of sha256(prefix)>}``), so the store lives in one cluster
slot: capacity is a store-wide bound checked atomically, which a Lua script can
only do over keys of one slot. (With a ``RedisCluster`` client, whose pipelines
refuse scripts, the claim's and the peek's scripts bring the rows themselves:
``tests/history/test_redis_cluster.py``.) A
conversation is named by the sha256 of its session key (``<id>``), so any
character (braces, colons, NUL, unicode) is safe in a session key and never
reaches a key name::

    P = prefix + "{tag}:"
    P + "sessions"              HASH  id -> bytes of its record (one field per record,
                                      "0" for a reserved key that has no record yet)
    P + "bytes"                 STR   total bytes of all records
    P + "expiry"                ZSET  id -> expires_at (ms, server clock); lazy purge
    P + "held"                  ZSET  id -> since (ms): reserved conversations
    P + "c:<id>:head"           HASH  key (JSON), head (JSON), split, messages, bytes,
                                      updated_at, expires_at, identity, namespace,
                                      last_token (the record's version: the token
                                      of the reservation that saved it); while
                                      reserved: token, worker_id, pid, host, since
    P + "c:<id>:messages"       LIST  one row per message: "[exchange,bytes,message]"
    P + "c:<id>:exchanges"      LIST  one entry per exchange: "first:count:bytes"

A touba record keeps its head in the head hash and its messages as rows; a
decision appends rows (RPUSH) and reads only the tail it needs; a
``LogWrite.drop_last`` trims the newest rows (LTRIM) in the same commit. The protocol
(reserve, save if the token still holds, release; the snapshot, the read-ahead
hints and the tail cache) is :mod:`touba.history._reservations`'s; this module gives
its primitives (:class:`_Backend`). The claim script returns, with the
reservation, the entries of the last exchanges the history layer weighed
lately, and an LRANGE pipelined after it (same round trip) the last rows of the
window it read lately plus what a decision appends; a read further back costs
a round trip. So a decision is two round trips, claim and commit, and what the
claim carries is bounded by the window, not by how far back anything was read.
A session's read of a window (``ToubaSession.get_items``) is one round trip
with no reservation: the peek script (the claim's read, renewing the expiry
instead of reserving) and the LRANGE of the rows in one MULTI.
Any other JSON dict is kept whole in ``head``. A record's version changes on
every touba save and never repeats, but another client's LSET or LREM of a row
leaves it as it was: the backend says so (``sees_edits = False``), so every
claim brings the window's rows and the shared cache reuses a parsed message
only while its stored text is byte-identical (content mode).

Every mutation is one Lua script (``lua/*.lua``, loaded by :mod:`touba.history._lua`),
so it is atomic; ``lua/_prelude.lua`` says what each checks, how they purge expired
conversations and keep time (Redis's ``TIME``) and how Redis's own key expiry
backs them up. Claim and commit are idempotent (same token), so a command that
redis-py retries after a timeout is harmless.
Needs Redis 5 or later (scripts that read ``TIME`` and then write).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from touba._closing import AsyncClosing
from touba._encryption import Encryption
from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryStoreUnavailable,
    ToubaError,
)
from touba.history import _redis_replies as replies
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
from touba.history._deadline import STORE_DEADLINE_SECONDS, check_deadline
from touba.history._lua import load
from touba.history._record import join_record
from touba.history._redis_client import bounded, no_answer, redis_client, slot_base
from touba.history._redis_durability import SETTINGS, durability_of
from touba.history._repair import RawConversation, RawRow, RepairPlan, raw_text
from touba.history._repair_write import write_repair
from touba.history._reservations import MAX_TAIL, Recent, Reservations
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

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisError
    from redis.exceptions import TimeoutError as RedisTimeout
except ImportError as e:  # pragma: no cover - exercised by a test that hides redis
    raise ImportError(
        'touba.history.redis needs redis-py; install it with: pip install "touba[redis]"'
    ) from e

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisHistoryStore"]

MAX_ROWS: Final = 4096  # most messages read ahead with a claim
# How long a release may take once an operation found the network silent (its
# deadline expired): the decision that failed must not wait a second deadline for
# a release that cannot arrive either (the reservation is then recovered as after
# any failed release).
RELEASE_AFTER_SILENCE: Final = 0.5
_LABEL: Final = "Redis"
_UNREAD_USAGE: Final = StoreUsage(0, 0, 0, 0)  # a peek that found nothing stored

T = TypeVar("T")
logger = logging.getLogger("touba.history")

Client = aioredis.Redis | aioredis.RedisCluster


# The scripts are lua/*.lua, registered by RedisHistoryStore (KEYS and ARGV are
# documented in each file); their replies and the stored rows are read by
# touba.history._redis_replies.


def _raw_row(value: Any) -> RawRow:
    """A stored row ``[exchange,bytes,message]`` as read, refusing nothing."""
    text = raw_text(value)
    try:
        first = text.index(",")
        second = text.index(",", first + 1)
        if text[0] != "[" or text[-1] != "]":
            raise ValueError
        return RawRow(int(text[1:first]), int(text[first + 1 : second]), text[second + 1 : -1])
    except ValueError:
        return RawRow(None, None, text)


_AFTER: Final = (
    "Check the server and retry; a conversation whose reservation could not be released "
    "is released by this store object's next operation on it, or by "
    "store.recover(key, worker_stopped=True)"
)


@asynccontextmanager
async def _driver_errors(what: str, seconds: float, client: Client) -> AsyncIterator[None]:
    """The one place where redis-py exceptions, and a deadline that expired, become
    touba errors: the body runs under a deadline of ``seconds``."""
    try:
        async with bounded(seconds, client):
            yield
    except RedisError as e:
        raise DecisionHistoryStoreUnavailable(
            f"Redis failed during {what} ({type(e).__name__}: {e}). {_AFTER}"
        ) from e
    except TimeoutError as e:
        raise DecisionHistoryStoreUnavailable(f"{no_answer(what, seconds)}. {_AFTER}") from e


@dataclass(frozen=True, slots=True)
class _Keys:
    """Names of one conversation's keys, in the order the scripts expect."""

    id: str
    all: tuple[str, ...]

    @property
    def messages(self) -> str:
        return self.all[5]

    @property
    def exchanges(self) -> str:
        return self.all[6]


class _Backend:
    """The protocol's primitives (:class:`touba.history._backend.Backend`): each one
    round trip (a script, with an LRANGE pipelined after the claim).

    Redis cannot tell when another client edits a conversation's rows (an LSET
    leaves ``last_token`` as it was), so ``sees_edits`` is False: every claim
    brings the window's rows, and the shared cache reuses only the messages
    whose stored text did not change.
    """

    driver_errors: tuple[type[BaseException], ...] = (RedisError,)
    label = _LABEL
    sees_edits = False
    drops = True  # save honours Write.dropped (in the commit script)

    def __init__(self, store: RedisHistoryStore) -> None:
        self._store = store
        # Rows an LRANGE pipelined with a claim reads: the exchanges the bodies
        # hint asks for times the most messages per exchange the windows held
        # lately, plus the most a save appended lately (what the next window
        # holds more); "lately": the last HINT_MEMORY (see Recent).
        self._per_exchange = Recent()  # thousandths of a message
        self._appended_hint = Recent()

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """``Backend.reserve``: claim.lua, with the LRANGE of the rows ahead pipelined."""
        store = self._store
        keys = store._keys(key)
        token = reservation.token
        args = (
            json.dumps(key),
            token,
            reservation.worker_id,
            reservation.pid,
            reservation.host,
            "all" if read.whole else str(min(read.sizes, MAX_TAIL)),
            store.max_sessions,
        )
        tail = self._rows_ahead(read)
        pipelined = (keys.messages, 0, -1) if read.whole else (keys.messages, -tail, -1)
        rows = pipelined if read.whole or tail else None
        result: Any
        try:
            if isinstance(store._client, aioredis.RedisCluster) and rows is not None:
                # (its pipelines refuse scripts: the claim brings the rows itself)
                found = list(
                    await store._conv(
                        store._claim_rows_script, keys, (*args, *rows[1:]), "a reservation"
                    )
                )
                result = (found, found.pop() if replies.text(found[0]) == "found" else [])
            else:
                result = await store._conv(store._claim_script, keys, args, "a reservation", rows)
        except BaseException:  # it may have run (a lost reply, a cancellation): free the key
            await self._release_quietly(key, keys, token)
            raise
        reply, listed, status = self._answer(key, result, rows)
        if status == "limit":
            check_sessions(int(reply[1]), store.max_sessions)
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_sessions raised
                "the store is full; nothing was reserved", limit="max_sessions"
            )
        usage = store._usage_of(reply[1], reply[2])
        if status == "new":
            return Reserved(None, False, 0, 0, 0, None, usage)
        try:
            reserved = await self._reserved(keys, reply, listed, read, usage)
            assert reserved is not None  # (only a peek stops short)
            return reserved
        except BaseException:  # refused without leaving the key held
            await self._release_quietly(key, keys, token)
            raise

    def _answer(
        self, key: str, result: Any, rows: tuple[str, int, int] | None
    ) -> tuple[Sequence[Any], Sequence[Any], str]:
        """A claim's or a peek's result: its reply, the rows listed with it (when
        ``rows`` were), its status; ``DecisionHistoryBusy`` when the key is held."""
        reply, listed = result if rows is not None else (result, ())
        status = replies.text(reply[0])
        if status == "busy":
            raise self._store._busy(key, reply)
        return reply, listed, status

    def _rows_ahead(self, read: Read) -> int:
        """How many trailing rows to read with a claim: before a window was read, as
        many as its exchanges may hold."""
        if not read.bodies:
            return 0
        guess = math.ceil(read.bodies * self._per_exchange.most / 1000)
        return min(MAX_ROWS, guess + self._appended_hint.most)

    async def peek(self, key: str, read: Read) -> Reserved | None:
        """What ``reserve`` reads, without reserving, for an operation that only
        reads: one round trip (the script and the LRANGE of the rows in one MULTI,
        so both see one state) that renews the expiry, as a save of the unchanged
        head would. Raises ``DecisionHistoryBusy`` while the key is held; None
        when only a reservation can answer (no record, a record that is not a
        touba log, a window that starts before the rows read ahead); a ``Reserved``
        with no head when nothing is stored. On a cluster
        client, whose pipelines refuse scripts, the script brings the rows itself
        (``lua/peek_rows.lua``)."""
        store = self._store
        if read.whole:
            return None
        keys = store._keys(key)
        tail = self._rows_ahead(read)
        rows = (keys.messages, -tail, -1) if tail else None
        args = (store._ttl_ms, min(read.sizes, MAX_TAIL))
        if isinstance(store._client, aioredis.RedisCluster) and rows is not None:
            # (its pipelines refuse scripts: the script brings the rows itself)
            found = list(await store._conv(store._peek_rows_script, keys, (*args, tail), "a read"))
            result = (found, found.pop() if replies.text(found[0]) == "found" else [])
        else:
            result = await store._conv(store._peek_script, keys, args, "a read", rows, atomic=True)
        reply, listed, status = self._answer(key, result, rows)
        if status == "new":  # nothing stored (its usage unread: a read takes no place)
            return Reserved(None, False, 0, 0, 0, None, _UNREAD_USAGE)
        if status != "found":
            return None
        usage = store._usage_of(reply[1], reply[2])
        return await self._reserved(keys, reply, listed, read, usage, further=False)

    async def _reserved(
        self,
        keys: _Keys,
        reply: Sequence[Any],
        listed: Sequence[Any],
        read: Read,
        usage: Any,
        *,
        further: bool = True,
    ) -> Reserved | None:
        """The claim's ``reply`` (and the ``listed`` rows) as the protocol reads it;
        without ``further`` (no reservation holds the rows still), None where the
        window starts before the rows listed."""
        head, split = replies.text(reply[3]), replies.text(reply[4]) == "1"
        count = int(reply[5]) if split else 0
        version, messages, size = replies.text(reply[6]) or None, int(reply[7]), int(reply[8])
        if read.whole:
            rows = replies.rows(listed, count)
            return Reserved(head, split, count, messages, size, version, usage, [], rows)
        if not split:  # a record kept whole: the protocol shows it as a head with no rows
            return Reserved(head, split, 0, messages, size, version, usage, [], [])
        entries = replies.entries(reply[10], int(reply[9]))
        sizes_first = count - len(entries) // 3
        bodies_first = max(0, count - read.bodies)
        at = 3 * (bodies_first - sizes_first)
        sizes = [(sizes_first + i // 3, entries[i + 1], entries[i + 2]) for i in range(0, at, 3)]
        if bodies_first >= count or at < 0:  # no window read: guess from the whole
            if count:
                self._per_exchange.note(-(-1000 * messages // count))
            return Reserved(head, split, count, messages, size, version, usage, sizes, [])
        first = entries[at]  # the window's first row
        offset = messages - len(listed)  # the first row the LRANGE brought
        if not 0 <= first <= messages:
            raise replies.damaged("an exchange entry")
        if first < offset and not further:
            return None
        if first < offset:  # the window grew past what was read ahead: one more trip
            raw: Sequence[Any] = [
                *await self._store._lrange(keys.messages, first, offset - 1),
                *listed,
            ]
        else:
            raw = listed[first - offset :]
        self._per_exchange.note(-(-1000 * (messages - first) // (count - bodies_first)))
        rows = replies.rows(raw, count)
        return Reserved(head, split, count, messages, size, version, usage, sizes, rows)

    async def save(self, key: str, token: str, write: Write) -> None:
        """``Backend.save``: commit.lua, a rewrite (put) or an append."""
        if write.rewrite and not write.split:
            await self._commit(key, token, "put", write, ("0", 0, write.bytes, 0))
        elif write.rewrite:
            counts = [0] * write.exchanges
            sizes = [0] * write.exchanges
            rows: list[str] = []
            for _seq, exchange, size, body in write.rows:
                counts[exchange] += 1
                sizes[exchange] += size
                rows.append(replies.row(exchange, size, body))
            entries: list[str] = []
            first = 0
            for n, total in zip(counts, sizes, strict=True):
                entries.append(f"{first}:{n}:{total}")
                first += n
            args: tuple[str | int, ...] = (
                "1",
                write.messages,
                write.bytes,
                len(entries),
                *entries,
                *rows,
            )
            await self._commit(key, token, "put", write, args)
        else:
            self._appended_hint.note(min(MAX_ROWS, len(write.rows)))
            await self._commit(key, token, "append", write, replies.appends(write))

    def _write_args(
        self, token: str, mode: str, write: Write | None, args: Sequence[str | int]
    ) -> tuple[str | int, ...]:
        """The ARGV after P and id that commit.lua and append_if.lua share."""
        store = self._store
        fields = ("", "", "") if write is None else (write.head, write.identity, write.namespace)
        limits = (store.max_sessions, store.max_store_bytes, store._ttl_ms)
        if write is not None:  # the plaintext head's bytes (the head may be sealed)
            size = write.head_bytes
            mode = f"{mode}:{len(write.head.encode('utf-8')) if size is None else size}"
        return (token, *limits, mode, *(field or "" for field in fields), *args)

    async def _commit(
        self, key: str, token: str, mode: str, write: Write | None, args: Sequence[str | int]
    ) -> None:
        store = self._store
        args = self._write_args(token, mode, write, args)
        reply = await store._conv(store._commit_script, store._keys(key), args, "a commit")
        status = replies.text(reply[0])
        if status == "ok":
            return
        if status == "stale":
            raise busy(key, " (its reservation was recovered while this one ran; nothing saved)")
        if status == "limit":
            check_capacity(
                is_new=int(reply[1]) == 1,
                sessions=int(reply[2]),
                max_sessions=store.max_sessions,
                store_bytes_after=int(reply[3]),
                max_store_bytes=store.max_store_bytes,
            )
            raise DecisionHistoryLimitExceeded(  # pragma: no cover - check_capacity raised
                "the store is full; nothing was written", limit="max_store_bytes"
            )
        if status == "dropped_elsewhere":  # rows removed or added behind the head
            found, expected = int(reply[1]), int(reply[2])
            raise dropped_elsewhere(key, _LABEL, found, expected)
        if status == "damaged_row":
            raise replies.damaged("a stored message row")
        if status == "damaged_entry":
            raise replies.damaged("an exchange entry")
        raise ValueError(f"append refused by the store ({status} {reply[1:]}); nothing saved")

    async def save_if(
        self, key: str, version: str, head: str, token: str, write: Write, seen: Seen | None
    ) -> bool:
        """The append of ``save`` without a reservation, one script: written (the
        version then ``token``) only if the conversation is unreserved, live, at
        ``version`` with the head text ``head`` and holds the exchange entries and
        rows ``seen`` describes, byte for byte (an edit by another client changes
        no version, so what the write was computed from is compared as text), and
        the write fits; else False, nothing written."""
        if seen is None or write.rewrite:
            return False
        store = self._store
        entries = "\n".join(f"{first}:{n}:{size}" for first, n, size in seen.entries)
        rows = "\n".join(
            replies.row(e, len(body.encode("utf-8", "surrogatepass")), body)
            for e, body in seen.rows
        )
        stored = write.kept + write.dropped  # before this write
        proof = (version, head, stored, seen.count)
        seen_text = (seen.entries_from, entries, seen.rows_from, rows)
        args = self._write_args(
            token, "append", write, (*replies.appends(write), *proof, *seen_text)
        )
        reply = await store._conv(
            store._append_if_script, store._keys(key), args, "an optimistic commit"
        )
        saved = replies.text(reply[0]) == "ok"
        if saved:
            self._appended_hint.note(min(MAX_ROWS, len(write.rows)))
        return saved

    async def delete(self, key: str, token: str) -> None:
        """``Backend.delete``: commit.lua in its delete mode."""
        await self._commit(key, token, "delete", None, ())

    async def release(self, key: str, token: str) -> None:
        """``Backend.release``: release.lua, if ``token`` still holds the key (within
        ``RELEASE_AFTER_SILENCE`` when the last operation found the network silent)."""
        store = self._store
        await store._conv(
            store._release_script,
            store._keys(key),
            (token,),
            "a release",
            seconds=store._release_seconds(),
        )

    async def _release_quietly(self, key: str, keys: _Keys, token: str) -> None:
        """Free our reservation after a failure; never hide the original error."""
        store = self._store
        try:
            await store._conv(
                store._release_script,
                keys,
                (token,),
                "a release",
                seconds=store._release_seconds(),
            )
        except (DecisionHistoryStoreUnavailable, ConfigurationError) as e:
            logger.warning(
                "could not release the reservation of conversation %r (%s); if it was taken, "
                "this store object releases it before its next operation on the key (else "
                "recover(key, worker_stopped=True))",
                key,
                type(e.__cause__ or e).__name__,
            )

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        """``Backend.read_sizes``: an LRANGE of the exchange entries."""
        if start >= stop:
            return []
        raw = await self._store._lrange(self._store._keys(key).exchanges, start, stop - 1)
        sizes = []
        for exchange, entry in enumerate(raw, start):
            try:
                _first, messages, size = replies.text(entry).split(":")
                sizes.append((exchange, int(messages), int(size)))
            except (ValueError, UnicodeDecodeError):
                raise replies.damaged("an exchange entry") from None
        return sizes

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        """``Backend.read_rows``: exchanges.lua (their rows, one round trip)."""
        if start >= stop:
            return []
        store = self._store
        keys = store._keys(key)
        raw = await store._run(
            store._exchanges, (keys.messages, keys.exchanges), (start, stop), "a read"
        )
        return replies.rows(raw, stop)


class RedisHistoryStore(AsyncClosing):
    """Durable store in Redis: bounded, expiring, refusing when full, crash-safe.

    Give exactly one of ``url`` (the store creates the client, which retries a
    command twice on a failed connection, and closes it) or ``client`` (a
    ``redis.asyncio.Redis`` or ``RedisCluster`` you own, with its own retry
    policy and timeouts; ``close()`` leaves it open).

    ``deadline_seconds`` (default 10) bounds every round trip, redis-py's retries
    included, on either client: past it the operation fails with the retryable
    :class:`~touba.errors.DecisionHistoryStoreUnavailable` (a network gone silent
    fails a decision instead of hanging its worker). The client made from ``url``
    also times out its connects and socket reads after it. A reservation whose
    release found the network silent is left held, and answers
    ``DecisionHistoryBusy`` until ``recover``, as after any failed release.
    Defaults: 128 conversations, 32 MiB, 24 hours of inactivity. A transaction
    reserves its conversation durably; after a crash the conversation answers
    :class:`~touba.errors.DecisionHistoryBusy` until
    ``recover(key, worker_stopped=True)``. Reserving a key that has no record
    claims its place among ``max_sessions`` at once; when every place is held
    (records and such reservations), it raises ``DecisionHistoryLimitExceeded``
    before the operation runs. Its ``transact_log`` honours
    ``LogWrite.drop_last`` (the newest rows trimmed in the commit script).

    ``encryption`` (a :class:`touba.Encryption`, ``touba[crypto]``) seals every head
    and message row's message at rest with AES-GCM, bound to ``prefix``, the
    conversation's key, the field and the message's position
    (:mod:`touba.history._sealed`); key names, identity, namespace, sizes
    (plaintext bytes: the scripts are given the plaintext head's size, they never
    read content), times and reservations stay plaintext. A value that does not
    open (plaintext, altered, moved, an unknown key) is refused with
    ``DecisionHistoryRecordInvalid``; so is a sealed value in a store opened
    without ``encryption``. An encrypted store reserves for every operation (its
    optimistic reads and appends compare stored rows as text, which sealing
    makes differ). Without it nothing is encrypted.

    Durability: entering the store (``async with``), or else its first command, reads
    the server's ``appendonly``, ``appendfsync``, ``aof-load-truncated`` and ``save``
    once (one more round trip); ``usage().durability`` then says whether an acknowledged
    write survives a server crash, and settings that can lose or damage one are logged
    once as a warning (:mod:`touba.history._redis_durability`; only ``appendonly yes``
    with ``appendfsync always`` and ``aof-load-truncated no`` keeps every write whole).
    """

    log_drops = True

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Client | None = None,
        prefix: str = "touba:",
        max_sessions: int = 128,
        max_store_bytes: int = 32 * MiB,
        ttl_seconds: float = 86400,
        worker_id: str | None = None,
        encryption: Encryption | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        check_limits_config(
            max_sessions=max_sessions, max_store_bytes=max_store_bytes, ttl_seconds=ttl_seconds
        )
        self.deadline_seconds = check_deadline(deadline_seconds, owner="RedisHistoryStore")
        self._base = slot_base(prefix, owner="store")
        if worker_id is not None and not isinstance(worker_id, str):
            raise ConfigurationError(f"worker_id must be a str or None, got {worker_id!r}")
        self._client, self._owns_client = redis_client(
            url, client, owner="RedisHistoryStore", deadline=self.deadline_seconds
        )
        self._silent = False  # the last operation ran out of its deadline
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = ttl_seconds
        self.worker_id = worker_id
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._store_keys = tuple(self._base + n for n in ("sessions", "bytes", "expiry", "held"))
        register = self._client.register_script  # the bytes touba hashed: the same SHA1
        self._claim_script = register(load("claim").source)
        self._claim_rows_script = register(load("claim_rows").source)
        self._commit_script = register(load("commit").source)
        self._append_if_script = register(load("append_if").source)
        self._peek_script = register(load("peek").source)
        self._peek_rows_script = register(load("peek_rows").source)
        self._release_script = register(load("release").source)
        self._read_script = register(load("read").source)
        self._delete_script = register(load("delete").source)
        self._purge_script = register(load("purge").source)
        self._usage_script = register(load("usage").source)
        self._list_script = register(load("list").source)
        self._exchanges = register(load("exchanges").source)
        self._closed = False
        self._durability: str | None = None
        self._durability_read = False
        worker = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self._backend = _Backend(self)
        self.encryption = check_encryption(encryption)
        self._sealer = None if encryption is None else Sealer(encryption, prefix, _LABEL)
        self._rekeying = Rekeying()
        self._reservations = Reservations(
            self._backend if self._sealer is None else sealed_backend(self._backend, self._sealer),
            worker,
        )

    async def close(self) -> None:
        """Close the client if this store created it (from ``url``)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            async with _driver_errors("close", self.deadline_seconds, self._client):
                await self._client.aclose()

    async def _enter(self) -> None:
        await self._read_durability()

    # -- internals ------------------------------------------------------------------

    async def _read_durability(self) -> None:
        """Read the server's persistence settings once; warn when they can lose an
        acknowledged write. A connection failure leaves it for the next command (which
        raises its own error); a refused ``CONFIG GET`` gives "unknown"."""
        if self._durability_read:
            return
        self._durability_read = True  # first: concurrent first commands read it once
        try:
            async with bounded(self.deadline_seconds, self._client):
                settings = await self._persistence_settings()
        except (RedisConnectionError, RedisTimeout, TimeoutError):
            self._durability_read = False
            return
        except RedisError:  # NOPERM, an unknown command: a managed service or an ACL
            settings = None
        self._durability, safe = durability_of(settings)
        if settings is None:
            logger.info("RedisHistoryStore: durability %s", self._durability)
        elif not safe:
            logger.warning(
                "RedisHistoryStore: the Redis server may lose or damage acknowledged writes: "
                "%s. Set appendonly yes, appendfsync always and aof-load-truncated no to keep "
                "every one (docs: "
                "operations/failures.md, Redis persistence and durability)",
                self._durability,
            )

    async def _persistence_settings(self) -> dict[str, str] | None:
        """``SETTINGS`` (``appendonly``, ``appendfsync``, ...) of the server holding this store's
        slot (one round trip); None when a reply cannot be read."""
        client = self._client
        if isinstance(client, aioredis.RedisCluster):
            await client.initialize()  # the slot map (idempotent; a command does it too)
            node = client.get_node_from_key(self._store_keys[0])
            answers = [
                await client.execute_command("CONFIG GET", name, target_nodes=node)
                for name in SETTINGS
            ]
        else:
            async with client.pipeline(transaction=False) as pipe:
                for name in SETTINGS:
                    pipe.config_get(name)
                answers = await pipe.execute()
        settings: dict[str, str] = {}
        for name, reply in zip(SETTINGS, answers, strict=True):
            if not isinstance(reply, dict):
                return None
            for found, value in reply.items():
                if replies.text(found) == name:
                    settings[name] = replies.text(value)
        return settings

    @asynccontextmanager
    async def _bounded(self, what: str, seconds: float | None = None) -> AsyncIterator[None]:
        """One round trip under the deadline (``seconds``, else ``deadline_seconds``),
        its failures as ``DecisionHistoryStoreUnavailable``; notes whether it found the
        network silent (see :meth:`_release_seconds`)."""
        self._check_open()
        try:
            async with _driver_errors(what, seconds or self.deadline_seconds, self._client):
                yield
        except DecisionHistoryStoreUnavailable as e:
            self._silent = isinstance(e.__cause__, TimeoutError | RedisTimeout)
            raise
        self._silent = False

    def _release_seconds(self) -> float:
        """A release's deadline: ``RELEASE_AFTER_SILENCE`` right after an operation
        ran out of its own (so a failed decision raises within about one deadline),
        else ``deadline_seconds``."""
        if self._silent:
            return min(self.deadline_seconds, RELEASE_AFTER_SILENCE)
        return self.deadline_seconds

    def _keys(self, key: str) -> _Keys:
        check_key(key)
        cid = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        conv = f"{self._base}c:{cid}:"
        return _Keys(cid, (*self._store_keys, conv + "head", conv + "messages", conv + "exchanges"))

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this RedisHistoryStore is closed; create a new one")

    async def _run(
        self,
        script: AsyncScript,
        keys: Sequence[str],
        args: Sequence[str | int],
        what: str,
        rows: tuple[str, int, int] | None = None,
        *,
        atomic: bool = False,
        seconds: float | None = None,
    ) -> Any:
        """One round trip: ``script``; with ``rows`` (list, start, stop), an LRANGE
        pipelined after it (``atomic``: both in one MULTI), and the reply is
        ``(script reply, rows)``. Bounded by ``seconds`` (else ``deadline_seconds``)."""
        self._check_open()
        if not self._durability_read:
            await self._read_durability()
        async with self._bounded(what, seconds):
            if rows is None:
                return await script(keys=keys, args=args)
            # A cluster client's pipelines refuse scripts: its claims and peeks bring
            # their rows themselves (claim_rows.lua, peek_rows.lua).
            assert not isinstance(self._client, aioredis.RedisCluster), "no pipeline"
            for attempt in (1, 2):
                async with self._client.pipeline(transaction=atomic) as pipe:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                    pipe.lrange(*rows)
                    reply, listed = await pipe.execute(raise_on_error=False)
                if isinstance(reply, NoScriptError) and attempt == 1:
                    await self._client.script_load(script.script)  # e.g. after a restart
                    continue
                for outcome in (reply, listed):
                    if isinstance(outcome, Exception):
                        raise outcome
                return reply, listed
            raise AssertionError("unreachable")  # pragma: no cover

    async def _lrange(self, name: str, start: int, stop: int) -> list[Any]:
        self._check_open()
        if not self._durability_read:
            await self._read_durability()
        async with self._bounded("a read"):
            return list(await self._client.lrange(name, start, stop))

    async def _conv(
        self,
        script: AsyncScript,
        keys: _Keys,
        args: Sequence[str | int],
        what: str,
        rows: tuple[str, int, int] | None = None,
        *,
        atomic: bool = False,
        seconds: float | None = None,
    ) -> Any:
        return await self._run(
            script,
            keys.all,
            (self._base, keys.id, *args),
            what,
            rows,
            atomic=atomic,
            seconds=seconds,
        )

    def _busy(self, key: str, reply: Sequence[Any]) -> ToubaError:
        worker, pid, host, since = (replies.opt_text(v) for v in reply[1:5])
        held = f" (held by worker {worker}, pid {pid} on {host} since {replies.ms_iso(since)})"
        return busy(key, held)

    def _usage_of(self, sessions: Any, size: Any) -> StoreUsage:
        return StoreUsage(
            int(sessions), self.max_sessions, int(size), self.max_store_bytes, self._durability
        )

    # -- the contract ----------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Run ``operation`` on the record of ``key`` under a durable reservation
        (see :class:`~touba.history.HistoryStore`): two round trips."""
        self._check_open()
        check_key(key)
        return await self._reservations.transact(key, operation)

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact`` for the history layer: the head, the tail, appends only.

        Two round trips (claim, commit) once this store object has seen how far
        back the history layer reads. Raises as :meth:`transact` does.
        """
        self._check_open()
        check_key(key)
        return await self._reservations.transact_log(key, operation)

    async def transact_log_optimistic(
        self, key: str, operation: LogOperation[T], *, drops: bool = False
    ) -> T:
        """``transact_log`` for an operation that may run twice (it only reads its
        snapshot and returns a write: a session's append or read, never a decision).

        When this store object holds the conversation's tail, the operation runs on
        it and its write is saved in one script if the conversation is unreserved,
        live, at that version and still holds, byte for byte, the head, exchange
        entries and rows the operation read; else it runs again through
        :meth:`transact_log` (see
        ``touba.history._reservations.Reservations.transact_log_optimistic``). Raises as
        :meth:`transact_log` does.
        """
        self._check_open()
        check_key(key)
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
        self._check_open()
        check_key(key)
        return await self._reservations.read_log(key, operation)

    async def read(self, key: str, *, purge: bool = True) -> Record | None:
        """A detached copy, or None if absent or expired; does not renew the TTL.

        Expired conversations are purged first, unless ``purge`` is False (Redis's
        own expiry of their keys, a minute later, still removes them)."""
        return await self._read(key, purge=purge, held=False)

    async def read_saved(self, key: str) -> Record | None:
        """The record as last saved, even while a reservation holds ``key`` (what a
        holder that crashes would leave; ``touba copy --include-active`` copies it).

        None if absent, expired or only reserved (no record yet). Writes nothing."""
        return await self._read(key, purge=False, held=True)

    async def _read(self, key: str, *, purge: bool, held: bool) -> Record | None:
        keys = self._keys(key)
        args = (_flag(purge), _flag(held))
        reply = await self._conv(self._read_script, keys, args, "a read")
        status = replies.text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        if status == "absent":
            return None
        split = replies.text(reply[2]) == "1"
        count = int(reply[3]) if split else 0
        text: Any = reply[1]
        rows: Rows = replies.rows(reply[4:], count) if split else []
        if self._sealer is not None:
            text, rows = self._sealer.open_stored(key, replies.text(text), rows)
        head = replies.head(text)
        if not split:
            return head
        exchanges: list[list[Record]] = [[] for _ in range(count)]
        for exchange, _size, body in rows:
            exchanges[exchange].append(parse_object(body, key, "a message", _LABEL))
        return join_record(head, exchanges)

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; False if it was absent or expired.
        ``DecisionHistoryBusy`` while reserved (a reservation of this store object's
        that a failure left is released first)."""
        await self._reservations.settle(key)
        reply = await self._conv(self._delete_script, self._keys(key), (), "a delete")
        status = replies.text(reply[0])
        if status == "busy":
            raise self._busy(key, reply)
        return status == "deleted"

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation left by a crashed worker; the saved record is kept.

        Stop that worker and check it is gone first: this frees storage, it
        decides nothing about business effects the worker may have caused.
        """
        require_worker_stopped(worker_stopped)
        freed = await self._conv(self._release_script, self._keys(key), ("",), "a recover")
        return recovered(key, freed == 1)

    async def read_raw(self, key: str) -> RawConversation | None:
        """The conversation as stored (head and row texts, the store's totals), or None
        when absent or expired: it refuses nothing, a reserved conversation included
        (``active`` says so), and changes nothing (one MULTI of reads, so what it
        reads is one state). A row whose ``[exchange,bytes,message]`` framing is
        unreadable comes with ``exchange`` None. For :func:`~touba.history.check_record`.
        On an encrypted store each value comes opened in its place; one that does
        not open is never read as plaintext: it stays as text that is not JSON, an
        unreadable row (an unopened head: an unrepairable conversation), and
        ``missing_keys`` names the key ids it was sealed with that were not given."""
        keys = self._keys(key)
        async with self._bounded("a read"), self._client.pipeline(transaction=True) as pipe:
            pipe.hmget(keys.all[4], "head", "split", "messages", "token", "expires_at")
            pipe.hget(keys.all[0], keys.id)
            pipe.llen(keys.exchanges)
            pipe.lrange(keys.messages, 0, -1)
            pipe.time()
            fields, size, exchanges, listed, (seconds, micros) = await pipe.execute()
        head, split, messages, token, expires = fields
        if head is None:
            return None
        if expires is not None and int(expires) <= seconds * 1000 + micros // 1000:
            return None
        split = raw_text(split) == "1"
        raw = RawConversation(
            key,
            raw_text(head),
            split,
            tuple(_raw_row(value) for value in listed) if split else (),
            int(exchanges) if split else 0,
            int(messages or 0),
            int(size or 0),
            token is not None,
        )
        return raw if self._sealer is None else self._sealer.open_raw(raw)  # or not JSON

    async def repair(self, plan: RepairPlan) -> bool:
        """Write ``plan`` (:func:`~touba.history.plan_repair`) in one script under a
        reservation; True when it changed the conversation, False when the plan
        changes nothing. ``DecisionHistoryBusy`` (nothing written) when the
        conversation is reserved, or changed since ``plan`` was computed;
        ``DecisionHistoryLimitExceeded`` when the repaired record would not fit."""
        self._check_open()
        check_key(plan.key)
        return await write_repair(self._reservations, self.read_raw, plan)

    async def purge_expired(self) -> int:
        """Purge expired, unreserved conversations now; return how many went."""
        reply = await self._run(self._purge_script, self._store_keys, (self._base,), "a purge")
        return int(reply)

    async def usage(self, *, purge: bool = True) -> StoreUsage:
        """How full the store is now, over every client sharing the prefix.

        ``sessions`` counts stored conversations plus reservations of keys that
        have no record yet (a crashed worker's included, until ``recover``);
        ``bytes`` what the records retain (UTF-8 JSON of heads and messages).
        Expired conversations are purged first, unless ``purge`` is False (then
        they count). Two reads of counters the scripts keep, whatever the number
        of conversations.
        """
        args = (self._base, _flag(purge))
        reply = await self._run(self._usage_script, self._store_keys, args, "a usage")
        return self._usage_of(reply[0], reply[1])

    async def is_empty(self) -> bool:
        """True when the prefix holds none of this store's keys: nothing was ever
        stored there (a wrong ``prefix`` or database), or the store emptied itself.
        One EXISTS over the store-wide keys; it reads only (no purge, no expiry)."""
        async with self._bounded("a check"):
            return int(await self._client.exists(*self._store_keys)) == 0

    async def list(
        self, namespace: str | None = None, *, purge: bool = True
    ) -> list[StoredConversation]:
        """Every live conversation (and reserved key), sizes and holder, no content.

        Expired conversations are purged first; with ``purge=False`` nothing is
        written and those Redis has not expired yet (a minute after their
        ``expires_at``) are listed with ``expired=True``."""
        args = (self._base, _flag(purge), *replies.LIST_FIELDS)
        reply = list(await self._run(self._list_script, self._store_keys, args, "a list"))
        return replies.listed(reply, namespace)

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with ``encryption.current`` up to ``batch`` conversations holding a
        value sealed with another key, each under its own reservation (a concurrent
        writer is refused busy, never lost); how many were re-sealed, 0 when a whole
        pass re-sealed nothing. See
        :meth:`touba.history.sqlite.SqliteHistoryStore.rekey`."""
        sealer = require_sealer(self._sealer, batch)
        self._check_open()

        async def stale(after: str) -> tuple[list[str], str]:
            found: list[str] = []
            last = ""
            for cid, key, values in await self._stored_values(after):
                last = cid
                if not all(sealer.is_current(v) for v in values):
                    found.append(key)
                    if len(found) == batch:
                        break
            return found, last

        return await self._rekeying.run(stale, self._reservations.transact, _LABEL)

    async def key_ids(self) -> dict[str | None, int]:
        """How many stored heads and messages each key id sealed (``None``: values not
        sealed), for a rotation's progress. Reads every conversation: not for a
        decision."""
        self._check_open()
        counts: dict[str | None, int] = {}
        for _cid, _key, values in await self._stored_values(""):
            for value in values:
                key_id = Encryption.key_id_of(value) if Encryption.is_sealed(value) else None
                counts[key_id] = counts.get(key_id, 0) + 1
        return counts

    async def _stored_values(self, after: str) -> Sequence[tuple[str, str, Sequence[str]]]:
        """(id, key, [head, message bodies...]) of each stored conversation whose id
        sorts after ``after``, in id order (reads them all: for rotation only)."""
        client = self._client
        out = []
        what = "a scan for rotation"  # each round trip under its own deadline
        async with self._bounded(what):
            ids = sorted(replies.text(i) for i in await client.zrange(self._store_keys[2], 0, -1))
        for cid in ids:
            if cid <= after:
                continue
            conv = f"{self._base}c:{cid}:"
            async with self._bounded(what):
                key, head = await client.hmget(conv + "head", ["key", "head"])
            if key is None or head is None:
                continue
            async with self._bounded(what):
                raw = await client.lrange(conv + "messages", 0, -1)
            bodies = [body for _e, _s, body in replies.rows(raw, 2**62)]
            out.append((cid, json.loads(replies.text(key)), [replies.text(head), *bodies]))
        return out


def _flag(purge: bool) -> str:
    """A script's purge argument: ``'1'`` purges expired conversations first."""
    return "1" if purge else "0"
