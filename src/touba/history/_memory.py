"""``MemoryHistoryStore``: conversations in the RAM of one process.

Messages are kept as their compact JSON (what the bounds measure, and what
``read`` and ``transact`` parse into private copies). The neutral messages of
the exchanges a decision's window reads are also kept, parsed once and
frozen (:mod:`touba.history._frozen`: their dicts and lists refuse changes),
and handed to every later decision as they are (``_Snapshot.messages``):
a window costs no parsing of what the store already holds. That cache holds
the exchanges the last window read, is dropped for an exchange a write
changes, and forgets exchanges older than the window.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError
from touba.history._common import (
    EncodedRecord,
    MiB,
    appended_bodies,
    busy,
    check_capacity,
    check_key,
    check_limits_config,
    check_sessions,
    encode_record,
    iso,
    recovered,
    require_worker_stopped,
)
from touba.history._frozen import parse_frozen
from touba.history._head import HeldHead, encode_head, parse_head
from touba.history._model import Message, message_from_dict
from touba.history._record import join_record
from touba.history._repair import RawConversation, RawRow, RepairPlan
from touba.history._repair_write import changed_since
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

__all__ = ["MemoryHistoryStore"]

T = TypeVar("T")


@dataclass(slots=True)
class _Entry:
    head: str
    split: bool
    exchanges: list[list[str]] = field(default_factory=list)
    sizes: list[ExchangeSize] = field(default_factory=list)
    messages: int = 0
    bytes: int = 0
    updated_at: float = 0.0
    expires_at: float = 0.0
    parsed: dict[int, tuple[Message, ...]] = field(default_factory=dict)  # frozen, shared
    parsed_from: int = 0  # no exchange before it is in ``parsed``
    # Exchanges of ``parsed`` whose messages passed the window check (_integrity).
    well_formed: set[int] = field(default_factory=set)
    held: HeldHead | None = None  # ``head`` parsed, for the next decision (see _head)

    def held_head(self) -> HeldHead | None:
        return self.held if self.held is not None and self.held.holds(self.head) else None

    def head_bytes(self) -> int:
        """The stored head's UTF-8 length (what the bounds count), measured once."""
        held = self.held_head()
        return held.size if held is not None else len(self.head.encode("utf-8"))

    def record(self) -> Record:
        head: Record = json.loads(self.head)
        if not self.split:
            return head
        return join_record(head, [[json.loads(m) for m in ex] for ex in self.exchanges])


def _entry_of(encoded: EncodedRecord) -> _Entry:
    """A new entry holding ``encoded`` (its exchanges' sizes measured once)."""
    return _Entry(
        head=encoded.head,
        split=encoded.split,
        exchanges=encoded.exchanges,
        sizes=[
            ExchangeSize(len(ex), sum(len(m.encode("utf-8")) for m in ex))
            for ex in encoded.exchanges
        ],
        messages=encoded.messages,
        bytes=encoded.bytes,
    )


class _Snapshot:
    """View of one entry: the head's top-level dict and every read of exchanges are
    the caller's own; the head's nested values and the neutral messages are
    shared and read-only."""

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry
        held = entry.held_head()
        head = held.copy() if held is not None else parse_head(entry.head)
        if head is None:  # only touba's own heads are written to split entries
            raise ValueError("a RAM store entry holds a head that is not a JSON object")
        self._head: Record = head

    @property
    def head(self) -> Record:
        return self._head

    @property
    def head_bytes(self) -> int:
        """The stored head's UTF-8 length (what the bounds count)."""
        return self._entry.head_bytes()

    @property
    def well_formed(self) -> set[int]:
        """Exchanges whose shared messages passed the window check and have not
        changed since (the history engine adds to it and skips them)."""
        return self._entry.well_formed

    @property
    def exchange_count(self) -> int:
        return len(self._entry.exchanges)

    async def sizes(self, start: int) -> list[ExchangeSize]:
        return self._entry.sizes[start:]

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        return [[json.loads(m) for m in ex] for ex in self._entry.exchanges[start:stop]]

    async def messages(self, start: int, stop: int) -> list[tuple[Message, ...]]:
        """The neutral messages of exchanges ``start`` .. ``stop - 1``, shared and
        read-only (see the module docstring); the list is the caller's."""
        entry = self._entry
        cache = entry.parsed
        if start > entry.parsed_from:  # exchanges before ``start`` left the window
            gone = (
                range(entry.parsed_from, start)
                if start - entry.parsed_from <= len(cache)
                else [i for i in cache if i < start]
            )
            for index in gone:
                cache.pop(index, None)
                entry.well_formed.discard(index)
        entry.parsed_from = start
        stop = min(stop, len(entry.exchanges))
        out = [cache.get(index) for index in range(start, stop)]
        if None in out:
            for position, messages in enumerate(out):
                if messages is None:
                    rows = entry.exchanges[start + position]
                    built = tuple(message_from_dict(parse_frozen(m)) for m in rows)
                    out[position] = cache[start + position] = built
        return out  # type: ignore[return-value]  # every None was replaced


