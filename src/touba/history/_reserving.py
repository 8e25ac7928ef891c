"""The reservation protocol of the durable stores, written once over a backend's primitives.

:class:`Reservations` runs ``transact`` and ``transact_log`` for a durable
store (SQLite, PostgreSQL, Redis): reserve the key, show the operation its
conversation, then save if the reservation still holds, or release it; on
any failure release it, and when that release cannot be written either,
restate the store's error to say that ``recover`` is needed (an error that
is not the store's keeps its type and gets a note). A store builds one
``Reservations(backend, worker_id)`` and its ``transact`` / ``transact_log``
check the key, then delegate. ``read``, ``delete``, ``recover``, ``list``,
``usage`` and ``purge_expired`` stay the store's own.

**The tail cache.** A decision reads the tail of its conversation: the sizes
of the exchanges the window may hold, the messages of those it sends. Each
store object keeps that tail between decisions, parsed and frozen
(:mod:`touba.history._frozen`: its dicts and lists refuse changes, and the
neutral messages built from them are shared by every reader), tagged with
the conversation's *version*: the token of the reservation whose save wrote
the stored state. Every save, by any process, stores a new version, so a
reservation that sends the version it holds gets no rows back when nothing
changed, and the tail when anything did (another process saved, the key was
deleted and created again: a token is never reused, so a stale tail never
matches). After a successful save the tail holds what it held plus the
messages appended (after ``transact``, the last exchanges of the record it
saved), parsed from the very text that was stored, so it equals a fresh
read; a failure of any kind (a refused or failed save, an operation
that raised) drops the conversation from the cache. A tail is taken out of
the cache for the length of a reservation and put back when it ends, so no
two reservations share one. Snapshots also serve ``messages(start, stop)``
(the shared neutral messages, which the history engine uses instead of
parsing), ``head_bytes`` (the stored head's length) and ``well_formed`` (the
exchanges the window check passed, see :mod:`touba.history._integrity`). The
tail also holds the head its save wrote (:mod:`touba.history._head`): the next
reservation parses the stored head only when its text is not that one.

**Content mode.** A backend that cannot see edits made behind its back (Redis:
another client's LSET or LREM of a row leaves the version as it was) says so
with ``sees_edits = False`` (absent: True). A version then proves nothing, so
its reservations never send one: each brings the rows of the window (the
bodies hint), and the tail is rebuilt from them. The cache keeps, beside each
parsed message, the stored text it was parsed from; an exchange whose texts
are byte-identical to the held ones keeps its parsed messages, its neutral
messages and its window verdict (``well_formed``), and any other exchange is
parsed and checked again. A hit saves JSON parsing, building the messages and
the window check; the transfer and the driver's decoding stay. Since every
reservation carries what the bodies hint covers, only reads that reach the
last exchange (the window) widen it: a look further back (a summary's
exchanges) costs a ``read_rows`` call and leaves the hint alone. And the hints
a reservation reads ahead by are those of its own kind of operation (its
code: a session's ``add_items`` reads the last exchange, its ``get_items`` the
window), so a narrow claim carries few rows; the exchanges it did not bring
stay in the tail, parsed with their texts (``_Tail.older``), for a later
claim that brings the very same texts to reuse; nothing is served from them
unchecked. A drop takes the rows it deletes from the claim that brought them.

**Bound.** The cache holds at most :data:`CACHE_CONVERSATIONS` conversations
(least recently used first out) and at most :data:`CACHE_BYTES` bytes of
message JSON over all of them (parsed, a message takes about twice its JSON
in memory); each conversation holds only the tail the history layer read
lately (the read-ahead hints below, at most :data:`MAX_TAIL` exchanges). A
tail larger than :data:`CACHE_BYTES` is not kept.

**Read-ahead hints.** How far back the history layer reads, in exchanges
from the end: one hint for sizes, one for message bodies, each the most the
snapshots of this store object's last :data:`HINT_MEMORY` log transactions
were asked for (:class:`Recent`: one wide read widens the next ones for a
while, not for good), plus one (a conversation shorter than its window is
read from its start, one exchange further back each decision), at most
:data:`MAX_TAIL`. A reservation reads
that much with the reserving call; an older range, when asked, costs one
call to ``Backend.read_sizes`` or ``Backend.read_rows`` (and joins the tail).
A decision whose tail is cached or read ahead costs two backend calls:
``reserve``, then ``save`` (or ``release``).

**The primitives** (:class:`Backend`). Each is one round trip to the store
(one transaction, one script) and atomic. Every method may raise the store's
typed errors (its driver's exceptions translated in one place, chained with
``raise ... from``, so that ``error.__cause__`` is an instance of
``driver_errors``); ``label`` names the store in messages. The stored state
of a key: a *head* (JSON text), ``split`` (True: a touba record whose
messages are rows; False: any other JSON object, kept whole in ``head``, no
rows, ``exchanges == 0``), its *rows* (one per message: ``seq`` 0.. in order
within the conversation, ``exchange``, ``bytes`` = UTF-8 length of
``body``, ``body`` = the message's compact JSON), the totals
(``exchanges``, ``messages``, ``bytes`` = head bytes + message bytes), an
expiry, a *version* (text or NULL) and the reservation (``token``,
``worker_id``, ``pid``, ``host``, ``since``; a reservation of a key without
a record is a *bare* one: it holds a place among ``max_sessions``). The
version must change with every change of the key's rows (the head is read
at every reservation), by a touba save (which stores its token) or by
anyone else where the backend can see it (SQLite and PostgreSQL: a trigger
on the messages table sets it to NULL; a backend that cannot see edits made
behind its back, as Redis with other clients, says so in its docstring).
Usage (places held, records plus bare reservations; bytes retained) must be
readable in O(1)::

    reserve(key, reservation: Reservation, read: Read) -> Reserved
        Refuse with DecisionHistoryBusy (busy(key, ...)) when `key` is reserved.
        A stored record whose expiry has passed is treated as absent (delete
        it). A key without a record: refuse with DecisionHistoryLimitExceeded
        (check_sessions(places held, max_sessions)) when every place is held,
        else take one (a bare reservation). Write the reservation so that it
        outlives the process (it need not outlive the machine: once a power
        loss has stopped its holder, a reservation undone leaves the key as it
        was before, which is what recovery would make of it). A key whose
        version is NULL (a bare reservation, rows edited by someone else) gets
        reservation.token as its version, so that an edit made while the key
        is reserved shows at the save. Return Reserved(head, split, exchanges,
        messages, bytes, version, usage, sizes, rows): version as it is after
        the call; head None for a key without a record (then sizes and rows
        are None); usage counts this reservation. With read.whole: rows = every
        row (exchange, bytes, body) ordered by (exchange, seq), sizes unused.
        Otherwise, when read.cached is not None and equals the stored version:
        sizes = rows = None (nothing read); else rows = the rows of exchanges
        max(0, exchanges - read.bodies) .. exchanges - 1 and sizes = (exchange,
        messages, bytes) of the exchanges before those whose rows are read,
        from max(0, exchanges - read.sizes) on (read.bodies <= read.sizes).
        On return `key` is held by reservation.token; when it raises, nothing
        is held: a failure that may have left the reservation written (a lost
        commit reply, a cancellation while the call runs) is the backend's to
        release before it raises.
        Purge every expired record at most once a minute, or when the store is
        80 % full or this reservation would not fit otherwise.
    save(key, token, write: Write) -> None
        Refuse with DecisionHistoryBusy (busy(key, " (its reservation was
        recovered while this one ran; nothing saved)")) unless `token` holds
        `key`. With write.rewrite drop the stored rows first. Append write.rows
        (seq, exchange, bytes, body) as given. Store write.head, write.split,
        write.namespace and write.identity (for list), write.exchanges,
        write.messages, write.bytes, a fresh expiry (now + ttl), and as the
        version `token` if write.rewrite or if the stored version is still
        write.seen (nobody changed the rows while the key was reserved), else
        NULL; clear the reservation. Then refuse with
        DecisionHistoryLimitExceeded (check_capacity(is_new=write.is_new,
        sessions=places held less this key's, store_bytes_after=bytes held))
        when the store would exceed max_store_bytes, or max_sessions for
        write.is_new; expired records never refuse a write: when it would not
        fit, purge them first (write.growth = write.bytes less the record's
        bytes before, to decide without reading). A refusal changes nothing.
    delete(key, token) -> None
        Delete the record, its rows and the reservation if `token` holds `key`,
        else DecisionHistoryBusy as for save.
    release(key, token) -> None
        Clear the reservation if `token` holds `key` (a bare reservation goes
        away with its place); otherwise do nothing, without raising.
    save_if(key, version, head, token, write: Write, seen: Seen | None) -> bool
        (optional) A log write (``Write.rewrite`` false) without a reservation,
        for ``Reservations.transact_log_optimistic``: in one transaction, if
        `key` is unreserved, unexpired, at `version` and its head is the text
        `head` (in content mode also: its exchange count, and the exchange
        entries and rows `seen` describes, byte for byte), write as ``save``
        does (capacity included) with `token` as the new version and return
        True; otherwise, or when the write would not fit, change nothing and
        return False (the reserved path then runs, and refuses what must be
        refused). A write with ``Write.dropped`` is made only by a backend in
        content mode or one that says ``drops_unreserved = True``: it deletes
        the newest rows only if they are ``Write.dropped`` many and weigh
        ``Write.dropped_bytes`` (they were weighed from the cached tail), else
        returns False. A write that only renews the expiry (no rows, nothing
        dropped, the head unchanged) may commit without waiting for the disk.
        A backend without ``save_if`` always takes the reserved path.
    peek(key, read: Read) -> Reserved | None
        (optional, content mode) What ``reserve`` reads, read without reserving
        and atomically, renewing the expiry as a save of the unchanged head
        would: DecisionHistoryBusy when `key` is reserved, None when only a
        reservation can answer (see ``Reservations._peeked``).
    read_sizes(key, start, stop) -> [(exchange, messages, bytes), ...]
        Of the reserved key's exchanges start .. stop - 1, ordered by exchange
        (an exchange without messages may be left out).
    read_rows(key, start, stop) -> [(exchange, bytes, body), ...]
        The rows of the reserved key's exchanges start .. stop - 1, ordered by
        (exchange, seq).

``driver_errors`` (a tuple of exception types) and ``label`` are attributes, and
``sees_edits`` (optional, see content mode above).
:func:`parse_object` and :func:`identity_columns` are the stores' shared
helpers for heads and the identity columns.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol, TypeVar

from touba.errors import (
    DecisionHistoryBusy,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._common import (
    Reservation,
    appended_bodies,
    encode_json,
    encode_record,
    new_token,
)
from touba.history._frozen import parse_frozen, thaw
from touba.history._head import HeldHead, encode_head, parse_head
from touba.history._model import Message, canonical_json, message_from_dict, parse_json
from touba.history._record import join_record
from touba.history._sqlite import describe
from touba.history._store import (
    LogOperation,
    LogWrite,
    Operation,
    Record,
    StoreUsage,
    check_appends,
)
from touba.history._window import ExchangeSize

__all__ = [
    "CACHE_BYTES",
    "CACHE_CONVERSATIONS",
    "HINT_MEMORY",
    "MAX_TAIL",
    "OPTIMISTIC_READ",
    "Backend",
    "Read",
    "Recent",
    "Reservations",
    "Reserved",
    "Rows",
    "Seen",
    "Sizes",
    "TailCache",
    "Write",
    "dropped_elsewhere",
    "identity_columns",
    "parse_object",
]

T = TypeVar("T")
logger = logging.getLogger("touba.history")

MAX_TAIL: Final = 1024  # most exchanges read ahead with a reservation
HINT_MEMORY: Final = 16  # transactions a read-ahead hint remembers (see Recent)
KINDS: Final = 64  # kinds of operation whose read-ahead a store object keeps (content mode)
CACHE_CONVERSATIONS: Final = 256  # conversations whose tail a store object keeps
CACHE_BYTES: Final = 32 * 1024 * 1024  # message JSON bytes kept over all of them
# Content mode: most exchanges of messages an optimistic write has compared in the
# store (an operation whose kind reads more takes the reserved path).
OPTIMISTIC_READ: Final = 8

Rows = Sequence[tuple[int, int, str]]  # (exchange, bytes, body)
Sizes = Sequence[tuple[int, int, int]]  # (exchange, messages, bytes)


# -- what passes between the protocol and a backend --------------------------------------


@dataclass(frozen=True, slots=True)
class Read:
    """What a reservation reads with it (see the module docstring)."""

    whole: bool = False  # every message (``transact``); the cache is not used
    cached: str | None = None  # the version whose tail the caller holds
    sizes: int = 0  # sizes of this many trailing exchanges
    bodies: int = 0  # messages of this many trailing exchanges (<= sizes)


@dataclass(frozen=True, slots=True)
class Reserved:
    """The stored state of a key just reserved, and the store's usage with it."""

    head: str | None  # the head JSON (the whole record when not split); None: no record
    split: bool
    exchanges: int
    messages: int
    bytes: int
    version: str | None
    usage: StoreUsage
    sizes: Sizes | None = None  # None: read.cached matched (and not read.whole)
    rows: Rows | None = None


