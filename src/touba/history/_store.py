"""The store contract (SPEC section 6) and the append-only interface of built-ins.

Custom adapters implement only :class:`HistoryStore` (``transact``). Built-in
stores also implement :class:`LogStore`, which lets the history layer read a
bounded tail of a conversation and append messages without loading or
rewriting what is already retained. :func:`as_log_store` gives the history
layer one interface over both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from touba.errors import DecisionHistoryRecordInvalid
from touba.history._model import message_bytes
from touba.history._record import is_split_record, join_record, split_record
from touba.history._window import ExchangeSize

__all__ = [
    "HistoryStore",
    "LogSnapshot",
    "LogStore",
    "LogWrite",
    "Operation",
    "AdminStore",
    "StoreUsage",
    "StoredConversation",
    "as_log_store",
    "log_drops",
]

T = TypeVar("T")
Record = dict[str, Any]
Operation = Callable[[Record | None], Awaitable[tuple[Record | None, T]]]


@runtime_checkable
class HistoryStore(Protocol):
    """Where conversations live. See SPEC section 6 for the full contract.

    ``transact`` gives ``operation`` a private deep copy of the record (or
    ``None``), then atomically saves the record it returns (``None`` deletes)
    and returns its result. Two concurrent operations on one key must not run;
    when ``operation`` raises, the old state is kept.
    """

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Run ``operation`` on a private copy of ``key``'s record and save what it
        returns (None deletes), atomically; the old state stays when it raises."""
        ...


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """One row of ``store.list()``: sizes and reservation, never content.

    ``expired``: its ``expires_at`` has passed, by the store's clock. Only
    ``list(purge=False)`` shows an unreserved expired conversation (waiting for
    the next purge); a reserved one stays until its holder ends or is recovered.
    """

    key: str
    identity: dict[str, str] | None
    messages: int
    bytes: int
    updated_at: str
    expires_at: str | None
    active: bool
    reservation: dict[str, Any] | None = field(default=None)
    expired: bool = False


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """How full a built-in store is: ``store.usage()``, and ``history_store_pressure``.

    ``sessions`` counts the conversations held, reservations of keys that have
    no record yet included (a new conversation claims its place when it is
    reserved); ``bytes`` what they retain, by the store's own measure.

    ``durability`` (``RedisHistoryStore`` only; None elsewhere and before the store
    has reached its server) says in a short, stable text whether a write the server
    acknowledged survives a server crash, from its persistence settings, e.g.
    ``"appendfsync everysec: up to 1 s of acknowledged writes can be lost on a server
    crash"``, or ``"unknown: ..."`` when the server refuses ``CONFIG GET``. It is
    not part of the comparison: two usages are equal when they are as full.
    """

    sessions: int
    max_sessions: int
    bytes: int
    max_store_bytes: int
    durability: str | None = field(default=None, compare=False)

    @property
    def fraction(self) -> float:
        """The larger of the two fill ratios (1.0 = full)."""
        return max(self.sessions / self.max_sessions, self.bytes / self.max_store_bytes)


class AdminStore(Protocol):
    """What an operator's tools (``touba history``, the panel) use of a built-in store.

    ``purge=False`` (``read``, ``list``, ``usage``) reads without the purge of
    expired conversations that every other access runs first: the read-only
    commands and pages change nothing. ``read`` still answers None for an expired
    conversation; ``list`` shows it with ``expired=True``; ``usage`` counts it.
    """

    @property
    def max_sessions(self) -> int: ...

    @property
    def max_store_bytes(self) -> int: ...

    async def read(self, key: str, *, purge: bool = True) -> Record | None: ...

    async def delete(self, key: str) -> bool: ...

    async def recover(self, key: str, *, worker_stopped: bool) -> bool: ...

    async def purge_expired(self) -> int: ...

    async def list(
        self, namespace: str | None = None, *, purge: bool = True
    ) -> list[StoredConversation]: ...

    async def usage(self, *, purge: bool = True) -> StoreUsage: ...


class LogSnapshot(Protocol):
    """A conversation as the history layer sees it inside one transaction.

    A built-in store's snapshot may offer more, which the history engine uses
    when present: ``messages(start, stop)`` (the neutral messages, parsed once,
    frozen and shared), ``head_bytes`` (the stored head's UTF-8 length) and
    ``well_formed`` (a set of exchange indices whose shared messages passed the
    window check, unchanged since; the engine adds to it).
    """

    @property
    def head(self) -> Record:
        """The record without its exchanges. Its top-level dict is the caller's own;
        a built-in store's nested values are read-only (shared with the head it
        holds for the next decision, :mod:`touba.history._head`): replace them,
        do not change them in place (``TypeError``)."""
        ...

    @property
    def exchange_count(self) -> int: ...

    async def sizes(self, start: int) -> list[ExchangeSize]:
        """Sizes of exchanges ``start`` .. end, oldest first."""
        ...

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        """Private copies of the messages of exchanges ``start`` .. ``stop - 1``."""
        ...