class MemoryHistoryStore(AsyncClosing):
    """RAM store for one process: bounded, expiring, refusing when full.

    Defaults follow the seed: 128 conversations, 32 MiB, one hour of
    inactivity. Expired entries are purged on the next access (this is not a
    secure erase of the process memory). A crash loses everything, so there
    is no reservation to recover after one. A key without a record claims
    its place among ``max_sessions`` when it is reserved: once the places are
    taken, reserving a new key raises ``DecisionHistoryLimitExceeded`` before
    its operation runs. Its ``transact_log`` honours ``LogWrite.drop_last``.
    It keeps nothing at rest (nothing outlives the process), so it takes no
    ``encryption=``: the durable stores do.
    """

    log_drops = True

    def __init__(
        self,
        *,
        max_sessions: int = 128,
        max_store_bytes: int = 32 * MiB,
        ttl_seconds: float = 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_limits_config(
            max_sessions=max_sessions, max_store_bytes=max_store_bytes, ttl_seconds=ttl_seconds
        )
        self.max_sessions = max_sessions
        self.max_store_bytes = max_store_bytes
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._active: dict[str, str] = {}
        self._fresh: set[str] = set()  # reserved keys that have no record yet
        self._total_bytes = 0
        self._closed = False

    async def close(self) -> None:
        """Refuse every later call with ``ConfigurationError`` (the records live in
        this object only). Idempotent."""
        with self._lock:
            self._closed = True

    # -- internal helpers (call with the lock held) ---------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this MemoryHistoryStore is closed; create a new one")

    def _purge(self, now: float) -> None:
        expired = [
            k for k, e in self._entries.items() if e.expires_at <= now and k not in self._active
        ]
        for key in expired:
            self._total_bytes -= self._entries.pop(key).bytes

    def _live(self, key: str, now: float) -> _Entry | None:
        self._check_open()
        self._purge(now)
        return self._entries.get(key)

    def _peek(self, key: str) -> _Entry | None:
        """``key``'s entry, expired or not, purging nothing."""
        self._check_open()
        return self._entries.get(key)

    def _usage(self) -> StoreUsage:
        return StoreUsage(
            sessions=len(self._entries) + len(self._fresh),
            max_sessions=self.max_sessions,
            bytes=self._total_bytes,
            max_store_bytes=self.max_store_bytes,
        )

    def _reserve(self, key: str) -> tuple[str, _Entry | None, StoreUsage]:
        check_key(key)
        with self._lock:
            entry = self._live(key, self._clock())
            if key in self._active:
                raise busy(key)
            if entry is None:  # a new conversation claims its place now
                check_sessions(len(self._entries) + len(self._fresh), self.max_sessions)
                self._fresh.add(key)
            token = uuid.uuid4().hex
            self._active[key] = token
            return token, entry, self._usage()

    def _release(self, key: str, token: str) -> None:
        with self._lock:
            if self._active.get(key) == token:
                del self._active[key]
                self._fresh.discard(key)

    def _check_token(self, key: str, token: str) -> None:
        if self._active.get(key) != token:
            raise busy(key, " (its reservation was recovered while this one ran; nothing saved)")

    def _admit(self, key: str, new_bytes: int, old: _Entry | None) -> None:
        """Refuse a write that would overflow the store, then account for it."""
        old_bytes = old.bytes if old else 0
        check_capacity(
            is_new=old is None,
            sessions=len(self._entries),
            max_sessions=self.max_sessions,
            store_bytes_after=self._total_bytes - old_bytes + new_bytes,
            max_store_bytes=self.max_store_bytes,
        )
        self._total_bytes += new_bytes - old_bytes

    def _stamp(self, key: str, entry: _Entry) -> None:
        now = self._clock()
        entry.updated_at = now
        entry.expires_at = now + self.ttl_seconds
        self._entries[key] = entry
        self._fresh.discard(key)  # its place is now held by the record

    # -- the contract -----------------------------------------------------------------

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """``HistoryStore.transact``, within the store's bounds."""
        token, entry, _usage = self._reserve(key)
        try:
            record, result = await operation(None if entry is None else entry.record())
            with self._lock:
                self._check_token(key, token)
                if record is None:
                    if entry is not None:
                        self._total_bytes -= self._entries.pop(key).bytes
                    return result
                encoded = encode_record(record)
                new = _entry_of(encoded)
                self._admit(key, new.bytes, entry)
                self._stamp(key, new)
            return result
        finally:
            self._release(key, token)

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """``LogStore.transact_log``, within the store's bounds."""
        token, entry, usage = self._reserve(key)
        try:
            write, result = await operation(None if entry is None else _Snapshot(entry), usage)
            if write is None:
                return result
            with self._lock:
                self._check_token(key, token)
                _apply(key, entry, write, self)
            return result
        finally:
            self._release(key, token)

    async def read(self, key: str, *, purge: bool = True) -> Record | None:
        """A detached copy, or None if absent or expired; ``DecisionHistoryBusy`` while
        a transaction holds it. ``purge=False``: expired entries stay (read only)."""
        check_key(key)
        with self._lock:
            now = self._clock()
            entry = self._live(key, now) if purge else self._peek(key)
            if key in self._active:
                raise busy(key)
            return None if entry is None or entry.expires_at <= now else entry.record()

    async def read_saved(self, key: str) -> Record | None:
        """The record as last saved, even while a transaction holds ``key``; None if
        absent or expired. Writes nothing, purges nothing."""
        check_key(key)
        with self._lock:
            entry = self._peek(key)
            return None if entry is None or entry.expires_at <= self._clock() else entry.record()

    async def delete(self, key: str) -> bool:
        """Delete an inactive conversation; False when absent, ``DecisionHistoryBusy``
        while a transaction holds it."""
        check_key(key)
        with self._lock:
            entry = self._live(key, self._clock())
            if key in self._active:
                raise busy(key)
            if entry is None:
                return False
            self._total_bytes -= self._entries.pop(key).bytes
            return True

    async def recover(self, key: str, *, worker_stopped: bool) -> bool:
        """Free a reservation whose holder is gone; touches nothing else.

        In RAM a reservation only outlives its holder when a task was
        abandoned without finishing; its late save is then refused.
        """
        require_worker_stopped(worker_stopped)
        check_key(key)
        with self._lock:
            self._check_open()
            self._fresh.discard(key)
            return recovered(key, self._active.pop(key, None) is not None)

    async def read_raw(self, key: str) -> RawConversation | None:
        """The conversation as stored (head and message texts, its totals), or None
        when absent or expired: it refuses nothing, a reserved conversation included
        (``active`` says so), and changes nothing. For
        :func:`~touba.history.check_record`."""
        check_key(key)
        with self._lock:
            return self._raw(key)

    def _raw(self, key: str) -> RawConversation | None:
        entry = self._peek(key)
        if entry is None or entry.expires_at <= self._clock():
            return None
        rows = tuple(
            RawRow(index, len(body.encode("utf-8", "surrogatepass")), body)
            for index, exchange in enumerate(entry.exchanges)
            for body in exchange
        )
        return RawConversation(
            key,
            entry.head,
            entry.split,
            rows,
            len(entry.exchanges),
            entry.messages,
            entry.bytes,
            key in self._active,
        )

    async def repair(self, plan: RepairPlan) -> bool:
        """Write ``plan`` (:func:`~touba.history.plan_repair`) at once; True when it
        changed the conversation, False when the plan changes nothing.
        ``DecisionHistoryBusy`` (nothing written) when the conversation is reserved,
        or changed since ``plan`` was computed; ``DecisionHistoryLimitExceeded``
        when the repaired record would not fit."""
        if plan.record is None:
            return False
        key = plan.key
        check_key(key)
        encoded = encode_record(plan.record)
        with self._lock:
            if key in self._active:
                raise busy(key)
            entry = self._peek(key)
            current = self._raw(key)
            if current is None or entry is None or not current.same_as(plan.original):
                raise changed_since(key)
            new = _entry_of(encoded)
            self._admit(key, new.bytes, entry)
            self._stamp(key, new)
        return True

    async def usage(self, *, purge: bool = True) -> StoreUsage:
        """How full the store is now (expired entries purged first, unless ``purge``
        is False: then they are counted, as they still hold their place).

        ``sessions`` counts stored conversations plus reservations of keys
        that have no record yet; ``bytes`` what the records retain (UTF-8 JSON
        of heads and messages).
        """
        with self._lock:
            if purge:
                self._live("", self._clock())
            else:
                self._check_open()
            return self._usage()

    async def list(
        self, namespace: str | None = None, *, purge: bool = True
    ) -> list[StoredConversation]:
        """``AdminStore.list``: the conversations (of ``namespace`` when given), sizes
        and reservations only, never content; expired ones are purged first unless
        ``purge`` is False (then listed with ``expired=True``)."""
        with self._lock:
            now = self._clock()
            if purge:
                self._live("", now)
            else:
                self._check_open()
            rows = []
            for key, entry in sorted(self._entries.items()):
                identity = _identity(entry)
                if namespace is not None and (identity or {}).get("namespace") != namespace:
                    continue
                rows.append(
                    StoredConversation(
                        key=key,
                        identity=identity,
                        messages=entry.messages,
                        bytes=entry.bytes,
                        updated_at=iso(entry.updated_at) or "",
                        expires_at=iso(entry.expires_at),
                        active=key in self._active,
                        expired=entry.expires_at <= now,
                    )
                )
            return rows


def _dropping(entry: _Entry | None, count: int) -> list[tuple[int, bool]]:
    """The ``count`` newest messages of ``entry``, newest first, as (bytes, whether
    their exchange is left empty); ``ValueError`` when it holds fewer."""
    plan: list[tuple[int, bool]] = []
    exchanges = entry.exchanges if entry else []
    index, position = len(exchanges) - 1, None
    while len(plan) < count:
        if index < 0:
            raise ValueError(f"drop_last={count} refused: the conversation holds fewer messages")
        exchange = exchanges[index]
        position = len(exchange) - 1 if position is None else position - 1
        if position < 0:
            index, position = index - 1, None
            continue
        plan.append((len(exchange[position].encode("utf-8")), position == 0))
    return plan


def _identity(entry: _Entry) -> dict[str, str] | None:
    if not entry.split:
        return None
    identity: Any = json.loads(entry.head).get("identity")
    return identity if isinstance(identity, dict) else None


def _apply(key: str, old: _Entry | None, write: LogWrite, store: MemoryHistoryStore) -> None:
    """Check then apply ``write`` in place (lock held); a refusal changes nothing."""
    held = encode_head(write.head, None if old is None else old.held_head())
    head = held.text
    drop = _dropping(old, write.drop_last)
    kept = (len(old.exchanges) if old else 0) - sum(1 for _, emptied in drop if emptied)
    check_appends(kept, write.append)
    appended = appended_bodies(write)
    rows = [(index, body) for index, body, _size in appended]
    sizes = [size for _index, _body, size in appended]
    old_bytes = old.bytes if old else 0
    old_head_bytes = old.head_bytes() if old else 0
    dropped = sum(size for size, _ in drop)
    new_bytes = old_bytes - old_head_bytes + held.size + sum(sizes) - dropped
    entry = old or _Entry(head=head, split=True)
    store._admit(key, new_bytes, old)
    entry.head, entry.held, entry.split, entry.bytes = head, held, True, new_bytes
    dropped_from = len(entry.exchanges) - len(drop)  # no exchange before it loses a message
    if drop:  # every exchange from ``dropped_from`` on loses messages below
        for index in [i for i in entry.parsed if i >= dropped_from]:
            del entry.parsed[index]
        entry.well_formed = {i for i in entry.well_formed if i < dropped_from}
    entry.well_formed.difference_update(index for index, _ in rows)
    for size, emptied in drop:
        entry.exchanges[-1].pop()
        entry.sizes[-1] = ExchangeSize(entry.sizes[-1].messages - 1, entry.sizes[-1].bytes - size)
        if emptied:
            entry.exchanges.pop()
            entry.sizes.pop()
    entry.messages -= len(drop)
    for (index, row), size in zip(rows, sizes, strict=True):
        if index == len(entry.exchanges):
            entry.exchanges.append([])
            entry.sizes.append(ExchangeSize(0, 0))
        entry.exchanges[index].append(row)
        entry.sizes[index] = entry.sizes[index] + ExchangeSize(1, size)
        built = entry.parsed.get(index)
        if built is not None:  # the messages built stay: only this one is new
            try:
                entry.parsed[index] = (*built, message_from_dict(parse_frozen(row)))
            except Exception:  # not a message (a log of other records): built when read
                del entry.parsed[index]
    entry.messages += len(rows)
    store._stamp(key, entry)