@dataclass(frozen=True, slots=True)
class Write:
    """A new state for a reserved key, encoded and measured (see ``Backend.save``)."""

    head: str
    split: bool
    namespace: str | None
    identity: str | None
    exchanges: int
    messages: int
    bytes: int
    rows: Sequence[tuple[int, int, int, str]]  # (seq, exchange, bytes, body)
    rewrite: bool  # drop the stored messages first (``transact``), or only append
    is_new: bool  # the key had no record: its place was held by the reservation
    growth: int  # ``bytes`` less what the record retained before
    seen: str | None = None  # the version the reservation returned (``Reserved.version``)
    dropped: int = 0  # the newest messages deleted first: those of seq >= messages - dropped
    dropped_from: int = 0  # the exchange of the oldest of them (a bound for the delete)
    dropped_bytes: int = 0  # what they weigh (a save without a reservation checks it)

    @property
    def kept(self) -> int:
        """The stored messages a log write keeps: the seq of its first appended row,
        and of the first it drops."""
        return self.messages - len(self.rows)

    def renews(self, head: str) -> bool:
        """Whether this log write, on a record whose stored head is the text ``head``,
        only renews its expiry (a read: the same head, nothing appended or dropped)."""
        return not (self.rows or self.dropped) and self.head == head


@dataclass(frozen=True, slots=True)
class Seen:
    """What an optimistic write was computed from, for a backend in content mode
    (see ``Backend.save_if``): the exchange count, the (first row, messages,
    bytes) of each exchange from ``entries_from`` on, and the (exchange, body)
    of each row from row ``rows_from`` (the first of exchange ``bodies_from``)."""

    count: int
    entries_from: int
    entries: list[tuple[int, int, int]]
    rows_from: int
    rows: list[tuple[int, str]]


class Backend(Protocol):
    """The primitives a durable store supplies; see the module docstring. A backend
    whose ``save`` honours ``Write.dropped`` says so with ``drops = True`` (absent:
    ``LogWrite.drop_last`` is refused)."""

    driver_errors: tuple[type[BaseException], ...]
    label: str  # the store's name in messages ("SQLite", "PostgreSQL", "Redis")

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved: ...

    async def save(self, key: str, token: str, write: Write) -> None: ...

    async def delete(self, key: str, token: str) -> None: ...

    async def release(self, key: str, token: str) -> None: ...

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes: ...

    async def read_rows(self, key: str, start: int, stop: int) -> Rows: ...


# -- helpers the backends share ----------------------------------------------------------


class Recent:
    """The most of the last :data:`HINT_MEMORY` values noted (0 before any): a
    read-ahead hint that widens at once and narrows again once that many
    transactions all needed less, so one wide read (a whole session read once, a
    bulk append) does not widen every later one."""

    __slots__ = ("_values", "most")

    def __init__(self) -> None:
        self._values: deque[int] = deque(maxlen=HINT_MEMORY)
        self.most = 0

    def note(self, value: int) -> None:
        self._values.append(value)
        self.most = value if value >= self.most else max(self._values)


