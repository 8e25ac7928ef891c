"""Encryption at rest for the durable history stores: the backend primitives, sealed.

A store given ``encryption=`` (:class:`touba.Encryption`) wraps its backend in
:class:`SealedBackend`: every head and every message body is sealed
(AES-GCM, :mod:`touba._encryption`) on its way into ``save``/``save_if`` and
opened on its way out of ``reserve``/``read_rows``, so the reservation protocol,
the window, the tail cache and the bounds see plaintext only, and the store sees
sealed text only. Decisions:

- **What is sealed.** A head (the whole record for a record that is not touba's
  shape, else the record without its messages: summary, pending calls, stats,
  identity, plot) and each message body, each as one token. What stays plaintext:
  the session key, the identity and namespace columns (``list`` reads them), the
  sizes (``bytes``: UTF-8 bytes of the *plaintext*, so bounds and usage count what
  the operation wrote, whatever sealing adds), counts, times, versions and the
  reservation's holder.
- **Associated data.** Each token is bound to ``("touba.history", place, key,
  field, seq)``: ``place`` names the store (SQLite's table, PostgreSQL's table,
  Redis's key prefix), ``key`` the conversation, ``field`` ``"head"`` or
  ``"message"`` and ``seq`` a message's position in its conversation (0 for a
  head). A row copied to another conversation, position, field or store does not
  open. Rows are read in (exchange, seq) order and always end at a known point,
  so the position of each read row is known without storing it twice: a
  reservation's rows end at the conversation's last message; an older range is
  placed by the sizes of the exchanges after it.
- **Fails closed.** A value that does not open (plaintext, another key's, altered,
  truncated, moved) raises ``DecisionHistoryRecordInvalid`` naming the conversation
  and at most the key id; a reservation that read it is released first.
- **Raw reads.** ``read_raw`` (what ``touba history check`` and ``repair`` read)
  opens each value in its place too (:meth:`Sealer.open_raw`): a check sees the
  plaintext, so a healthy sealed conversation reports nothing. A value that does
  not open is never read as plaintext: it is handed on as text that is not JSON
  (the token itself, or the stored text behind a ``"not sealed: "`` mark), so the
  check names it ``unreadable_row`` (a head: unrepairable) and a repair drops it;
  the repair's save is sealed like any other. A value sealed with a key the store
  was not given is named in ``missing_keys``: not damage, so nothing is repaired.
- **Optimistic saves.** ``save_if`` compares the stored head text: the backend is
  given the sealed text last read or written for that head (a small bounded map),
  and a head it does not know falls back to the reserved path. In content mode
  (Redis compares rows as stored text) the optimistic paths (``save_if``,
  ``peek``) are not offered: every operation reserves. Elsewhere a read peeks
  (``peek``, opened as a reservation's read is).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from touba._encryption import Encryption
from touba.errors import ConfigurationError, DecisionHistoryBusy, DecisionHistoryRecordInvalid
from touba.history._backend import Backend, Read, Reserved, Rows, Seen, Sizes, Write
from touba.history._common import Reservation
from touba.history._repair import RawConversation

if TYPE_CHECKING:
    from touba.history._repair import RawConversation

__all__ = [
    "Rekeying",
    "SealedBackend",
    "Sealer",
    "check_encryption",
    "rekey_keys",
    "require_sealer",
    "sealed_backend",
]

logger = logging.getLogger("touba.history")
_HEADS: Final = 4096  # heads whose sealed text a store object remembers (for save_if)
_DOMAIN: Final = "touba.history"


def check_encryption(encryption: object) -> Encryption | None:
    """``encryption`` as a store takes it, or ConfigurationError."""
    if encryption is not None and not isinstance(encryption, Encryption):
        raise ConfigurationError(
            "encryption= must be a touba.Encryption(keys=..., current=...) or None, got "
            f"{type(encryption).__name__}"
        )
    return encryption


def require_sealer(sealer: Sealer | None, batch: int) -> Sealer:
    """The store's sealer for ``rekey``, or ConfigurationError."""
    if sealer is None:
        raise ConfigurationError(
            "rekey() needs a store opened with encryption=touba.Encryption(...)"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"batch must be a positive int, got {batch!r}")
    return sealer


