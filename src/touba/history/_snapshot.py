"""What an operation is shown while it holds a key: a snapshot of its conversation.

``transact`` shows its operation the whole record (:func:`record_of`), read
with the reservation. ``transact_log`` shows a :class:`Snapshot`: the head
(its top-level dict private, its nested values read-only: see
:mod:`touba.history._head`) and the tail, either the one the store object
holds at the stored version or the one the reservation brought
(:func:`tail_of`); a range older than the tail costs one ``read_sizes`` or
``read_rows`` call and joins the tail. The tail holds the head its save
wrote, so the next reservation parses the stored head only when its text is
not that one (:func:`head_of`). A snapshot also serves ``messages(start,
stop)`` (the shared neutral messages, which the history engine uses instead
of parsing), ``head_bytes`` (the stored head's length, as the store counts
it) and ``well_formed`` (the exchanges the window check passed, see
:mod:`touba.history._integrity`), and it notes how far back it was read
(``asked``, ``read_from``), from which the protocol sets its read-ahead hints.

An unreserved snapshot (``cached_only``: an optimistic write or a peeked
read) serves only what the tail holds: a read beyond it raises
:class:`Uncached` and marks the snapshot, and the reserved path runs instead.
In content mode it may also serve the tail's unchecked older part, which the
optimistic write then compares in the store, text by text, before it writes.
"""

from __future__ import annotations

from touba.history._backend import Backend, Read, Reserved, Rows, Sizes, damaged, parse_object
from touba.history._frozen import thaw
from touba.history._head import HeldHead, parse_head
from touba.history._model import Message
from touba.history._record import join_record
from touba.history._store import Record
from touba.history._tail_cache import Older, Tail, grouped, grouped_texts
from touba.history._window import ExchangeSize

__all__ = ["Snapshot", "Uncached", "dense", "head_of", "record_of", "tail_of"]


class Uncached(Exception):
    """An unreserved snapshot was asked for more than the cached tail holds."""


class Snapshot:
    """A reserved conversation as ``transact_log`` shows it: the head (its top-level
    dict private, its nested values read-only: see :mod:`touba.history._head`),
    and the tail from the cache or the reservation; older ranges cost a backend
    call each (and join the tail)."""

    def __init__(
        self,
        backend: Backend,
        content: bool,
        key: str,
        head: Record,
        head_bytes: int,
        tail: Tail | None,
        *,
        cached_only: bool = False,
        older: bool = True,
    ) -> None:
        self._backend = backend
        self._content = content  # content mode (see _tail_cache)
        self._key = key
        self._head = head
        self.head_bytes = head_bytes  # what the store measures the stored head as
        self._tail = tail
        self._count = 0 if tail is None else tail.count
        self.asked = (0, 0)  # the most exchanges from the end read: (sizes, bodies)
        # Unreserved (transact_log_optimistic): the tail only. A read beyond it is
        # refused (Uncached) and noted, so that the reserved path runs instead.
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
            raise Uncached

    def _older_held(self, tail: Tail, start: int) -> Older:
        """Unreserved, content mode: the exchanges the tail keeps unchecked before
        its checked part (``Tail.older``), when they reach back to ``start``: the
        optimistic write compares every text and entry read from them with the
        stored ones before it writes anything. Else the read is refused."""
        older = tail.older
        if (
            not self._content
            or not self._older_ok
            or older is None
            or not older.first <= start
            or older.first + len(older.records) != tail.bodies_first
        ):
            self._beyond()
        assert older is not None  # _beyond raised otherwise
        return older

    def _older(self, tail: Tail, start: int) -> None:
        """Serve the messages of exchanges ``start`` .. from ``_older_held``."""
        older = self._older_held(tail, start)
        cut = start - older.first
        tail.prepend_records(start, older.records[cut:], older.body_bytes[cut:], older.texts[cut:])
        tail.older = older.before(start)

    @property
    def head(self) -> Record:
        """See :class:`touba.history._store.LogSnapshot`."""
        return self._head

    @property
    def exchange_count(self) -> int:
        """See :class:`touba.history._store.LogSnapshot`."""
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
            older = await self._backend.read_sizes(self._key, start, tail.sizes_first)
            tail.prepend_sizes(start, dense(older, start, tail.sizes_first))
        return tail.sizes[start - tail.sizes_first :]

    async def _held(self, start: int, stop: int) -> Tail | None:
        """The tail, holding the bodies of ``start`` .. ``stop - 1`` (None: nothing to read)."""
        tail = self._tail
        if tail is None or start >= stop:
            return None
        if not self._content or stop >= self._count:  # content mode: only the window's reads
            self._ask(bodies=self._count - start + 1)
        self.read_from[1] = min(self.read_from[1], start)
        if start < tail.bodies_first and self._cached_only:
            self._older(tail, start)
        if start < tail.bodies_first:
            backend = self._backend
            rows = await backend.read_rows(self._key, start, tail.bodies_first)
            older, sizes = grouped(rows, start, tail.bodies_first, self._key, backend.label)
            texts = None
            if tail.texts is not None:
                texts = grouped_texts(rows, start, tail.bodies_first, self._key, backend.label)
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
        read-only (see :mod:`touba.history._tail_cache`); the list is the caller's."""
        start, stop = max(start, 0), min(stop, self._count)
        tail = await self._held(start, stop)
        if tail is None:
            return []
        return tail.neutral(start, stop)