def _kind(operation: object) -> object:
    """What makes operations of one kind (the same code, a closure's included)."""
    return getattr(operation, "__code__", None)


def parse_object(text: str, key: str, what: str, label: str) -> Record:
    """Stored JSON text that must be an object, or DecisionHistoryRecordInvalid."""
    try:
        value = parse_json(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _damaged(key, what, label)
    return value


def dropped_elsewhere(
    key: str, label: str, found: int, expected: int
) -> DecisionHistoryRecordInvalid:
    """A save's drop (``Write.dropped``) found other rows than the head promised."""
    return DecisionHistoryRecordInvalid(
        f"the messages of conversation {key} in the {label} store were changed behind "
        f"touba ({found} found where {expected} were to be dropped); nothing was saved. "
        f"Inspect it with `touba history show {key}`"
    )


def _damaged(key: str, what: str, label: str) -> DecisionHistoryRecordInvalid:
    return DecisionHistoryRecordInvalid(
        f"{what} of conversation {key} in the {label} store is damaged (not a JSON object); "
        f"it was not modified. Inspect it with `touba history show {key}` or delete it"
    )


def identity_columns(head: Record) -> tuple[str | None, str | None]:
    """Namespace and identity JSON of a touba head, for ``list`` (None otherwise)."""
    identity = head.get("identity")
    if not isinstance(identity, dict):
        return None, None
    items = tuple(identity.items())
    if all(isinstance(value, str) for _name, value in items):  # touba's: the same each save
        return _identity_of(items)
    namespace = identity.get("namespace")
    return (namespace if isinstance(namespace, str) else None), encode_json(identity, "identity")


@functools.lru_cache(maxsize=1024)
def _identity_of(items: tuple[tuple[str, str], ...]) -> tuple[str | None, str]:
    identity = dict(items)
    return identity.get("namespace"), encode_json(identity, "identity")


def _dense(sizes: Sizes, start: int, stop: int) -> list[ExchangeSize]:
    """One size per exchange ``start`` .. ``stop - 1`` (0 for one without messages)."""
    out = [ExchangeSize(0, 0)] * (stop - start)
    for exchange, messages, size in sizes:
        if start <= exchange < stop:
            out[exchange - start] = ExchangeSize(messages, size)
    return out


def _frozen_object_of(body: str, key: str, label: str) -> Record:
    """A stored message, parsed frozen; DecisionHistoryRecordInvalid unless an object."""
    try:
        value = parse_frozen(body)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _damaged(key, "a message", label)
    return value


def _grouped(
    rows: Rows, start: int, stop: int, key: str, label: str
) -> tuple[list[list[Record]], list[int]]:
    """Messages of exchanges ``start`` .. ``stop - 1``, parsed and frozen, and the
    JSON bytes of each exchange."""
    out: list[list[Record]] = [[] for _ in range(stop - start)]
    sizes = [0] * (stop - start)
    for exchange, size, body in rows:
        if not start <= exchange < stop:
            raise _outside(key, label, exchange, start, stop)
        out[exchange - start].append(_frozen_object_of(body, key, label))
        sizes[exchange - start] += size
    return out, sizes


def _outside(key: str, label: str, exchange: int, start: int, stop: int) -> Exception:
    return DecisionHistoryRecordInvalid(
        f"a message of conversation {key} in the {label} store names exchange "
        f"{exchange}, outside {start} .. {stop - 1}; it was not modified. Inspect it "
        f"with `touba history show {key}` or delete it"
    )


def _texts(rows: Rows, start: int, stop: int, key: str, label: str) -> list[list[str]]:
    """The stored texts of the messages of exchanges ``start`` .. ``stop - 1``."""
    out: list[list[str]] = [[] for _ in range(stop - start)]
    for exchange, _size, body in rows:
        if not start <= exchange < stop:
            raise _outside(key, label, exchange, start, stop)
        out[exchange - start].append(body)
    return out


# -- the tail of one conversation, and the cache of them ----------------------------------


class _Tail:
    """The parsed tail of one conversation at one version, owned by one reservation at
    a time: the sizes of exchanges ``sizes_first`` .. ``count - 1``, and the frozen
    messages of exchanges ``bodies_first`` .. ``count - 1`` with their JSON bytes and
    the neutral messages built from them on first use."""

    __slots__ = (
        "bodies_first",
        "body_bytes",
        "count",
        "head",
        "messages",
        "older",
        "records",
        "sizes",
        "sizes_first",
        "texts",
        "totals",
        "version",
        "well_formed",
    )

    def __init__(
        self,
        version: str,
        count: int,
        sizes_first: int,
        sizes: list[ExchangeSize],
        bodies_first: int,
        records: list[list[Record]],
        body_bytes: list[int],
        texts: list[list[str]] | None = None,
    ) -> None:
        self.version = version
        self.count = count
        self.sizes_first = sizes_first
        self.sizes = sizes
        self.bodies_first = bodies_first
        self.records = records
        self.body_bytes = body_bytes
        self.messages: list[tuple[Message, ...] | None] = [None] * len(records)
        # Exchanges held whose messages passed the window check (see _integrity).
        self.well_formed: set[int] = set()
        # Content mode only: the stored text each held message was parsed from.
        self.texts = texts
        # The head this store object saved last (see _head): reused while stored.
        self.head: HeldHead | None = None
        # Content mode only: exchanges held before bodies_first, not checked by the
        # claim that made this tail; reused only once a claim brings the same texts.
        self.older: _Older | None = None
        # The conversation's (messages, bytes) at this version, as the store counts
        # them: what a save without a reservation needs (see transact_log_optimistic).
        self.totals: tuple[int, int] | None = None

    @classmethod
    def empty(cls, version: str, *, texts: bool = False) -> _Tail:
        return cls(version, 0, 0, [], 0, [], [], [] if texts else None)

    @property
    def bytes(self) -> int:
        """Message (and head) JSON bytes held."""
        older = 0 if self.older is None else sum(self.older.body_bytes)
        return sum(self.body_bytes) + older + (0 if self.head is None else self.head.size)

    def covers(self, sizes: int, bodies: int) -> bool:
        """Whether it holds what a reservation reading these hints would read, but
        for the one exchange of slack a hint keeps for growth (a tail that lost its
        last exchange to a drop still serves; a read that reaches further back
        costs one backend call, see :class:`_Snapshot`)."""
        return self.sizes_first <= max(0, self.count - sizes + 1) and self.bodies_first <= max(
            0, self.count - bodies + 1
        )

    def trim(self, sizes: int, bodies: int) -> None:
        """Forget what lies before the hints."""
        first = max(0, self.count - sizes)
        if first > self.sizes_first:
            del self.sizes[: first - self.sizes_first]
            self.sizes_first = first
        first = max(0, self.count - bodies)
        if first > self.bodies_first:
            cut = first - self.bodies_first
            del self.records[:cut], self.body_bytes[:cut], self.messages[:cut]
            if self.texts is not None:
                del self.texts[:cut]
            self.bodies_first = first
            self.well_formed = {i for i in self.well_formed if i >= first}
        if self.older is not None:
            self.older.trim(first)

    def prepend_sizes(self, start: int, older: list[ExchangeSize]) -> None:
        self.sizes[:0] = older
        self.sizes_first = start

    def prepend_records(
        self,
        start: int,
        older: list[list[Record]],
        sizes: list[int],
        texts: list[list[str]] | None = None,
    ) -> None:
        if self.texts is not None:
            assert texts is not None
            self.texts[:0] = texts
        self.records[:0] = older
        self.body_bytes[:0] = sizes
        self.messages[:0] = [None] * len(older)
        self.bodies_first = start
        self.older = None  # the range read now replaces what was held unchecked

    def neutral(self, start: int, stop: int) -> list[tuple[Message, ...]]:
        """The neutral messages of exchanges ``start`` .. ``stop - 1`` (held), each
        exchange built once."""
        first = self.bodies_first
        out = self.messages[start - first : stop - first]
        if None in out:
            for position, messages in enumerate(out):
                if messages is None:
                    records = self.records[start - first + position]
                    built = tuple(message_from_dict(m) for m in records)
                    out[position] = self.messages[start - first + position] = built
        return out  # type: ignore[return-value]  # every None was replaced

    @classmethod
    def written(
        cls, version: str, write: Write, sizes_first: int, bodies_first: int, *, texts: bool = False
    ) -> _Tail:
        """The tail of a whole record just saved (``write.rewrite``), parsed from the
        text stored: sizes from exchange ``sizes_first``, messages from ``bodies_first``
        (with their texts, in content mode)."""
        count = write.exchanges
        sizes = [(0, 0)] * (count - sizes_first)
        records: list[list[Record]] = [[] for _ in range(count - bodies_first)]
        body_bytes = [0] * (count - bodies_first)
        held: list[list[str]] | None = [[] for _ in records] if texts else None
        for _seq, exchange, size, body in write.rows:
            if exchange >= sizes_first:
                messages, total = sizes[exchange - sizes_first]
                sizes[exchange - sizes_first] = (messages + 1, total + size)
            if exchange >= bodies_first:
                records[exchange - bodies_first].append(parse_frozen(body))
                body_bytes[exchange - bodies_first] += size
                if held is not None:
                    held[exchange - bodies_first].append(body)
        weights = [ExchangeSize(messages, total) for messages, total in sizes]
        return cls(version, count, sizes_first, weights, bodies_first, records, body_bytes, held)

    @classmethod
    def checked(
        cls,
        version: str,
        count: int,
        sizes_first: int,
        sizes: list[ExchangeSize],
        bodies_first: int,
        rows: Rows,
        held: _Tail | None,
        key: str,
        label: str,
    ) -> _Tail:
        """Content mode: the tail of ``rows`` (exchanges ``bodies_first`` .. ``count -
        1``; ``sizes`` weighs those before), taking from ``held`` the parsed messages,
        neutral messages and window verdict of every exchange whose stored texts are
        byte-identical to the ones they were parsed from; any other exchange is parsed
        (and will be checked) again."""
        texts: list[list[str]] = [[] for _ in range(count - bodies_first)]
        body_bytes = [0] * (count - bodies_first)
        for exchange, size, body in rows:
            if not bodies_first <= exchange < count:
                raise _outside(key, label, exchange, bodies_first, count)
            texts[exchange - bodies_first].append(body)
            body_bytes[exchange - bodies_first] += size
        sizes = sizes + [ExchangeSize(len(t), b) for t, b in zip(texts, body_bytes, strict=True)]
        parsed = None if held is None else _Older.of(held)
        records: list[list[Record]] = []
        reused: list[tuple[int, int]] = []  # (position here, position in parsed)
        for position, bodies in enumerate(texts):
            at = None if parsed is None else parsed.at(bodies_first + position, bodies)
            if at is not None:
                assert parsed is not None
                records.append(parsed.records[at])
                reused.append((position, at))
                continue
            records.append([_frozen_object_of(body, key, label) for body in bodies])
        tail = cls(version, count, sizes_first, sizes, bodies_first, records, body_bytes, texts)
        if parsed is not None:
            for position, at in reused:
                tail.messages[position] = parsed.messages[at]
                if parsed.first + at in parsed.well_formed:
                    tail.well_formed.add(bodies_first + position)
            tail.older = parsed.before(bodies_first)  # kept for a wider claim to check
        return tail

    def drop(self, rows: Sequence[tuple[int, int]]) -> bool:
        """Forget the newest messages a save deleted (``rows``: the exchange and bytes
        of each, in stored order, as ``Reservations._dropped`` read them), and the
        exchanges they leave empty; False when the tail does not hold them all
        (nothing changed then, but for rows out of stored order: either way such
        a tail is not to be kept)."""
        if not rows or rows[0][0] < max(self.sizes_first, self.bodies_first):
            return False
        counts: dict[int, int] = {}
        for exchange, _size in rows:
            counts[exchange] = counts.get(exchange, 0) + 1
        for exchange, n in counts.items():  # only the last exchanges, each holding them
            if exchange >= self.count or n > len(self.records[exchange - self.bodies_first]):
                return False
        for exchange, size in reversed(rows):  # newest first: always the last exchange
            if exchange != self.count - 1:
                return False  # pragma: no cover - rows in stored order always are
            position = exchange - self.bodies_first
            self.records[position].pop()
            built = self.messages[position]
            if built is not None:
                self.messages[position] = built[:-1]
            if self.texts is not None:
                self.texts[position].pop()
            self.body_bytes[position] -= size
            old = self.sizes[exchange - self.sizes_first]
            self.sizes[exchange - self.sizes_first] = ExchangeSize(
                old.messages - 1, old.bytes - size
            )
            self.well_formed.discard(exchange)
            if not self.records[position]:  # emptied: the exchange is gone
                self.count -= 1
                del self.records[position], self.body_bytes[position], self.messages[position]
                del self.sizes[exchange - self.sizes_first]
                if self.texts is not None:
                    del self.texts[position]
        return True

    def seen(self, sizes_from: int, bodies_from: int, messages: int) -> Seen | None:
        """Content mode: what an operation that read sizes from exchange
        ``sizes_from`` and messages from ``bodies_from`` on saw of a conversation of
        ``messages`` messages (None when this tail does not hold all of it)."""
        entries_from = min(sizes_from, bodies_from, self.count)
        if self.texts is None or entries_from < self.sizes_first or bodies_from < self.bodies_first:
            return None
        weights = self.sizes[entries_from - self.sizes_first :]
        first = messages - sum(w.messages for w in weights)
        entries: list[tuple[int, int, int]] = []
        rows_from = messages
        for exchange, weight in enumerate(weights, entries_from):
            if exchange == bodies_from:
                rows_from = first
            entries.append((first, weight.messages, weight.bytes))
            first += weight.messages
        held = self.texts[bodies_from - self.bodies_first :]
        rows = [(e, body) for e, bodies in enumerate(held, bodies_from) for body in bodies]
        return Seen(self.count, entries_from, entries, rows_from, rows)

    def append(self, version: str, rows: Sequence[tuple[int, int, int, str]]) -> None:
        """Add the messages a save appended, parsed from the text it stored; the
        tail is then at ``version``."""
        for _seq, exchange, size, body in rows:
            if exchange == self.count:
                self.count += 1
                self.sizes.append(ExchangeSize(0, 0))
                self.records.append([])
                self.body_bytes.append(0)
                self.messages.append(None)
                if self.texts is not None:
                    self.texts.append([])
            if exchange >= self.sizes_first:
                old = self.sizes[exchange - self.sizes_first]
                self.sizes[exchange - self.sizes_first] = ExchangeSize(
                    old.messages + 1, old.bytes + size
                )
            if exchange >= self.bodies_first:
                position = exchange - self.bodies_first
                record = parse_frozen(body)
                self.records[position].append(record)
                self.body_bytes[position] += size
                built = self.messages[position]
                if built is not None:  # the ones built stay: only this one is new
                    self.messages[position] = (*built, message_from_dict(record))
                if self.texts is not None:
                    self.texts[position].append(body)
            self.well_formed.discard(exchange)
        self.version = version


@dataclass(slots=True)
class _Older:
    """Content mode: parsed exchanges ``first`` .. with the stored texts each was
    parsed from, their neutral messages, JSON bytes and window verdicts; a parse
    cache by exchange and text, trusted for nothing until a claim brings the
    same texts (see :meth:`_Tail.checked`)."""

    first: int
    records: list[list[Record]]
    texts: list[list[str]]
    messages: list[tuple[Message, ...] | None]
    body_bytes: list[int]
    well_formed: set[int]

    @classmethod
    def of(cls, tail: _Tail) -> _Older | None:
        """All that ``tail`` holds parsed with its texts (its older part first)."""
        if tail.texts is None:
            return None
        older = tail.older
        if older is None or older.first + len(older.records) != tail.bodies_first:
            older = cls(tail.bodies_first, [], [], [], [], set())
        return cls(
            older.first,
            older.records + tail.records,
            older.texts + tail.texts,
            older.messages + tail.messages,
            older.body_bytes + tail.body_bytes,
            older.well_formed | tail.well_formed,
        )

    def at(self, exchange: int, texts: list[str]) -> int | None:
        """The position of ``exchange`` when it was parsed from exactly ``texts``."""
        position = exchange - self.first
        if 0 <= position < len(self.texts) and self.texts[position] == texts:
            return position
        return None

    def before(self, first: int) -> _Older | None:
        """The exchanges before ``first`` (None: none)."""
        cut = first - self.first
        if cut <= 0:
            return None
        return _Older(
            self.first,
            self.records[:cut],
            self.texts[:cut],
            self.messages[:cut],
            self.body_bytes[:cut],
            {e for e in self.well_formed if e < first},
        )

    def trim(self, first: int) -> None:
        """Forget the exchanges before ``first``."""
        cut = first - self.first
        if cut > 0:
            del self.records[:cut], self.texts[:cut], self.messages[:cut], self.body_bytes[:cut]
            self.first = first
            self.well_formed = {e for e in self.well_formed if e >= first}


class TailCache:
    """Parsed tails of conversations, least recently used first out (see the module
    docstring for the bound). Safe to use from several threads."""

    def __init__(
        self, *, conversations: int = CACHE_CONVERSATIONS, max_bytes: int = CACHE_BYTES
    ) -> None:
        self.max_conversations = conversations
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tails: OrderedDict[str, _Tail] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._tails)

    @property
    def bytes(self) -> int:
        """Message JSON bytes held now."""
        return self._bytes

    def take(self, key: str) -> _Tail | None:
        """Remove and return the tail of ``key``, if held."""
        with self._lock:
            tail = self._tails.pop(key, None)
            if tail is not None:
                self._bytes -= tail.bytes
            return tail

    def put(self, key: str, tail: _Tail) -> None:
        """Keep ``tail`` as the newest; evict the oldest beyond the bound."""
        with self._lock:
            old = self._tails.pop(key, None)
            if old is not None:
                self._bytes -= old.bytes
            if tail.bytes > self.max_bytes:
                return
            self._tails[key] = tail
            self._bytes += tail.bytes
            while len(self._tails) > self.max_conversations or self._bytes > self.max_bytes:
                _key, evicted = self._tails.popitem(last=False)
                self._bytes -= evicted.bytes

    def drop(self, key: str) -> None:
        self.take(key)

    def peek(self, key: str) -> _Tail | None:
        """The tail of ``key`` without taking it (for tests and inspection)."""
        with self._lock:
            return self._tails.get(key)