class Sealer:
    """Seals and opens one store's heads and message bodies (see the module docstring)."""

    def __init__(self, encryption: Encryption, place: str, label: str) -> None:
        self.encryption = encryption
        self.place = place
        self.label = label
        self.prefix = f"tbe1.{encryption.current}."  # a current token starts so
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def _context(self, key: str, field: str, seq: int) -> bytes:
        """``Encryption.context(domain, place, key, field, seq)``, its text before
        ``seq`` kept per conversation (a decision seals several values of one)."""
        held = self._prefixes.get((key, field))
        if held is None:
            held = Encryption.context(_DOMAIN, self.place, key, field)[:-1] + b","
            if len(self._prefixes) >= _HEADS:
                self._prefixes.clear()
            self._prefixes[key, field] = held
        return held + b"%d]" % seq

    def seal_head(self, key: str, text: str) -> str:
        """The head ``text`` of ``key``, sealed."""
        return self.encryption.seal(text.encode("utf-8"), context=self._context(key, "head", 0))

    def seal_body(self, key: str, seq: int, text: str) -> str:
        """Message ``seq`` of ``key``, sealed."""
        context = self._context(key, "message", seq)
        return self.encryption.seal(text.encode("utf-8"), context=context)

    def open_head(self, key: str, token: object) -> str:
        """The head of ``key`` stored as ``token``, or DecisionHistoryRecordInvalid."""
        return self._open(key, token, "head", 0, "the head")

    def open_body(self, key: str, seq: int, token: object) -> str:
        """Message ``seq`` of ``key`` stored as ``token``, or DecisionHistoryRecordInvalid."""
        return self._open(key, token, "message", seq, f"message {seq}")

    def _open(self, key: str, token: object, field: str, seq: int, what: str) -> str:
        try:
            return self.encryption.open(token, context=self._context(key, field, seq)).decode(
                "utf-8"
            )
        except DecisionHistoryRecordInvalid as e:
            raise DecisionHistoryRecordInvalid(
                f"{what} of conversation {key} in the encrypted {self.label} store is refused: "
                f"{e}. It was not modified; inspect it with `touba history show {key}` or "
                "delete it"
            ) from None
        except UnicodeDecodeError:  # pragma: no cover - only sealed UTF-8 opens
            raise DecisionHistoryRecordInvalid(
                f"{what} of conversation {key} in the encrypted {self.label} store is not "
                "text; it was not modified"
            ) from None

    def open_rows(self, key: str, rows: Rows, first: int) -> list[tuple[int, int, str]]:
        """``rows`` (exchange, bytes, token) opened, the first being message ``first``."""
        return [
            (exchange, size, self.open_body(key, seq, body))
            for seq, (exchange, size, body) in enumerate(rows, first)
        ]

    def open_stored(
        self, key: str, head: str | None, rows: Rows
    ) -> tuple[str | None, list[tuple[int, int, str]]]:
        """A whole stored record (its head and every row) opened."""
        if head is None:
            return None, []
        return self.open_head(key, head), self.open_rows(key, rows, 0)

    def open_raw(self, raw: RawConversation) -> RawConversation:
        """``raw`` (a ``read_raw`` of this store) with each value opened in its place
        (the head, then row ``i`` as message ``i``); a value that does not open is
        kept as text that is not JSON (see the module docstring), never as plaintext."""
        missing: set[str] = set()
        try:
            head = self.open_head(raw.key, raw.head)
        except DecisionHistoryRecordInvalid:
            head = self._unopened(raw.head, missing)
        rows = []
        for seq, row in enumerate(raw.rows):
            try:
                rows.append(replace(row, body=self.open_body(raw.key, seq, row.body)))
            except DecisionHistoryRecordInvalid:
                rows.append(replace(row, body=self._unopened(row.body, missing)))
        return replace(raw, head=head, rows=tuple(rows), missing_keys=tuple(sorted(missing)))

    def _unopened(self, stored: str, missing: set[str]) -> str:
        """A value that does not open, as text that is not JSON (never read as
        plaintext); the id of a key not given is added to ``missing``."""
        if not Encryption.is_sealed(stored):
            return f"not sealed: {stored}"
        try:
            key_id = Encryption.key_id_of(stored)
        except DecisionHistoryRecordInvalid:
            return stored
        if not self.encryption.has_key(key_id):
            missing.add(key_id)
        return stored

    def is_current(self, value: object) -> bool:
        """Whether ``value`` is a token of the current key (not whether it opens)."""
        return isinstance(value, str) and value.startswith(self.prefix)


