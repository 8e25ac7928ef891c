"""Encryption at rest of the SQL memory stores: which columns are sealed, bound to what.

With ``encryption=`` (a :class:`touba.Encryption`) a memory store seals, with
AES-GCM, every column that holds a user's content, each value bound (the
associated data) to the store (``touba.memory``, its table prefix), the table,
the row's position and the column:

- a turn's ``user_text``, ``replies``, ``trace`` and ``context`` (a turn without
  context stores a sealed ``null``, so that a NULL cannot stand in for it), bound
  to its session id and turn index;
- a key event's ``title`` and ``details``, bound to its owner and id;
- each row of its update history (``changes``: the old and new values), bound to
  its event id and ``seq``;
- an extraction job's ``ops`` and ``result``, bound to the job id.

What stays plaintext, because lists, filters, leases and erasure read it in SQL:
ids, owners, agent refs, modes, key-event ``type`` and ``status``, dates,
counters, job statuses, lease fields and ``last_error`` (touba's own messages),
``transcript_ref``, and the per-agent memory settings (configuration, not a
user's content).

Reading fails closed: in an encrypted store a plaintext, altered, truncated or
moved value raises :class:`~touba.errors.DecisionHistoryRecordInvalid`; a store
without ``encryption=`` refuses a sealed value the same way instead of handing a
token out as text. (Key-event titles and details are free text, so there a row
counts as sealed only when both are whole tokens.) Errors name a key id at most.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from touba._encryption import Encryption
from touba.errors import DecisionHistoryRecordInvalid

__all__ = ["MemorySeal"]

_TOKEN = re.compile(r"tbe1\.[A-Za-z0-9_-]{1,64}\.[A-Za-z0-9_=-]{40,}")


def _unencrypted() -> DecisionHistoryRecordInvalid:
    return DecisionHistoryRecordInvalid(
        "a row of this memory store is sealed (encrypted at rest) but the store was opened "
        "without encryption=; open it with its touba.Encryption. Nothing was read"
    )


class MemorySeal:
    """Seals and opens the content columns of one memory store (none when
    ``encryption`` is None, refusing sealed values then)."""

    def __init__(self, encryption: Encryption | None, place: str) -> None:
        self.encryption = encryption
        self.place = place

    def _context(self, table: str, position: Sequence[str | int], field: str) -> bytes:
        return Encryption.context("touba.memory", self.place, table, *position, field)

    def seal(self, text: str, table: str, position: Sequence[str | int], field: str) -> str:
        """``text`` sealed for its place (``text`` itself without encryption)."""
        if self.encryption is None:
            return text
        return self.encryption.seal_text(text, context=self._context(table, position, field))

    def open(self, stored: Any, table: str, position: Sequence[str | int], field: str) -> Any:
        """A JSON column's plaintext; ``DecisionHistoryRecordInvalid`` when it does not open
        (or, without encryption, when it is sealed)."""
        if self.encryption is None:
            if Encryption.is_sealed(stored):
                raise _unencrypted()
            return stored
        return self.encryption.open_text(stored, context=self._context(table, position, field))

    # -- turns: (session_id, idx, user_text, replies, trace, invocation_id, created, context)

    def seal_turn(self, values: Sequence[Any]) -> tuple[Any, ...]:
        session_id, idx, user, replies, trace, invocation_id, created, context = values
        if self.encryption is None:
            return tuple(values)
        where = (session_id, idx)
        return (
            session_id,
            idx,
            self.seal(user, "turns", where, "user_text"),
            self.seal(replies, "turns", where, "replies"),
            self.seal(trace, "turns", where, "trace"),
            invocation_id,
            created,
            self.seal("null" if context is None else context, "turns", where, "context"),
        )

    def open_turn(self, row: Sequence[Any]) -> tuple[Any, ...]:
        session_id, idx, user, replies, trace, invocation_id, created, context = row
        where = (session_id, idx)
        if self.encryption is None and context is None:
            opened_context = None
        else:
            opened_context = self.open(context, "turns", where, "context")
        return (
            session_id,
            idx,
            self.open(user, "turns", where, "user_text"),
            self.open(replies, "turns", where, "replies"),
            self.open(trace, "turns", where, "trace"),
            invocation_id,
            created,
            opened_context,
        )

    # -- key events: (id, owner, type, title, status, details, created, updated, session_id)

    def seal_event(self, owner: str, event_id: str, title: str, details: str) -> tuple[str, str]:
        where = (owner, event_id)
        return (
            self.seal(title, "events", where, "title"),
            self.seal(details, "events", where, "details"),
        )

    def open_event(self, row: Sequence[Any]) -> tuple[Any, ...]:
        event_id, owner, type_, title, status, details, *rest = row
        if self.encryption is None:
            if _TOKEN.fullmatch(str(title)) and _TOKEN.fullmatch(str(details)):
                raise _unencrypted()
            return tuple(row)
        where = (owner, event_id)
        return (
            event_id,
            owner,
            type_,
            self.encryption.open_text(title, context=self._context("events", where, "title")),
            status,
            self.encryption.open_text(details, context=self._context("events", where, "details")),
            *rest,
        )

    # -- update history: (seq, at, session_id, changes, op_id, actor), of one event

    def open_history(self, event_id: str, row: Sequence[Any]) -> tuple[Any, ...]:
        seq, at, session_id, changes, op_id, actor = row
        opened = self.open(changes, "history", (event_id, seq), "changes")
        return (at, session_id, opened, op_id, actor)

    # -- extraction jobs: ``ops`` and ``result`` (columns 15 and 16), each may be NULL

    def seal_job(self, job_id: str, field: str, value: str | None) -> str | None:
        return None if value is None else self.seal(value, "jobs", (job_id,), field)

    def open_job(self, row: Sequence[Any]) -> tuple[Any, ...]:
        job_id, ops, result = row[0], row[15], row[16]
        return (
            *row[:15],
            None if ops is None else self.open(ops, "jobs", (job_id,), "ops"),
            None if result is None else self.open(result, "jobs", (job_id,), "result"),
        )