# -- the protocol ------------------------------------------------------------------------


class Reservations:
    """``transact`` and ``transact_log`` over one backend, with its tail cache."""

    def __init__(self, backend: Backend, worker_id: str, cache: TailCache | None = None) -> None:
        self.backend = backend
        self.worker_id = worker_id
        self.cache = cache if cache is not None else TailCache()
        # Content mode (see the docstring): the backend cannot see edits made behind it.
        self.content = not getattr(backend, "sees_edits", True)
        # How many trailing exchanges the history layer read lately (see the docstring).
        self._sizes = Recent()
        self._bodies = Recent()
        # Content mode: what each kind of operation (its code) read lately, so that
        # a claim carries the rows that operation reads, not the widest one's.
        self._kinds: OrderedDict[object, tuple[Recent, Recent]] = OrderedDict()

    @property
    def sizes_hint(self) -> int:
        """Trailing exchanges whose sizes a reservation reads ahead."""
        return self._sizes.most

    @property
    def bodies_hint(self) -> int:
        """Trailing exchanges whose messages a reservation reads ahead."""
        return self._bodies.most

    def _settle(self, snapshot: _Snapshot | None, operation: object) -> None:
        """Note what a transaction's snapshot was asked for: the hints become the most
        the last :data:`HINT_MEMORY` transactions asked (see :class:`Recent`); in
        content mode, also the most the last ones of ``operation``'s kind asked."""
        sizes, bodies = (0, 0) if snapshot is None else snapshot.asked
        sizes, bodies = min(MAX_TAIL, max(sizes, bodies)), min(MAX_TAIL, bodies)
        self._sizes.note(sizes)
        self._bodies.note(bodies)
        kind = _kind(operation) if self.content else None
        if kind is not None:
            hints = self._kinds.pop(kind, None) or (Recent(), Recent())
            hints[0].note(sizes)
            hints[1].note(bodies)
            self._kinds[kind] = hints  # the most recent last
            while len(self._kinds) > KINDS:
                self._kinds.popitem(last=False)

    def _read_ahead(self, operation: object) -> tuple[int, int]:
        """What a reservation for ``operation`` reads ahead: (sizes, bodies)."""
        hints = self._kinds.get(_kind(operation)) if self.content else None
        if hints is None:
            return self.sizes_hint, self.bodies_hint
        return hints[0].most, hints[1].most

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Reserve ``key``, give ``operation`` a private copy of its whole record,
        save what it returns (``None`` deletes). Raises what the backend and
        ``operation`` raise; the key is released after any failure."""
        reservation = Reservation.new(self.worker_id)
        token = reservation.token
        self.cache.drop(key)
        reserved = await self.backend.reserve(key, reservation, Read(whole=True))
        written = None
        try:
            loaded = self._record(key, reserved)
            record, result = await operation(loaded)
            if record is None:
                if reserved.head is None:
                    await self.backend.release(key, token)
                else:
                    await self.backend.delete(key, token)
            else:
                written = _whole(record, reserved)
                await self.backend.save(key, token, written)
        except BaseException as e:
            replacement = await self._fail(e, key, token)
            if replacement is None:
                raise
            raise replacement from e.__cause__
        if written is not None and written.split:  # its tail, as a log write leaves it
            self._keep(key, None, token, written)
        return result

    async def transact_log(self, key: str, operation: LogOperation[T]) -> T:
        """Reserve ``key``, call ``operation(snapshot, usage)``, then save its
        :class:`~touba.history.LogWrite` (or release when it returns None). Raises
        what the backend and ``operation`` raise; the key is released after any
        failure, and the conversation's cached tail dropped."""
        reservation = Reservation.new(self.worker_id)
        token = reservation.token
        tail = self.cache.take(key)
        held_head = None if tail is None else tail.head  # compared with the stored text
        sizes, bodies = self._read_ahead(operation)
        if tail is not None and not self.content and not tail.covers(sizes, bodies):
            tail = None  # (content mode: a parse cache whatever it covers)
        read = Read(
            cached=None if tail is None or self.content else tail.version,
            sizes=sizes,
            bodies=bodies,
        )
        reserved = await self.backend.reserve(key, reservation, read)
        head_bytes = 0  # what the store counts for the stored head (the save needs it too)
        try:
            snapshot = None
            if reserved.head is not None:
                label = self.backend.label
                if reserved.split:
                    tail = await self._tail(key, reserved, read, tail)
                    head, held_head, head_bytes = _head_of(key, reserved.head, held_head, label)
                else:
                    tail = held_head = None
                    head = parse_object(reserved.head, key, "the stored record", label)
                    head_bytes = len(reserved.head.encode())
                snapshot = _Snapshot(self, key, head, head_bytes, tail)
            else:  # no record (deleted since, even by this object): nothing held is its tail
                tail = held_head = None
            try:
                write, result = await operation(snapshot, reserved.usage)
            finally:
                self._settle(snapshot, operation)
            encoded = None
            dropped = None
            if write is None:
                await self.backend.release(key, token)
            else:
                dropped = await self._dropped(key, reserved, write.drop_last, tail)
                encoded, held_head = _appended(reserved, head_bytes, write, held_head, dropped)
                await self.backend.save(key, token, encoded)
        except BaseException as e:
            replacement = await self._fail(e, key, token)
            if replacement is None:
                raise
            raise replacement from e.__cause__
        stored = None if reserved.head is None else (reserved.messages, reserved.bytes)
        self._keep(key, tail, token, encoded, held_head, dropped, stored)
        return result

    async def transact_log_optimistic(
        self, key: str, operation: LogOperation[T], *, drops: bool = False
    ) -> T:
        """``transact_log`` for an operation that may run twice: one that only reads
        its snapshot and returns what to write (a session's append or read; not a
        decision, which calls a model while it holds the key).

        When this store object holds the conversation's tail with its head and
        totals, the operation runs on it at once, with no reservation and usage
        None, and its write is saved in one backend call (``save_if``) that
        succeeds only if the key is still stored at that version with that head
        text, unreserved and unexpired, and the write fits: one round trip and one
        commit where the reserved path takes two of each. In content mode the
        backend also compares, as text, every exchange entry and row the
        operation read (the tail's unchecked older part may serve the read, since
        it is compared too), so an operation whose kind lately read more than
        :data:`OPTIMISTIC_READ` exchanges of messages reserves instead: a script
        that reads a window's rows to compare them costs more than the second
        round trip it saves (on Redis, rows copied into Lua cost about three
        times a plain LRANGE of them). Anything else
        (nothing cached, a read beyond the tail, no write or a drop, an error of
        the operation, another writer since, a reservation held, a save that
        would not fit) leaves the store untouched and runs ``transact_log``,
        which calls the operation again on the reserved state and answers, or
        refuses, as always. A failure of the save call itself raises as a save
        does (nothing is held either way). ``drops``: the operation's write drops
        messages (``LogWrite.drop_last``), which a backend makes optimistic in
        content mode (the dropped rows' sizes come from the texts it compares)
        or when it says ``drops_unreserved`` (its ``save_if`` checks that the
        rows it deletes are those the write weighed: the tail's newest, each as
        touba encodes it); elsewhere it reserves at once rather than run twice.

        A wide read in content mode is peeked instead when the backend can
        (``peek``): what a reservation reads, read without one in one atomic
        round trip that renews the expiry (reading is activity), and the
        operation run on it; it is done when its write is None or only that
        renewal (the head unchanged, nothing appended or dropped), else it runs
        again through :meth:`transact_log`.
        """
        save_if = getattr(self.backend, "save_if", None)
        if drops and not (self.content or getattr(self.backend, "drops_unreserved", False)):
            save_if = None
        if self.content and self._read_ahead(operation)[1] > OPTIMISTIC_READ:
            peek = getattr(self.backend, "peek", None)
            if peek is not None:
                return await self._peeked(key, operation, peek)
            save_if = None  # it would send back all it read: no quicker than reserving
        tail = None if save_if is None else self.cache.take(key)
        if save_if is None or tail is None or tail.totals is None or tail.head is None:
            if tail is not None:
                self.cache.put(key, tail)
            return await self.transact_log(key, operation)
        held_head = tail.head
        messages, size = tail.totals
        snapshot = _Snapshot(self, key, held_head.copy(), held_head.size, tail, cached_only=True)
        try:
            write, result = await operation(snapshot, None)
        except Exception:  # judged on a state that may be stale: the reserved path decides
            write = None
        finally:
            self._settle(snapshot, operation)
        sizes_from, bodies_from = snapshot.read_from
        seen = tail.seen(sizes_from, bodies_from, messages) if self.content else None
        known = Reserved(held_head.text, True, tail.count, messages, size, tail.version, _NO_USAGE)
        dropped = None if write is None else self._optimistic_drop(known, write, tail, seen)
        if (
            write is None
            or snapshot.uncached
            or (self.content and not seen)
            or (write.drop_last and dropped is None)
        ):
            self.cache.put(key, tail)  # as it was: the reserved path claims it again
            return await self.transact_log(key, operation)
        token = new_token()  # the version it saves, if it does
        try:
            encoded, held_head = _appended(known, held_head.size, write, held_head, dropped)
            saved = await save_if(key, tail.version, known.head, token, encoded, seen)
        except BaseException:
            self.cache.drop(key)
            raise
        if not saved:  # changed, held or full: the reserved path reads what changed
            self.cache.put(key, tail)  # (by version, or as a parse cache in content mode)
            return await self.transact_log(key, operation)
        self._keep(key, tail, token, encoded, held_head, dropped)
        return result

    async def _peeked(
        self,
        key: str,
        operation: LogOperation[T],
        peek: Callable[[str, Read], Awaitable[Reserved | None]],
    ) -> T:
        """``operation`` on the state ``peek`` read without a reservation (see
        :meth:`transact_log_optimistic`); anything it cannot answer as the reserved
        path would (no record, a read beyond what was peeked, an error, a write)
        runs :meth:`transact_log`."""
        held = self.cache.take(key)
        sizes, bodies = self._read_ahead(operation)
        read = Read(sizes=sizes, bodies=bodies)
        try:
            reserved = await peek(key, read)
        except BaseException:
            self.cache.drop(key)
            raise
        if reserved is None or reserved.head is None or not reserved.split:
            if held is not None:
                self.cache.put(key, held)
            return await self.transact_log(key, operation)
        tail = await self._tail(key, reserved, read, held)
        held_head = None if held is None else held.head
        head, held_head, head_bytes = _head_of(key, reserved.head, held_head, self.backend.label)
        snapshot = _Snapshot(self, key, head, head_bytes, tail, cached_only=True, older=False)
        try:
            write, result = await operation(snapshot, reserved.usage)
            renewed = None
            if write is not None and not snapshot.uncached and not write.drop_last:
                encoded, renewed = _appended(reserved, head_bytes, write, held_head)
                if not encoded.renews(reserved.head):
                    renewed = None  # a real write: the reserved path makes it
        except Exception:  # judged on an unreserved state: the reserved path decides
            write = renewed = None
            snapshot.uncached = True
        finally:
            self._settle(snapshot, operation)
        if snapshot.uncached or (write is not None and renewed is None):
            self.cache.put(key, tail)
            return await self.transact_log(key, operation)
        totals = (reserved.messages, reserved.bytes)
        self._keep(key, tail, "", None, renewed or held_head, None, totals)
        return result

    def _optimistic_drop(
        self, known: Reserved, write: LogWrite, tail: _Tail, seen: Seen | None
    ) -> _Drop | None:
        """What ``write.drop_last`` removes, from the tail alone, for an optimistic
        write: in content mode, where the rows the operation read (those that go
        included) are compared as text by the backend, sizes and all; else from
        the tail the version proves current (:func:`_held_drop`: the backend checks
        the sizes). None: nothing dropped, or the reserved path must decide."""
        count = write.drop_last
        if count <= 0 or not getattr(self.backend, "drops", False):
            return None
        if not self.content:
            return _held_drop(tail, known, count)
        if seen is None:
            return None
        if count > known.messages or len(seen.rows) < count:
            return None  # the rows that go were not all read
        start = max(0, known.exchanges - count)
        rows = _brought(tail, start, known.exchanges)
        if rows is None or len(rows) < count:
            return None
        return _drop_of(rows, count, start)

    async def _dropped(
        self, key: str, reserved: Reserved, count: int, tail: _Tail | None
    ) -> _Drop | None:
        """For ``LogWrite.drop_last=count``: what goes, read from the store (None
        when nothing is dropped); in content mode from ``tail`` when the claim
        brought those rows (the backend's save checks them against the head
        again). ``ValueError`` when the backend cannot drop or holds fewer messages."""
        if count <= 0:  # nothing to drop (as in the RAM store)
            return None
        if not getattr(self.backend, "drops", False):
            raise ValueError(
                "drop_last refused: this store only appends (check log_drops(store) first); "
                "nothing was saved"
            )
        if not reserved.split or count > reserved.messages:
            raise ValueError(f"drop_last={count} refused: the conversation holds fewer messages")
        # Every stored exchange holds a message: the last ``count`` hold all that go.
        start = max(0, reserved.exchanges - count)
        rows = _brought(tail, start, reserved.exchanges) if self.content else None
        if rows is None:
            rows = await self.backend.read_rows(key, start, reserved.exchanges)
        if len(rows) < count:  # fewer than the head says: the rows were changed behind it
            raise _damaged(key, "the stored record", self.backend.label)
        return _drop_of(rows, count, start)

    def _keep(
        self,
        key: str,
        tail: _Tail | None,
        token: str,
        saved: Write | None,
        head: HeldHead | None = None,
        dropped: _Drop | None = None,
        totals: tuple[int, int] | None = None,
    ) -> None:
        """Cache the tail once the reservation ended well: without the messages
        ``dropped`` and with those ``saved`` appended (then at version ``token``),
        or as it was read; with ``head``, the head stored now, and ``totals``, the
        conversation's (messages, bytes) when nothing was saved."""
        try:
            if (
                saved is not None
                and saved.dropped
                and (tail is None or dropped is None or not tail.drop(dropped.rows))
            ):  # the tail does not hold all that went: read again next time
                self.cache.drop(key)
                return
            if saved is not None and saved.rewrite:
                sizes = max(0, saved.exchanges - self.sizes_hint)
                bodies = max(0, saved.exchanges - self.bodies_hint)
                tail = _Tail.written(token, saved, sizes, bodies, texts=self.content)
            elif saved is not None:
                tail = tail or _Tail.empty(token, texts=self.content)
                tail.append(token, saved.rows)
            if tail is None or not tail.version:  # stored without a version: never matched
                return
            tail.head = head
            tail.totals = (saved.messages, saved.bytes) if saved is not None else totals
            tail.trim(self.sizes_hint, self.bodies_hint)
            self.cache.put(key, tail)
        except Exception as e:  # the decision is saved; only the cache is lost
            logger.warning("could not cache the tail of %s (%s)", key, type(e).__name__)
            self.cache.drop(key)

    async def _tail(self, key: str, reserved: Reserved, read: Read, held: _Tail | None) -> _Tail:
        """The tail of the reserved state: ``held`` when the backend said it matches,
        else the one read with the reservation."""
        count = reserved.exchanges
        label = self.backend.label
        sizes_first = max(0, count - read.sizes)
        bodies_first = max(0, count - read.bodies)
        if reserved.sizes is None or reserved.rows is None:
            if (
                not self.content
                and held is not None
                and held.version == reserved.version
                and held.count == count
            ):
                return held
            # Not what was asked (a backend must send rows on a mismatch): read them.
            sizes: Sizes = await self.backend.read_sizes(key, sizes_first, bodies_first)
            rows: Rows = await self.backend.read_rows(key, bodies_first, count)
        else:
            sizes, rows = reserved.sizes, reserved.rows
        weights = _dense(sizes, sizes_first, bodies_first)
        if self.content:
            version = reserved.version or ""
            return _Tail.checked(
                version, count, sizes_first, weights, bodies_first, rows, held, key, label
            )
        records, body_bytes = _grouped(rows, bodies_first, count, key, label)
        weights += [ExchangeSize(len(ex), b) for ex, b in zip(records, body_bytes, strict=True)]
        return _Tail(
            reserved.version or "",  # "" never equals a token: never matched again
            count,
            sizes_first,
            weights,
            bodies_first,
            records,
            body_bytes,
        )

    def _record(self, key: str, reserved: Reserved) -> Record | None:
        """The whole record of a reservation made with ``Read(whole=True)``."""
        if reserved.head is None:
            return None
        label = self.backend.label
        head = parse_object(reserved.head, key, "the stored record", label)
        if not reserved.split:
            return head
        count = max([reserved.exchanges, *(e + 1 for e, _s, _b in reserved.rows or ())])
        exchanges: list[list[Record]] = [[] for _ in range(count)]
        for exchange, _size, body in reserved.rows or ():
            exchanges[exchange].append(parse_object(body, key, "a message", label))
        return join_record(head, exchanges)

    async def _fail(self, error: BaseException, key: str, token: str) -> Exception | None:
        """After ``error`` struck while ``key`` was reserved: forget its tail and give
        the key back (see :meth:`_released_after` for what is returned)."""
        self.cache.drop(key)
        return await self._released_after(error, key, token)

    async def _released_after(self, error: BaseException, key: str, token: str) -> Exception | None:
        """Give ``key`` back after ``error``.

        Returns None when the release was written (the key is free: the live
        worker may retry), or when ``error`` is not the store's and stays the
        error to raise (a note then says the key is held). When the store
        failed and the release could not be written either, returns the
        store's error to raise instead, restated with a message that says
        ``recover`` is needed.
        """
        try:
            await self.backend.release(key, token)
            return None
        except Exception as e:
            cause = e.__cause__ or e
            logger.warning(
                "could not release the reservation of %s (%s); it stays busy until "
                "store.recover(key, worker_stopped=True)",
                key,
                type(cause).__name__,
            )
            stuck = _stuck(key, cause)
            if isinstance(error.__cause__, self.backend.driver_errors):  # a store failure
                if isinstance(error, DecisionHistoryBusy):
                    return DecisionHistoryBusy(f"{error} {stuck}", session_key=key)
                if isinstance(
                    error, DecisionHistoryStoreUnavailable | DecisionHistoryRecordInvalid
                ):
                    return type(error)(f"{error} {stuck}")
            if isinstance(error, Exception):  # not the store's: its type and text stay
                error.add_note(stuck)
            return None


