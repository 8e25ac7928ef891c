"""The tail cache: each store object keeps the parsed tail of the conversations it served.

A decision reads the tail of its conversation: the sizes of the exchanges the
window may hold, the messages of those it sends. Each store object keeps that
tail between decisions, parsed and frozen (:mod:`touba.history._frozen`: its
dicts and lists refuse changes, and the neutral messages built from them are
shared by every reader), tagged with the conversation's *version*: the token
of the reservation whose save wrote the stored state. Every save, by any
process, stores a new version, so a reservation that sends the version it
holds gets no rows back when nothing changed, and the tail when anything did
(another process saved, the key was deleted and created again: a token is
never reused, so a stale tail never matches). After a successful save the
tail holds what it held plus the messages appended (after ``transact``, the
last exchanges of the record it saved), parsed from the very text that was
stored, so it equals a fresh read; a failure of any kind (a refused or failed
save, an operation that raised) drops the conversation from the cache. A
tail is taken out of the cache for the length of a reservation and put back
when it ends, so no two reservations share one. It also holds the head its
save wrote (:mod:`touba.history._head`), the exchanges that passed the window
check (``well_formed``, see :mod:`touba.history._integrity`) and the
conversation's totals.

**Content mode.** When the backend cannot see edits made behind its back
(``sees_edits = False``, see :mod:`touba.history._backend`), a version proves
nothing, so its reservations never send one: each brings the rows of the
window, and the tail is rebuilt from them (:meth:`Tail.checked`). The cache
keeps, beside each parsed message, the stored text it was parsed from; an
exchange whose texts are byte-identical to the held ones keeps its parsed
messages, its neutral messages and its window verdict, and any other exchange
is parsed and checked again. A hit saves JSON parsing, building the messages
and the window check; the transfer and the driver's decoding stay. The
exchanges a narrow claim did not bring stay in the tail, parsed with their
texts (:class:`Older`), for a later claim that brings the very same texts to
reuse; nothing is served from them unchecked.

**Bound.** The cache holds at most :data:`CACHE_CONVERSATIONS` conversations
(least recently used first out) and at most :data:`CACHE_BYTES` bytes of
message JSON over all of them (parsed, a message takes about twice its JSON
in memory); each conversation holds only the tail the history layer read
lately (the read-ahead hints of :mod:`touba.history._reservations`). A tail
larger than :data:`CACHE_BYTES` is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from touba.errors import DecisionHistoryRecordInvalid
from touba.history._backend import Rows, Seen, Write, damaged
from touba.history._frozen import parse_frozen
from touba.history._head import HeldHead
from touba.history._model import Message, message_from_dict
from touba.history._store import Record
from touba.history._window import ExchangeSize

__all__ = [
    "CACHE_BYTES",
    "CACHE_CONVERSATIONS",
    "Older",
    "Tail",
    "TailCache",
    "grouped",
    "grouped_texts",
]

CACHE_CONVERSATIONS: Final = 256  # conversations whose tail a store object keeps
CACHE_BYTES: Final = 32 * 1024 * 1024  # message JSON bytes kept over all of them


# -- parsing stored rows -------------------------------------------------------------------


def _frozen_object_of(body: str, key: str, label: str) -> Record:
    """A stored message, parsed frozen; DecisionHistoryRecordInvalid unless an object."""
    try:
        value = parse_frozen(body)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise damaged(key, "a message", label)
    return value


def grouped(
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


def grouped_texts(rows: Rows, start: int, stop: int, key: str, label: str) -> list[list[str]]:
    """The stored texts of the messages of exchanges ``start`` .. ``stop - 1``."""
    out: list[list[str]] = [[] for _ in range(stop - start)]
    for exchange, _size, body in rows:
        if not start <= exchange < stop:
            raise _outside(key, label, exchange, start, stop)
        out[exchange - start].append(body)
    return out


# -- the tail of one conversation, and the cache of them ----------------------------------


class Tail:
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
        self.older: Older | None = None
        # The conversation's (messages, bytes) at this version, as the store counts
        # them: what a save without a reservation needs (see transact_log_optimistic).
        self.totals: tuple[int, int] | None = None

    @classmethod
    def empty(cls, version: str, *, texts: bool = False) -> Tail:
        """A tail of no exchanges at ``version`` (with texts, in content mode)."""
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
        costs one backend call, see :class:`touba.history._snapshot.Snapshot`)."""
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
        """Hold the sizes ``older`` of exchanges ``start`` .. ``sizes_first - 1`` too."""
        self.sizes[:0] = older
        self.sizes_first = start

    def prepend_records(
        self,
        start: int,
        older: list[list[Record]],
        sizes: list[int],
        texts: list[list[str]] | None = None,
    ) -> None:
        """Hold the messages ``older`` (their bytes ``sizes``, their stored ``texts`` in
        content mode) of exchanges ``start`` .. ``bodies_first - 1`` too."""
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
    ) -> Tail:
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
        held: Tail | None,
        key: str,
        label: str,
    ) -> Tail:
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
        parsed = None if held is None else Older.of(held)
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
        of each, in stored order, as :func:`touba.history._write_plan.read_drop` read them), and the
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
class Older:
    """Content mode: parsed exchanges ``first`` .. with the stored texts each was
    parsed from, their neutral messages, JSON bytes and window verdicts; a parse
    cache by exchange and text, trusted for nothing until a claim brings the
    same texts (see :meth:`Tail.checked`)."""

    first: int
    records: list[list[Record]]
    texts: list[list[str]]
    messages: list[tuple[Message, ...] | None]
    body_bytes: list[int]
    well_formed: set[int]

    @classmethod
    def of(cls, tail: Tail) -> Older | None:
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

    def before(self, first: int) -> Older | None:
        """The exchanges before ``first`` (None: none)."""
        cut = first - self.first
        if cut <= 0:
            return None
        return Older(
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
        self._tails: OrderedDict[str, Tail] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        """The conversations held."""
        return len(self._tails)

    @property
    def bytes(self) -> int:
        """Message JSON bytes held now."""
        return self._bytes

    def take(self, key: str) -> Tail | None:
        """Remove and return the tail of ``key``, if held."""
        with self._lock:
            tail = self._tails.pop(key, None)
            if tail is not None:
                self._bytes -= tail.bytes
            return tail

    def put(self, key: str, tail: Tail) -> None:
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
        """Forget the tail of ``key``, if held."""
        self.take(key)

    def peek(self, key: str) -> Tail | None:
        """The tail of ``key`` without taking it (for tests and inspection)."""
        with self._lock:
            return self._tails.get(key)