class SealedBackend:
    """A backend whose heads and bodies are sealed at rest (see the module docstring)."""

    def __init__(self, inner: Backend, sealer: Sealer) -> None:
        self._inner = inner
        self._sealer = sealer
        self.driver_errors = inner.driver_errors
        self.label = inner.label
        self.sees_edits = getattr(inner, "sees_edits", True)
        self.drops = getattr(inner, "drops", False)
        self.drops_unreserved = getattr(inner, "drops_unreserved", False)
        # key -> (plaintext head, sealed head) last read or written (for save_if); a
        # store may serve several event loops, so the map has a lock
        self._heads: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        # key -> (exchanges, messages) of its reservation (to place older rows)
        self._counts: dict[str, tuple[int, int]] = {}

    def _remember(self, key: str, plain: str, sealed: str) -> None:
        with self._lock:
            heads = self._heads
            heads[key] = (plain, sealed)
            heads.move_to_end(key)
            while len(heads) > _HEADS:
                heads.popitem(last=False)

    def _held(self, key: str) -> tuple[str, str] | None:
        with self._lock:
            return self._heads.get(key)

    def _opened_head(self, key: str, token: str) -> str:
        held = self._held(key)
        if held is not None and held[1] == token:
            return held[0]
        plain = self._sealer.open_head(key, token)
        self._remember(key, plain, token)
        return plain

    def _opened(self, key: str, reserved: Reserved) -> Reserved:
        if reserved.head is None:
            return reserved
        self._counts[key] = (reserved.exchanges, reserved.messages)
        head = self._opened_head(key, reserved.head)
        rows = reserved.rows
        if rows:  # a reservation's rows end at the last message
            rows = self._sealer.open_rows(key, rows, reserved.messages - len(rows))
        return replace(reserved, head=head, rows=rows)

    def _sealed(self, key: str, write: Write) -> Write:
        sealer = self._sealer
        head = sealer.seal_head(key, write.head)
        rows = [
            (seq, exchange, size, sealer.seal_body(key, seq, body))
            for seq, exchange, size, body in write.rows
        ]
        return replace(write, head=head, rows=rows, head_bytes=len(write.head.encode("utf-8")))

    async def reserve(self, key: str, reservation: Reservation, read: Read) -> Reserved:
        """``Backend.reserve``, opened; a state that does not open is refused, the key freed."""
        reserved = await self._inner.reserve(key, reservation, read)
        try:
            return self._opened(key, reserved)
        except BaseException:
            await self._inner.release(key, reservation.token)
            raise

    async def save(self, key: str, token: str, write: Write) -> None:
        """``Backend.save`` of ``write`` sealed."""
        sealed = self._sealed(key, write)
        await self._inner.save(key, token, sealed)
        self._counts.pop(key, None)
        self._remember(key, write.head, sealed.head)

    async def delete(self, key: str, token: str) -> None:
        """``Backend.delete``."""
        self._counts.pop(key, None)
        with self._lock:
            self._heads.pop(key, None)
        await self._inner.delete(key, token)

    async def release(self, key: str, token: str) -> None:
        """``Backend.release``."""
        self._counts.pop(key, None)
        await self._inner.release(key, token)

    async def read_sizes(self, key: str, start: int, stop: int) -> Sizes:
        """``Backend.read_sizes`` (sizes are plaintext sizes: nothing to open)."""
        return await self._inner.read_sizes(key, start, stop)

    async def read_rows(self, key: str, start: int, stop: int) -> Rows:
        """``Backend.read_rows``, opened: the range is placed by the sizes after it."""
        rows = await self._inner.read_rows(key, start, stop)
        if not rows:
            return rows
        exchanges, messages = self._counts.get(key, (stop, -1))
        if messages < 0:
            raise DecisionHistoryRecordInvalid(  # pragma: no cover - the protocol reserves first
                f"rows of conversation {key} were read without its reservation"
            )
        after = 0
        if stop < exchanges:
            after = sum(n for _e, n, _b in await self._inner.read_sizes(key, stop, exchanges))
        return self._sealer.open_rows(key, rows, messages - after - len(rows))