def _stuck(key: str, error: BaseException) -> str:
    return (
        f"The reservation of conversation {key} could not be released either "
        f"({describe(error)}): it answers DecisionHistoryBusy until you run "
        f"store.recover(key, worker_stopped=True) (or `touba history recover {key}`) once the "
        "store works again."
    )


class _Uncached(Exception):
    """An unreserved snapshot was asked for more than the cached tail holds."""


_NO_USAGE: Final = StoreUsage(0, 0, 0, 0)  # unused: an optimistic write is never new


class _Snapshot:
    """A reserved conversation as ``transact_log`` shows it: the head (its top-level
    dict private, its nested values read-only: see :mod:`touba.history._head`),
    and the tail from the cache or the reservation; older ranges cost a backend
    call each (and join the tail)."""

    def __init__(
        self,
        owner: Reservations,
        key: str,
        head: Record,
        head_bytes: int,
        tail: _Tail | None,
        *,
        cached_only: bool = False,
        older: bool = True,
    ) -> None:
        self._owner = owner
        self._key = key
        self._head = head
        self.head_bytes = head_bytes  # what the store measures the stored head as
        self._tail = tail
        self._count = 0 if tail is None else tail.count
        self.asked = (0, 0)  # the most exchanges from the end read: (sizes, bodies)
        # Unreserved (transact_log_optimistic): the tail only. A read beyond it is
        # refused (_Uncached) and noted, so that the reserved path runs instead.
        self._cached_only = cached_only
        self.uncached = False
        # Content mode, unreserved: whether the tail's unchecked older part may
        # serve (an optimistic write compares it; a peeked read has no write).
        self._older_ok = older
        # The first exchange whose size, and whose messages, were read (count: none).
        self.read_from = [self._count, self._count]

    def _beyond(self) -> None:
        if self._cached_only:
            self.uncached = True
            raise _Uncached

    def _older_held(self, tail: _Tail, start: int) -> _Older:
        """Unreserved, content mode: the exchanges the tail keeps unchecked before
        its checked part (``_Tail.older``), when they reach back to ``start``: the
        optimistic write compares every text and entry read from them with the
        stored ones before it writes anything. Else the read is refused."""
        older = tail.older
        if (
            not self._owner.content
            or not self._older_ok
            or older is None
            or not older.first <= start
            or older.first + len(older.records) != tail.bodies_first
        ):
            self._beyond()
        assert older is not None  # _beyond raised otherwise
        return older

    def _older(self, tail: _Tail, start: int) -> None:
        """Serve the messages of exchanges ``start`` .. from ``_older_held``."""
        older = self._older_held(tail, start)
        cut = start - older.first
        tail.prepend_records(start, older.records[cut:], older.body_bytes[cut:], older.texts[cut:])
        tail.older = older.before(start)

    @property
    def head(self) -> Record:
        return self._head

    @property
    def exchange_count(self) -> int:
        return self._count

    @property
    def well_formed(self) -> set[int]:
        """Stored exchanges whose shared messages passed the window check, unchanged
        since (the history layer reads and adds to it; see ``_integrity``)."""
        return set() if self._tail is None else self._tail.well_formed

    def _ask(self, sizes: int = 0, bodies: int = 0) -> None:
        asked_sizes, asked_bodies = self.asked  # the hints take it when the transaction ends
        self.asked = (max(asked_sizes, sizes), max(asked_bodies, bodies))

    async def sizes(self, start: int) -> list[ExchangeSize]:
        """Sizes of exchanges ``start`` .. end, oldest first (a new list)."""
        start = max(start, 0)
        tail = self._tail
        if tail is None or start >= self._count:
            return []
        self._ask(sizes=self._count - start + 1)
        self.read_from[0] = min(self.read_from[0], start)
        if start < tail.sizes_first and self._cached_only:
            held = self._older_held(tail, start)
            cut, stop = start - held.first, tail.sizes_first - held.first
            weights = zip(held.texts[cut:stop], held.body_bytes[cut:stop], strict=True)
            tail.prepend_sizes(start, [ExchangeSize(len(t), b) for t, b in weights])
        if start < tail.sizes_first:
            backend = self._owner.backend
            older = await backend.read_sizes(self._key, start, tail.sizes_first)
            tail.prepend_sizes(start, _dense(older, start, tail.sizes_first))
        return tail.sizes[start - tail.sizes_first :]

    async def _held(self, start: int, stop: int) -> _Tail | None:
        """The tail, holding the bodies of ``start`` .. ``stop - 1`` (None: nothing to read)."""
        tail = self._tail
        if tail is None or start >= stop:
            return None
        owner = self._owner
        if not owner.content or stop >= self._count:  # content mode: only the window's reads
            self._ask(bodies=self._count - start + 1)
        self.read_from[1] = min(self.read_from[1], start)
        if start < tail.bodies_first and self._cached_only:
            self._older(tail, start)
        if start < tail.bodies_first:
            backend = owner.backend
            rows = await backend.read_rows(self._key, start, tail.bodies_first)
            older, sizes = _grouped(rows, start, tail.bodies_first, self._key, backend.label)
            texts = None
            if tail.texts is not None:
                texts = _texts(rows, start, tail.bodies_first, self._key, backend.label)
            tail.prepend_records(start, older, sizes, texts)
        return tail

    async def exchanges(self, start: int, stop: int) -> list[list[Record]]:
        """Private copies of the messages of exchanges ``start`` .. ``stop - 1``."""
        start, stop = max(start, 0), min(stop, self._count)
        tail = await self._held(start, stop)
        if tail is None:
            return []
        first = tail.bodies_first
        return [[thaw(m) for m in ex] for ex in tail.records[start - first : stop - first]]

    async def messages(self, start: int, stop: int) -> list[tuple[Message, ...]]:
        """The neutral messages of exchanges ``start`` .. ``stop - 1``: shared and
        read-only (see the module docstring); the list is the caller's."""
        start, stop = max(start, 0), min(stop, self._count)
        tail = await self._held(start, stop)
        if tail is None:
            return []
        return tail.neutral(start, stop)