@dataclass(frozen=True, slots=True)
class LogWrite:
    """What one transaction changes: a new head, messages dropped, messages appended.

    ``drop_last`` removes that many of the newest messages first (an exchange
    left without messages goes too). Only stores whose ``log_drops``
    attribute is True honour it (the RAM, SQLite and PostgreSQL stores, and
    custom adapters through ``transact``; not yet Redis); a caller checks
    :func:`log_drops` before sending one.
    Each appended message names its exchange, which must be the last
    existing exchange (after the drop) or the ones right after it, in order.
    ``bodies``, when given, is the compact JSON
    (:func:`~touba.history._model.canonical_json`) of each appended message, in
    order, as the history engine already encoded it to measure it: the
    built-in stores keep it instead of encoding the message again.
    """

    head: Record
    append: Sequence[tuple[int, Record]] = ()
    drop_last: int = 0
    bodies: Sequence[str] | None = None


LogOperation = Callable[
    [LogSnapshot | None, StoreUsage | None], Awaitable[tuple[LogWrite | None, T]]
]
"""``operation(snapshot, usage)``: ``snapshot`` is None for a key without a record;
``usage`` is how full the store was when the key was reserved (this reservation
included), or None when the store cannot tell (custom adapters)."""


@runtime_checkable
class LogStore(Protocol):
    """What built-in stores add to :class:`HistoryStore` for the history layer.

    ``transact_log`` reserves ``key`` (a key without a record claims its place
    among ``max_sessions`` there, or is refused with
    ``DecisionHistoryLimitExceeded`` before ``operation`` runs), calls
    ``operation(snapshot, usage)``, then appends its :class:`LogWrite` if the
    reservation still holds and the store's bounds allow it.
    """

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """Reserve ``key``, call ``operation(snapshot, usage)`` and append its
        :class:`LogWrite` if the reservation still holds and the bounds allow it."""
        ...


def log_drops(store: HistoryStore) -> bool:
    """Whether ``store``'s ``transact_log`` honours ``LogWrite.drop_last``."""
    return getattr(as_log_store(store), "log_drops", False) is True


def drop_newest(exchanges: list[list[Record]], count: int) -> list[Record]:
    """Remove the ``count`` newest messages of ``exchanges`` in place (an exchange
    left empty goes too); return them, oldest first. ``ValueError`` when there are
    fewer messages than that."""
    if count > sum(len(ex) for ex in exchanges):
        raise ValueError(f"drop_last={count} refused: the conversation holds fewer messages")
    dropped: list[Record] = []
    for _ in range(count):
        while not exchanges[-1]:
            exchanges.pop()
        dropped.append(exchanges[-1].pop())
        if not exchanges[-1]:
            exchanges.pop()
    dropped.reverse()
    return dropped


def check_appends(exchange_count: int, append: Sequence[tuple[int, Record]]) -> None:
    """Refuse appends that would rewrite history or leave a gap."""
    last = exchange_count - 1
    for index, _message in append:
        if index < max(last, 0) or index > last + 1:
            raise ValueError(
                f"append to exchange {index} refused: only exchange {last} or {last + 1} "
                "may receive messages"
            )
        last = max(last, index)


class RecordSnapshot:
    """A :class:`LogSnapshot` over a whole record (used for custom adapters)."""

    def __init__(self, head: Record, exchanges: list[list[Record]]) -> None:
        self._head = head
        self._exchanges = exchanges

    @classmethod
    def of(cls, record: Record) -> RecordSnapshot:
        if not is_split_record(record):
            raise DecisionHistoryRecordInvalid(
                "the stored value under this session key is not a touba decision history "
                "record; it was not modified. Use another namespace or delete the key"
            )
        return cls(*split_record(record))

    @property
    def head(self) -> Record:
        return self._head

    @property
    def exchange_count(self) -> int:
        return len(self._exchanges)

    async def sizes(self, start: int) -> list[ExchangeSize]:
        return [
            ExchangeSize(len(ex), sum(message_bytes(m) for m in ex))
            for ex in self._exchanges[start:]
        ]

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        # Each exchange a list of its own (the step adds its results to the copy it
        # loads; sharing the list stored each result twice).
        return [list(exchange) for exchange in self._exchanges[start:stop]]

    def apply(self, write: LogWrite) -> Record:
        exchanges = self._exchanges
        drop_newest(exchanges, write.drop_last)
        check_appends(len(exchanges), write.append)
        for index, message in write.append:
            if index == len(exchanges):
                exchanges.append([])
            exchanges[index].append(message)
        return join_record(write.head, exchanges)


class _TransactLog:
    """Runs log operations on a store that only offers ``transact``.

    Each operation then loads and saves the whole record: that is what the
    plain contract allows, and why built-in stores implement ``transact_log``.
    Such a store reports no usage (the operation gets None): its own
    ``transact`` is the only capacity check, when it saves.
    """

    log_drops = True  # the whole record is rewritten anyway

    def __init__(self, store: HistoryStore) -> None:
        self._store = store

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        async def whole(record: Record | None) -> tuple[Record | None, T]:
            snapshot = None if record is None else RecordSnapshot.of(record)
            write, result = await operation(snapshot, None)
            if write is None:
                return record, result
            return (snapshot or RecordSnapshot({}, [])).apply(write), result

        return await self._store.transact(key, whole)


def as_log_store(store: HistoryStore) -> LogStore:
    if isinstance(store, LogStore):
        return store
    return _TransactLog(store)