class _SealedSaveIf(SealedBackend):
    """A :class:`SealedBackend` over a backend with ``save_if`` (not in content mode)."""

    async def save_if(
        self, key: str, version: str, head: str, token: str, write: Write, seen: Seen | None
    ) -> bool:
        """``save_if`` against the sealed text of ``head`` (False when it is not known)."""
        held = self._held(key)
        if held is None or held[0] != head:
            return False
        inner: Any = self._inner
        if write.renews(head):  # the head unchanged: the stored text stays as it is
            sealed = replace(write, head=held[1], head_bytes=len(head.encode("utf-8")))
        else:
            sealed = self._sealed(key, write)
        saved = bool(await inner.save_if(key, version, held[1], token, sealed, seen))
        if saved:
            self._remember(key, write.head, sealed.head)
        return saved

    async def peek(self, key: str, read: Read) -> Reserved | None:
        """``peek``, opened (None when the backend has none: the reserved path reads)."""
        peek = getattr(self._inner, "peek", None)
        if peek is None:
            return None
        reserved: Reserved | None = await peek(key, read)
        if reserved is None:
            return None
        try:
            return self._opened(key, reserved)
        finally:
            self._counts.pop(key, None)  # (a peeked read never reads older rows)


def sealed_backend(inner: Backend, sealer: Sealer) -> SealedBackend:
    """``inner`` sealed; its optimistic save is kept unless it runs in content mode."""
    content = not getattr(inner, "sees_edits", True)
    if getattr(inner, "save_if", None) is not None and not content:
        return _SealedSaveIf(inner, sealer)
    return SealedBackend(inner, sealer)


async def _unchanged(record: Any) -> tuple[Any, None]:
    return record, None


async def rekey_keys(
    keys: Sequence[str],
    transact: Callable[[str, Any], Awaitable[Any]],
    label: str,
) -> int:
    """Re-seal each conversation of ``keys`` with the current key, one reservation
    each (``transact`` saving the record unchanged); a busy or damaged one is
    skipped (logged without content). How many were re-sealed."""
    done = 0
    for key in keys:
        try:
            await transact(key, _unchanged)
        except DecisionHistoryBusy:
            logger.info("rekey: conversation %s is in use; it is re-sealed on a later pass", key)
            continue
        except DecisionHistoryRecordInvalid:
            logger.warning(
                "rekey: conversation %s in the %s store does not open; it is left as it is "
                "(repair or delete it)",
                key,
                label,
            )
            continue
        done += 1
    return done


class Rekeying:
    """Where a store object's ``rekey`` passes stand: the cursor after the last
    conversation it looked at (a new object starts over, finding only what is left)."""

    def __init__(self) -> None:
        self.after = ""

    async def run(
        self,
        stale: Callable[[str], Awaitable[tuple[list[str], str]]],
        transact: Callable[[str, Any], Awaitable[Any]],
        label: str,
    ) -> int:
        """Re-seal the next conversations ``stale(cursor)`` names (it returns them and
        the next cursor) until some were re-sealed; 0 when a whole pass (from the
        start) re-sealed nothing: what is left is in use or does not open."""
        wrapped = not self.after  # a pass from the start ends the call at the end
        while True:
            keys, after = await stale(self.after)
            if not keys:
                self.after = ""
                if wrapped:
                    return 0
                wrapped = True
                continue
            self.after = after
            done = await rekey_keys(keys, transact, label)
            if done:
                return done