# -- encoding writes ---------------------------------------------------------------------


def _brought(tail: _Tail | None, start: int, stop: int) -> Rows | None:
    """Content mode: the rows of exchanges ``start`` .. ``stop - 1`` as the claim that
    built ``tail`` brought them (None when it did not bring them all)."""
    if tail is None or tail.texts is None or tail.count != stop or tail.bodies_first > start:
        return None
    first = tail.bodies_first
    return [
        (exchange, len(body.encode("utf-8", "surrogatepass")), body)
        for exchange in range(start, stop)
        for body in tail.texts[exchange - first]
    ]


class _Drop(NamedTuple):
    """What a ``LogWrite.drop_last`` removes: the exchanges left, the bytes the
    dropped messages weigh, and the exchange and bytes of each, in stored order."""

    exchanges: int
    bytes: int
    rows: list[tuple[int, int]]


def _head_of(
    key: str, text: str, held: HeldHead | None, label: str
) -> tuple[Record, HeldHead | None, int]:
    """A touba record's stored head ``text``: the caller's copy of it, the head held
    for it (None when ``text`` is not the one held: stored since by someone else,
    parsed anew) and its UTF-8 length, as the store counts it."""
    if held is not None and not held.holds(text):
        held = None
    head = held.copy() if held else parse_head(text)
    if head is None:
        raise _damaged(key, "the stored record", label)
    return head, held, held.size if held is not None else len(text.encode())


