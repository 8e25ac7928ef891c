"""The reservation protocol of the durable stores, written once over a backend's primitives.

:class:`Reservations` runs ``transact`` and ``transact_log`` for a durable
store (SQLite, PostgreSQL, Redis) over the primitives its backend supplies
(:class:`touba.history._backend.Backend`): reserve the key, show the
operation its conversation (:mod:`touba.history._snapshot`), then save if the
reservation still holds (:mod:`touba.history._write_plan` encodes the write),
or release it; on any failure release it, and when that release cannot be
written either, restate the store's error to say that ``recover`` is needed
(an error that is not the store's keeps its type and gets a note). A store
builds one ``Reservations(backend, worker_id)`` and its ``transact`` /
``transact_log`` check the key, then delegate. ``read``, ``delete``,
``recover``, ``list``, ``usage`` and ``purge_expired`` stay the store's own.
Between decisions the store object keeps each conversation's parsed tail
(:mod:`touba.history._tail_cache`).

**Read-ahead hints.** How far back the history layer reads, in exchanges
from the end: one hint for sizes, one for message bodies, each the most the
snapshots of this store object's last :data:`HINT_MEMORY` log transactions
were asked for (:class:`Recent`: one wide read widens the next ones for a
while, not for good), plus one (a conversation shorter than its window is
read from its start, one exchange further back each decision), at most
:data:`MAX_TAIL`. A reservation reads that much with the reserving call; an
older range, when asked, costs one call to ``Backend.read_sizes`` or
``Backend.read_rows`` (and joins the tail). A decision whose tail is cached
or read ahead costs two backend calls: ``reserve``, then ``save`` (or
``release``). In content mode (the backend cannot see edits behind its back)
every reservation brings the rows the bodies hint covers, so only reads that
reach the last exchange (the window) widen it: a look further back (a
summary's exchanges) costs a ``read_rows`` call and leaves the hint alone;
and the hints a reservation reads ahead by are those of its own kind of
operation (its code: a session's ``add_items`` reads the last exchange, its
``get_items`` the window), so a narrow claim carries few rows.

**Releases owed.** A reservation whose release could not be written (the
store failed, then failed the release too), or whose reserving call failed in
a way that may have left it written (a lost commit reply, a cancellation), is
remembered by this object: its key and token (:class:`Owed`). Its worker is
alive and knows that operation is over, so before its next reservation of that
key (``transact``, ``transact_log``, ``transact_log_optimistic``, and a
store's ``delete``, through :meth:`Reservations.settle`) it releases it first,
and its next operation on any other key releases the oldest ones owed too
(:meth:`Reservations.settle_owed`: a chat turn's conversation is never visited
again once its turn failed),
checked by token, as every release is: a reservation that ``recover`` freed,
or that another worker has taken since, is left alone, and nothing is ever
reused. While the store still fails, that release fails and the operation
raises the store's error, nothing reserved. Other workers find the key
``DecisionHistoryBusy`` until then; a worker that stops, or a store object
closed or forgetting more than :data:`MAX_OWED` keys, leaves it to
``recover`` as before.

**Without a reservation.** ``transact_log_optimistic`` runs an operation that
may run twice on the cached tail and saves its write in one ``save_if`` call,
or peeks a wide read in content mode; anything it cannot answer as the
reserved path would runs ``transact_log`` (see the method).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from touba.errors import (
    DecisionHistoryBusy,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
    ToubaError,
)
from touba.history._backend import Backend, Read, Reserved, Write, parse_object
from touba.history._common import Reservation, new_token
from touba.history._head import HeldHead
from touba.history._snapshot import Snapshot, Uncached, head_of, record_of, tail_of
from touba.history._sqlite import describe
from touba.history._store import LogOperation, Operation, StoreUsage
from touba.history._tail_cache import Tail, TailCache
from touba.history._write_plan import Drop, appended, optimistic_drop, read_drop, whole

__all__ = [
    "HINT_MEMORY",
    "MAX_OWED",
    "MAX_TAIL",
    "OPTIMISTIC_READ",
    "Owed",
    "Recent",
    "Reservations",
]

T = TypeVar("T")
logger = logging.getLogger("touba.history")

MAX_TAIL: Final = 1024  # most exchanges read ahead with a reservation
HINT_MEMORY: Final = 16  # transactions a read-ahead hint remembers (see Recent)
KINDS: Final = 64  # kinds of operation whose read-ahead a store object keeps (content mode)
# Content mode: most exchanges of messages an optimistic write has compared in the
# store (an operation whose kind reads more takes the reserved path).
OPTIMISTIC_READ: Final = 8
# read_log: peeks of one read, each as wide as the last one asked (the last: all of it).
_PEEKS: Final = 4
_ALL: Final = 2**30
_NO_USAGE: Final = StoreUsage(0, 0, 0, 0)  # unused: an optimistic write is never new
MAX_OWED: Final = 4096  # keys whose release a store object still owes (see Owed)
SETTLE_OTHERS: Final = 8  # other keys owed released before an operation (see settle_owed)


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
        """Remember ``value`` as the newest; ``most`` is then the most of those kept."""
        self._values.append(value)
        self.most = value if value >= self.most else max(self._values)


class Owed:
    """The reservations this store object took and could not release (the module
    docstring's "Releases owed"): key -> tokens, oldest key first, at most
    :data:`MAX_OWED` keys (the oldest is forgotten, with a warning: ``recover``
    then frees it)."""

    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: OrderedDict[str, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._tokens

    def add(self, key: str, token: str) -> None:
        """Remember that ``token`` may still hold ``key``."""
        self._tokens.setdefault(key, set()).add(token)
        self._tokens.move_to_end(key)
        while len(self._tokens) > MAX_OWED:
            forgotten, _ = self._tokens.popitem(last=False)
            logger.warning(
                "forgot the reservation of %s this worker could not release (over %d owed); "
                "it stays busy until store.recover(key, worker_stopped=True)",
                forgotten,
                MAX_OWED,
            )

    def keys(self) -> tuple[str, ...]:
        """The keys owed, oldest first."""
        return tuple(self._tokens)

    def of(self, key: str) -> tuple[str, ...]:
        """The tokens owed for ``key`` (none: an empty tuple)."""
        return tuple(self._tokens.get(key, ()))

    def paid(self, key: str, token: str) -> None:
        """``token``'s release of ``key`` was written (or it held nothing)."""
        tokens = self._tokens.get(key)
        if tokens is not None:
            tokens.discard(token)
            if not tokens:
                del self._tokens[key]


def _may_hold(error: BaseException) -> bool:
    """Whether a reserving call that raised ``error`` may have left its reservation
    written: anything but a refusal (a store failure, a cancellation, a bug)."""
    return not isinstance(error, ToubaError) or isinstance(error, DecisionHistoryStoreUnavailable)


def _kind(operation: object) -> object:
    """What makes operations of one kind (the same code, a closure's included)."""
    return getattr(operation, "__code__", None)


# -- the protocol ------------------------------------------------------------------------


class Reservations:
    """``transact`` and ``transact_log`` over one backend, with its tail cache."""

    def __init__(self, backend: Backend, worker_id: str, cache: TailCache | None = None) -> None:
        self.backend = backend
        self.worker_id = worker_id
        self.cache = cache if cache is not None else TailCache()
        # Content mode (see _tail_cache): the backend cannot see edits made behind it.
        self.content = not getattr(backend, "sees_edits", True)
        # How many trailing exchanges the history layer read lately (the read-ahead hints).
        self._sizes = Recent()
        self._bodies = Recent()
        # Content mode: what each kind of operation (its code) read lately, so that
        # a claim carries the rows that operation reads, not the widest one's.
        self._kinds: OrderedDict[object, tuple[Recent, Recent]] = OrderedDict()
        # Reservations of this object whose release it still owes (see Owed).
        self.owed = Owed()

    @property
    def sizes_hint(self) -> int:
        """Trailing exchanges whose sizes a reservation reads ahead."""
        return self._sizes.most

    @property
    def bodies_hint(self) -> int:
        """Trailing exchanges whose messages a reservation reads ahead."""
        return self._bodies.most

    def _settle(self, snapshot: Snapshot | None, operation: object) -> None:
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

    async def settle(self, key: str) -> None:
        """Release what this object still owes for ``key`` (see :class:`Owed`), each
        release checked by its token, so that a reservation recovered or taken by
        another worker since is left as it is. Raises the store's error, and owes
        it still, when a release cannot be written (the store still fails)."""
        for token in self.owed.of(key):
            await self.backend.release(key, token)
            self.owed.paid(key, token)
            logger.info("released the reservation of %s that a failed operation left", key)

    async def settle_owed(self, key: str) -> None:
        """:meth:`settle` ``key``, then up to :data:`SETTLE_OTHERS` other keys owed,
        oldest first: a conversation this worker never touches again (each chat turn is
        an invocation of its own, so a turn a store failure cut leaves a key no later
        turn visits) is released by the worker's next operation on any key, not left
        to ``recover``. A release that still fails raises the store's error before
        this operation reserves anything (the store is failing: the operation would
        too), so the operation's deadline is not spent twice."""
        if key in self.owed:
            await self.settle(key)
        for other in self.owed.keys()[:SETTLE_OTHERS]:
            await self.settle(other)

    async def _reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """``backend.reserve`` after :meth:`settle_owed`; a reserving call that fails in
        a way that may have left the reservation written (see :func:`_may_hold`) is
        owed, so the next access releases it if the backend could not."""
        if self.owed:
            await self.settle_owed(key)
        try:
            return await self.backend.reserve(key, reservation, read)
        except BaseException as e:
            if _may_hold(e):
                self.owed.add(key, reservation.token)
            raise

    async def transact(self, key: str, operation: Operation[T]) -> T:
        """Reserve ``key``, give ``operation`` a private copy of its whole record,
        save what it returns (``None`` deletes). Raises what the backend and
        ``operation`` raise; the key is released after any failure."""
        reservation = Reservation.new(self.worker_id)
        token = reservation.token
        self.cache.drop(key)
        reserved = await self._reserve(key, reservation, Read(whole=True))
        written = None
        try:
            loaded = record_of(self.backend.label, key, reserved)
            record, result = await operation(loaded)
            if record is None:
                if reserved.head is None:
                    await self.backend.release(key, token)
                else:
                    await self.backend.delete(key, token)
            else:
                written = whole(record, reserved)
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
        reserved = await self._reserve(key, reservation, read)
        head_bytes = 0  # what the store counts for the stored head (the save needs it too)
        try:
            snapshot = None
            if reserved.head is not None:
                label = self.backend.label
                if reserved.split:
                    tail = await tail_of(self.backend, self.content, key, reserved, read, tail)
                    head, held_head, head_bytes = head_of(key, reserved.head, held_head, label)
                else:
                    tail = held_head = None
                    head = parse_object(reserved.head, key, "the stored record", label)
                    head_bytes = len(reserved.head.encode())
                snapshot = Snapshot(self.backend, self.content, key, head, head_bytes, tail)
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
                dropped = await read_drop(
                    self.backend, self.content, key, reserved, write.drop_last, tail
                )
                encoded, held_head = appended(reserved, head_bytes, write, held_head, dropped)
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
        if self.owed:  # our own reservations may still hold keys: release them first
            await self.settle_owed(key)
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
        snapshot = Snapshot(
            self.backend,
            self.content,
            key,
            held_head.copy(),
            held_head.size,
            tail,
            cached_only=True,
        )
        try:
            write, result = await operation(snapshot, None)
        except Exception:  # judged on a state that may be stale: the reserved path decides
            write = None
        finally:
            self._settle(snapshot, operation)
        sizes_from, bodies_from = snapshot.read_from
        seen = tail.seen(sizes_from, bodies_from, messages) if self.content else None
        known = Reserved(held_head.text, True, tail.count, messages, size, tail.version, _NO_USAGE)
        dropped = (
            None
            if write is None
            else optimistic_drop(self.backend, self.content, known, write, tail, seen)
        )
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
            encoded, held_head = appended(known, held_head.size, write, held_head, dropped)
            saved = await save_if(key, tail.version, known.head, token, encoded, seen)
        except BaseException:
            self.cache.drop(key)
            raise
        if not saved:  # changed, held or full: the reserved path reads what changed
            self.cache.put(key, tail)  # (by version, or as a parse cache in content mode)
            return await self.transact_log(key, operation)
        self._keep(key, tail, token, encoded, held_head, dropped)
        return result

    async def read_log(self, key: str, operation: LogOperation[T]) -> T:
        """``transact_log`` for an operation that only reads (a session's
        ``get_items``): it never reserves, so a worker that dies inside it leaves
        nothing to recover.

        The backend's ``peek`` reads what a reservation would, without one, in one
        atomic round trip that renews the expiry (reading is activity), honouring
        the cached tail's version (then no row is sent); the operation runs on that
        state. When it asks for more than was read, the peek is made again, wider:
        each peek is one consistent state, never a torn one, whatever writers do in
        between. ``DecisionHistoryBusy`` while the key is held, as the reserved path.
        Without ``peek`` (a custom backend, Redis's cluster of old), or for what
        only a reservation reads (a record that is not a split log, or an operation
        that writes after all), it is ``transact_log_optimistic``.
        """
        peek = getattr(self.backend, "peek", None)
        if peek is None:
            return await self.transact_log_optimistic(key, operation)
        held = self.cache.take(key)
        sizes, bodies = self._read_ahead(operation)
        for attempt in range(_PEEKS):
            if attempt == _PEEKS - 1:  # (an operation that keeps asking further: all of it)
                sizes = bodies = _ALL
            cached = held is not None and not self.content and held.covers(sizes, bodies)
            read = Read(
                cached=held.version if cached and held else None, sizes=sizes, bodies=bodies
            )
            try:
                reserved: Reserved | None = await peek(key, read)
            except BaseException:
                self.cache.drop(key)
                raise
            if reserved is None:
                break
            if reserved.head is None:  # nothing stored: the operation sees no record
                write, result = await operation(None, reserved.usage)
                if write is not None:
                    break
                return result
            tail = await tail_of(  # (content mode: the held tail is a parse cache)
                self.backend,
                self.content,
                key,
                reserved,
                read,
                held if cached or self.content else None,
            )
            held_head = None if held is None else held.head
            head, held_head, head_bytes = head_of(key, reserved.head, held_head, self.backend.label)
            snapshot = Snapshot(
                self.backend,
                self.content,
                key,
                head,
                head_bytes,
                tail,
                cached_only=True,
                older=False,
            )
            try:
                write, result = await operation(snapshot, reserved.usage)
            except Uncached:
                write = None
                snapshot.uncached = True
            finally:
                self._settle(snapshot, operation)
            if snapshot.uncached:  # asked for more: peek again, as wide as it asked
                asked_sizes, asked_bodies = snapshot.asked
                sizes, bodies = max(sizes, asked_sizes), max(bodies, asked_bodies)
                held = tail
                continue
            renewed = None
            if write is not None and not write.drop_last:
                encoded, renewed = appended(reserved, head_bytes, write, held_head)
                if not encoded.renews(reserved.head):
                    renewed = None
            if write is not None and renewed is None:
                held = tail
                break  # it writes: the reserved path makes that write
            totals = (reserved.messages, reserved.bytes)
            self._keep(key, tail, "", None, renewed or held_head, None, totals)
            return result
        if held is not None:
            self.cache.put(key, held)
        return await self.transact_log(key, operation)

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
        tail = await tail_of(self.backend, self.content, key, reserved, read, held)
        held_head = None if held is None else held.head
        head, held_head, head_bytes = head_of(key, reserved.head, held_head, self.backend.label)
        snapshot = Snapshot(
            self.backend, self.content, key, head, head_bytes, tail, cached_only=True, older=False
        )
        try:
            write, result = await operation(snapshot, reserved.usage)
            renewed = None
            if write is not None and not snapshot.uncached and not write.drop_last:
                encoded, renewed = appended(reserved, head_bytes, write, held_head)
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

    def _keep(
        self,
        key: str,
        tail: Tail | None,
        token: str,
        saved: Write | None,
        head: HeldHead | None = None,
        dropped: Drop | None = None,
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
                tail = Tail.written(token, saved, sizes, bodies, texts=self.content)
            elif saved is not None:
                tail = tail or Tail.empty(token, texts=self.content)
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
        except BaseException as e:
            self.owed.add(key, token)  # released at this object's next access of key
            if not isinstance(e, Exception):
                raise
            cause = e.__cause__ or e
            logger.warning(
                "could not release the reservation of %s (%s); this worker releases it "
                "at its next access of the key, else store.recover(key, worker_stopped=True)",
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
        f"({describe(error)}): this store object releases it before its next operation on "
        "that key (retry it once the store works again); until then other workers find it "
        "DecisionHistoryBusy, and if this worker stops first, run "
        f"store.recover(key, worker_stopped=True) (or `touba history recover {key}`) once the "
        "store works again."
    )