def head_of(
    key: str, text: str, held: HeldHead | None, label: str
) -> tuple[Record, HeldHead | None, int]:
    """A touba record's stored head ``text``: the caller's copy of it, the head held
    for it (None when ``text`` is not the one held: stored since by someone else,
    parsed anew) and its UTF-8 length, as the store counts it."""
    if held is not None and not held.holds(text):
        held = None
    head = held.copy() if held else parse_head(text)
    if head is None:
        raise damaged(key, "the stored record", label)
    return head, held, held.size if held is not None else len(text.encode())


async def tail_of(
    backend: Backend, content: bool, key: str, reserved: Reserved, read: Read, held: Tail | None
) -> Tail:
    """The tail of the reserved state: ``held`` when the backend said it matches,
    else the one read with the reservation."""
    count = reserved.exchanges
    label = backend.label
    sizes_first = max(0, count - read.sizes)
    bodies_first = max(0, count - read.bodies)
    if reserved.sizes is None or reserved.rows is None:
        if (
            not content
            and held is not None
            and held.version == reserved.version
            and held.count == count
        ):
            return held
        # Not what was asked (a backend must send rows on a mismatch): read them.
        sizes: Sizes = await backend.read_sizes(key, sizes_first, bodies_first)
        rows: Rows = await backend.read_rows(key, bodies_first, count)
    else:
        sizes, rows = reserved.sizes, reserved.rows
    weights = dense(sizes, sizes_first, bodies_first)
    if content:
        version = reserved.version or ""
        return Tail.checked(
            version, count, sizes_first, weights, bodies_first, rows, held, key, label
        )
    records, body_bytes = grouped(rows, bodies_first, count, key, label)
    weights += [ExchangeSize(len(ex), b) for ex, b in zip(records, body_bytes, strict=True)]
    return Tail(
        reserved.version or "",  # "" never equals a token: never matched again
        count,
        sizes_first,
        weights,
        bodies_first,
        records,
        body_bytes,
    )


def record_of(label: str, key: str, reserved: Reserved) -> Record | None:
    """The whole record of a reservation made with ``Read(whole=True)``."""
    if reserved.head is None:
        return None
    head = parse_object(reserved.head, key, "the stored record", label)
    if not reserved.split:
        return head
    count = max([reserved.exchanges, *(e + 1 for e, _s, _b in reserved.rows or ())])
    exchanges: list[list[Record]] = [[] for _ in range(count)]
    for exchange, _size, body in reserved.rows or ():
        exchanges[exchange].append(parse_object(body, key, "a message", label))
    return join_record(head, exchanges)


def dense(sizes: Sizes, start: int, stop: int) -> list[ExchangeSize]:
    """One size per exchange ``start`` .. ``stop - 1`` (0 for one without messages)."""
    out = [ExchangeSize(0, 0)] * (stop - start)
    for exchange, messages, size in sizes:
        if start <= exchange < stop:
            out[exchange - start] = ExchangeSize(messages, size)
    return out