def _held_drop(tail: _Tail, known: Reserved, count: int) -> _Drop | None:
    """Not in content mode: the drop of the newest ``count`` messages of a tail the
    version proves current, each weighed as touba stores it (its canonical JSON),
    which the backend's ``save_if`` checks against what it deletes (None: the tail
    does not hold them all)."""
    if tail.count != known.exchanges or count > known.messages:
        return None
    rows: list[tuple[int, int]] = []  # newest first
    exchange = tail.count - 1
    while len(rows) < count:
        if exchange < tail.bodies_first:
            return None
        records = tail.records[exchange - tail.bodies_first]
        if not records:
            return None
        for record in reversed(records):
            rows.append((exchange, len(canonical_json(record).encode("utf-8", "surrogatepass"))))
            if len(rows) == count:
                break
        exchange -= 1
    rows.reverse()
    first = rows[0][0]
    kept = len(tail.records[first - tail.bodies_first]) - sum(1 for e, _ in rows if e == first)
    return _Drop(first + 1 if kept else first, sum(size for _e, size in rows), rows)


def _drop_of(rows: Rows, count: int, start: int) -> _Drop:
    """The drop of the newest ``count`` of ``rows`` (those of exchanges ``start`` ..,
    in stored order; every stored exchange holds a message)."""
    kept = rows[: len(rows) - count]
    gone = [(exchange, size) for exchange, size, _body in rows[len(kept) :]]
    exchanges = kept[-1][0] + 1 if kept else start
    return _Drop(exchanges, sum(size for _exchange, size in gone), gone)


