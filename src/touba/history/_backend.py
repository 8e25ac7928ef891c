"""The primitives a durable store supplies to the reservation protocol, and what they exchange.

:class:`touba.history._reservations.Reservations` runs the protocol; a backend
(SQLite, PostgreSQL, Redis) supplies only the calls below. Each is one round
trip to the store (one transaction, one script) and atomic. Every method may
raise the store's typed errors (its driver's exceptions translated in one
place, chained with ``raise ... from``, so that ``error.__cause__`` is an
instance of ``driver_errors``); ``label`` names the store in messages.

The stored state of a key: a *head* (JSON text), ``split`` (True: a touba
record whose messages are rows; False: any other JSON object, kept whole in
``head``, no rows, ``exchanges == 0``), its *rows* (one per message: ``seq``
0.. in order within the conversation, ``exchange``, ``bytes`` = UTF-8 length
of ``body``, ``body`` = the message's compact JSON), the totals
(``exchanges``, ``messages``, ``bytes`` = head bytes + message bytes), an
expiry, a *version* (text or NULL) and the reservation (``token``,
``worker_id``, ``pid``, ``host``, ``since``; a reservation of a key without
a record is a *bare* one: it holds a place among ``max_sessions``). The
version must change with every change of the key's rows (the head is read
at every reservation), by a touba save (which stores its token) or by
anyone else where the backend can see it (SQLite and PostgreSQL: a trigger
on the messages table sets it to NULL). A backend that cannot see edits
made behind its back (Redis: another client's LSET or LREM of a row leaves
the version as it was) says so with ``sees_edits = False`` (absent: True),
and the protocol then runs in *content mode* (see
:mod:`touba.history._tail_cache`). Usage (places held, records plus bare
reservations; bytes retained) must be readable in O(1)::

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
        Sizes are the plaintext's: with encryption at rest (touba.history._sealed)
        write.head and the rows' bodies are sealed, write.head_bytes is the UTF-8
        length of the plaintext head, and a backend that derives a record's bytes
        itself counts that, not the stored text's length.
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
``sees_edits`` (optional, see above). :func:`parse_object` and
:func:`identity_columns` are the stores' shared helpers for heads and the
identity columns.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from touba._encryption import Encryption
from touba.errors import DecisionHistoryRecordInvalid
from touba.history._common import Reservation, encode_json
from touba.history._model import parse_json
from touba.history._store import Record, StoreUsage

__all__ = [
    "Backend",
    "Read",
    "Reserved",
    "Rows",
    "Seen",
    "Sizes",
    "Write",
    "damaged",
    "dropped_elsewhere",
    "identity_columns",
    "parse_object",
]

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
    head_bytes: int | None = None  # the plaintext head's bytes when ``head`` is sealed

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

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """Reserve ``key`` and read its state with it (see ``reserve`` above)."""

    async def save(self, key: str, token: str, write: Write) -> None:
        """Save ``write`` if ``token`` holds ``key``, and free it (see ``save`` above)."""

    async def delete(self, key: str, token: str) -> None:
        """Delete the record if ``token`` holds ``key`` (see ``delete`` above)."""

    async def release(self, key: str, token: str) -> None:
        """Free ``key`` if ``token`` holds it; never raises for another holder."""

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        """The sizes of the reserved key's exchanges ``start`` .. ``stop - 1``."""

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        """The rows of the reserved key's exchanges ``start`` .. ``stop - 1``."""


# -- helpers the backends share ----------------------------------------------------------


def parse_object(text: str, key: str, what: str, label: str) -> Record:
    """Stored JSON text that must be an object, or DecisionHistoryRecordInvalid."""
    try:
        value = parse_json(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        if Encryption.is_sealed(text):  # a sealed store opened without its encryption
            raise DecisionHistoryRecordInvalid(
                f"{what} of conversation {key} in the {label} store is sealed (encrypted at "
                "rest) but the store was opened without encryption=; open it with its "
                "touba.Encryption. Nothing was read"
            )
        raise damaged(key, what, label)
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


def damaged(key: str, what: str, label: str) -> DecisionHistoryRecordInvalid:
    """Stored data that is not a JSON object: nothing was modified."""
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
