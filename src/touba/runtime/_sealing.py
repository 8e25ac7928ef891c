"""Encryption at rest of the runtime's stores: checkpoints and resource bindings.

With ``encryption=`` (a :class:`touba.Encryption`) a checkpoint store seals each
checkpoint's ``body`` (the invocation's input, approvals, arguments, results and
trace), and a resource binding each item's ``value``, with AES-GCM. Each value is
bound (the associated data) to the kind of store, its table, the row's key
(checkpoint id; resource, scope, scope key and key) and the column, so a value
copied to another row, table or store does not open.

What stays plaintext: the columns that lists and the compare-and-swap read in
SQL (a checkpoint's id, ``run_id``, ``invocation_id``, ``agent_ref``, dates, and
in PostgreSQL its ``status`` and ``revision``; a resource item's address, key and
``updated_at``). Identifiers only: never a user's content.

Fail closed: in an encrypted store a plaintext, altered, truncated or moved value
raises :class:`~touba.errors.DecisionHistoryRecordInvalid`; a store without
``encryption=`` refuses a sealed value the same way (both bodies are JSON text, so
a token is never mistaken for one). Errors name a key id at most.

What SQL cannot read in a sealed body is read in Python after opening: a user's
checkpoints to erase or export (a body that does not open, unless its ``run_id``
already matches, refuses the erase naming the checkpoint: it is never skipped), and
in SQLite the status that ``purge_before`` spares (``running``). Exports open, imports
seal for the row's place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from touba._encryption import TOKEN_PREFIX, Encryption
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

__all__ = ["RowSeal", "check_batch", "rotate", "stale_prefix"]

Cursor = tuple[Any, ...] | None
Pass = Callable[[Cursor], Awaitable[tuple[int, Cursor]]]


class RowSeal:
    """Seals and opens one column of one store (nothing when ``encryption`` is None)."""

    def __init__(self, encryption: Encryption | None, kind: str, place: str, field: str) -> None:
        if encryption is not None and not isinstance(encryption, Encryption):
            raise ConfigurationError("encryption must be a touba.Encryption or None")
        self.encryption = encryption
        self._where = (kind, place)
        self._field = field

    def _context(self, position: tuple[str, ...]) -> bytes:
        return Encryption.context(*self._where, *position, self._field)

    def seal(self, text: str, *position: str) -> str:
        """``text`` sealed for the row at ``position`` (``text`` itself without encryption)."""
        if self.encryption is None:
            return text
        return self.encryption.seal_text(text, context=self._context(position))

    def open(self, stored: object, *position: str) -> str:
        """The plaintext of the row at ``position``; ``DecisionHistoryRecordInvalid`` when it
        does not open (without encryption: when it is sealed)."""
        if self.encryption is None:
            if Encryption.is_sealed(stored):
                raise DecisionHistoryRecordInvalid(
                    "a row of this store is sealed (encrypted at rest) but the store was "
                    "opened without encryption=; open it with its touba.Encryption. Nothing "
                    "was read"
                )
            return str(stored)
        return self.encryption.open_text(stored, context=self._context(position))

    def again(self, stored: object, *position: str) -> str:
        """The value re-sealed with the current key (rotation)."""
        return self.seal(self.open(stored, *position), *position)

    def stale(self) -> tuple[int, str]:
        """``substr(column, 1, n) <> prefix`` parameters finding values to re-seal.
        ``ConfigurationError`` without encryption."""
        if self.encryption is None:
            raise ConfigurationError("rekey needs a store opened with encryption=")
        return stale_prefix(self.encryption)


def stale_prefix(encryption: Encryption) -> tuple[int, str]:
    """The length and text of the token prefix of ``encryption``'s current key."""
    prefix = f"{TOKEN_PREFIX}{encryption.current}."
    return len(prefix), prefix


def check_batch(batch: object) -> int:
    """``rekey``'s ``batch``: an int >= 1, else ``ConfigurationError``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"batch must be an int >= 1, got {batch!r}")
    return batch


async def rotate(one_batch: Pass, after: Cursor, batch: int) -> tuple[int, Cursor]:
    """One ``rekey`` call over a table walked in key order from ``after`` (the key where
    the store's previous call stopped; None: the start): ``one_batch(after)`` re-seals up
    to ``batch`` rows past ``after`` in one transaction and returns how many and the last
    key. The count and the cursor to keep: past the end, the cursor goes back to the
    start, and 0 is returned only when a pass from the start found nothing (rows another
    process sealed with an older key behind the cursor are caught there)."""
    done, last = await one_batch(after)
    if done >= batch:
        return done, last
    if done == 0 and after is not None:
        done, last = await one_batch(None)
        return done, (last if done >= batch else None)
    return done, None