def _appended(
    reserved: Reserved,
    head_bytes: int,
    write: LogWrite,
    held: HeldHead | None,
    dropped: _Drop | None = None,
) -> tuple[Write, HeldHead]:
    """A log write: a new head and messages after the stored ones (checked first),
    and the new head held; ``head_bytes`` is the stored head's UTF-8 length,
    ``held`` the stored head when this store object holds it, ``dropped`` what
    ``Reservations._dropped`` found for ``write.drop_last``."""
    count = reserved.exchanges if reserved.split else 0
    stored = reserved.messages if reserved.split else 0
    dropped_bytes = drop = dropped_from = 0
    if dropped is not None:
        drop = write.drop_last
        count, dropped_bytes = dropped.exchanges, dropped.bytes
        dropped_from = dropped.rows[0][0]
        stored -= drop
    check_appends(count, write.append)
    head = encode_head(write.head, held)
    rows: list[tuple[int, int, int, str]] = []
    for index, body, size in appended_bodies(write):
        rows.append((stored + len(rows), index, size, body))
    namespace, identity = identity_columns(write.head)
    kept = reserved.bytes - head_bytes if reserved.head is not None else 0
    total = kept + head.size + sum(row[2] for row in rows) - dropped_bytes
    encoded = Write(
        head=head.text,
        split=True,
        namespace=namespace,
        identity=identity,
        exchanges=max([count, *(index + 1 for index, _ in write.append)]),
        messages=stored + len(rows),
        bytes=total,
        rows=rows,
        rewrite=False,
        is_new=reserved.head is None,
        growth=total - reserved.bytes,
        seen=reserved.version,
        dropped=drop,
        dropped_from=dropped_from,
        dropped_bytes=dropped_bytes,
    )
    return encoded, head


def _whole(record: Record, reserved: Reserved) -> Write:
    """A record returned to ``transact``, replacing whatever was stored."""
    encoded = encode_record(record)
    namespace, identity = identity_columns(record) if encoded.split else (None, None)
    rows: list[tuple[int, int, int, str]] = []
    for exchange, messages in enumerate(encoded.exchanges):
        rows.extend((len(rows), exchange, len(body.encode("utf-8")), body) for body in messages)
    return Write(
        head=encoded.head,
        split=encoded.split,
        namespace=namespace,
        identity=identity,
        exchanges=len(encoded.exchanges),
        messages=encoded.messages,
        bytes=encoded.bytes,
        rows=rows,
        rewrite=True,
        is_new=reserved.head is None,
        growth=encoded.bytes - reserved.bytes,
        seen=reserved.version,
    )
