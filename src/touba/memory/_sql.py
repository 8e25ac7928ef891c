"""The logic of the SQL memory stores, written once over a three-method connection.

``SqlMemoryStore`` implements every ``MemoryStore`` operation as one
transaction of the statements of :mod:`touba.memory._rows`. A backend
supplies the transaction (``_atomic``), the statements compiled for its
dialect, and its timestamp codec. Key events are ordered by ``touched``, a
per-owner write counter, so "most recently updated" follows the order of
writes even when clock readings tie.

Encryption at rest (``encryption=``, see :mod:`touba.memory._sealed`): values are
sealed just before a statement writes them and opened just after one reads
them, so every rule above (and every bound, counted by the callers on the
plaintext) is unchanged. The key-event text filter cannot run in SQL over
sealed columns: with encryption it runs in Python on the opened rows, paging
through the rows the other (plaintext) filters select. ``rekey`` re-seals with
the current key the values sealed with another, a batch per transaction. What
plain SQL does on the other columns it cannot do on sealed ones, so with
encryption: a fork opens each copied turn and seals it again for the new session
(a value is bound to its session and index); an import seals each record for its
place (an update history row once its insert gave its ``seq``); the traces purge
selects in Python, a page of old turns per transaction, and writes a sealed
``[]`` and ``null`` in their place, so every turn still opens.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final, Protocol, TypeVar

from touba._encryption import TOKEN_PREFIX, Encryption
from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.history._model import JSON
from touba.memory._config import MemoryConfig, config_to_data
from touba.memory._model import (
    KEY_EVENT_STATUSES,
    ExtractedOp,
    ExtractionJob,
    JobStatus,
    KeyEvent,
    KeyEventActor,
    KeyEventStatus,
    KeyEventUpdate,
    MemoryConfigChange,
    OwnerSummary,
    SavedMemoryConfig,
    SessionMeta,
    SessionMode,
    StoredTurn,
    diff_fields,
    trace_to_data,
)
from touba.memory._rows import (
    EXPIRED_LAST_ATTEMPT,
    MAX_ERROR_CHARS,
    Row,
    change_from_row,
    changes_json,
    config_from_text,
    dumps,
    event_from_row,
    job_from_row,
    ops_json,
    session_from_row,
    turn_from_row,
    update_from_row,
)
from touba.memory._sealed import MemorySeal
from touba.memory._store import (
    Clock,
    check_actor,
    check_clock,
    check_mode,
    check_op_owner,
    check_reopen,
    ended,
    job_id_for,
    lease_lost,
    new_event_id,
    requeued_job,
    unknown_session,
)
from touba.providers._types import TraceCall

__all__ = ["PURGE_BATCH", "Db", "SqlMemoryStore"]

R = TypeVar("R")
# Rows read per statement when the key-event text filter runs in Python (encryption).
_SEARCH_PAGE = 500
# ``rekey``'s cursor of a table it went through to the end.
_DONE: Final = object()
PURGE_BATCH = 500
"""How many rows one transaction of ``purge_before`` deletes or changes at most."""


class Db(Protocol):
    """One open transaction of a backend, running statements by name."""

    async def one(self, name: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def all(self, name: str, params: Sequence[Any] = ()) -> list[Row]: ...

    async def run(self, name: str, params: Sequence[Any] = ()) -> int: ...


class SqlMemoryStore(ABC):
    """Every ``MemoryStore`` operation, each one atomic; a backend provides the rest."""

    _clock: Clock
    _seal: MemorySeal = MemorySeal(None, "")
    _rekey_cursors: dict[str, Any]  # where the last ``rekey`` stopped in each table

    def _set_encryption(self, encryption: Encryption | None, place: str) -> None:
        """Seal this store's content with ``encryption`` (None: plaintext), bound to
        ``place`` (its table prefix). ``ConfigurationError`` for anything else."""
        if encryption is not None and not isinstance(encryption, Encryption):
            raise ConfigurationError("encryption must be a touba.Encryption or None")
        self._seal = MemorySeal(encryption, place)

    def now(self) -> datetime:
        """The store's clock (``MemoryStore.now``): it stamps writes, leases and retries.
        Raises ``ConfigurationError`` when the clock is naive."""
        return check_clock(self._clock)

    @abstractmethod
    def _enc(self, moment: datetime) -> Any: ...

    @abstractmethod
    def _dec(self, value: Any) -> datetime: ...

    @abstractmethod
    async def _atomic(self, body: Callable[[Db], Awaitable[R]], *, write: bool = True) -> R:
        """Run ``body`` in one transaction (committed, or rolled back if it raises)."""

    @abstractmethod
    async def close(self) -> None: ...

    async def _read(self, name: str, params: Sequence[Any]) -> list[Row]:
        """One read-only statement in its own transaction."""

        async def body(db: Db) -> list[Row]:
            return await db.all(name, params)

        return await self._atomic(body, write=False)

    async def _job(self, db: Db, job_id: str) -> ExtractionJob:
        row = await db.one("job", (job_id,))
        assert row is not None
        return self._job_of(row)

    def _job_of(self, row: Row) -> ExtractionJob:
        return job_from_row(self._seal.open_job(row), self._dec)

    def _turn_of(self, row: Row) -> StoredTurn:
        return turn_from_row(self._seal.open_turn(row), self._dec)

    def _event_of(self, row: Row, history: tuple[Any, ...] | None = None) -> KeyEvent:
        return event_from_row(self._seal.open_event(row), self._dec, history)

    # -- sessions and turns --------------------------------------------------------------

    async def open_session(
        self, session_id: str, *, owner: str, agent_ref: str, mode: SessionMode
    ) -> SessionMeta:
        """Create the session, or return it if it exists with the same owner, agent, mode."""
        check_mode(mode)

        async def body(db: Db) -> SessionMeta:
            values = (session_id, owner, agent_ref, mode, self._enc(self.now()))
            await db.run("insert_session", values)
            row = await db.one("session", (session_id,))
            assert row is not None
            return check_reopen(session_from_row(row, self._dec), owner, agent_ref, mode)

        return await self._atomic(body)

    async def get_session(self, session_id: str) -> SessionMeta | None:
        """The session, or None (``MemoryStore.get_session``)."""
        rows = await self._read("session", (session_id,))
        return session_from_row(rows[0], self._dec) if rows else None

    async def end_session(self, session_id: str) -> SessionMeta:
        """Mark the session ended (idempotent: the first end time stays)."""

        async def body(db: Db) -> SessionMeta:
            if not await db.run("end_session", (self._enc(self.now()), session_id)):
                raise unknown_session(session_id)
            row = await db.one("session", (session_id,))
            assert row is not None
            return session_from_row(row, self._dec)

        return await self._atomic(body)

    # -- retention (``touba.data.Retention``) --------------------------------------------

    async def purge_before(
        self,
        *,
        turns: datetime | None = None,
        events_closed: datetime | None = None,
        traces: datetime | None = None,
        dry_run: bool = False,
        batch_size: int = PURGE_BATCH,
    ) -> dict[str, int]:
        """Delete what is older than each given moment; a kind whose moment is None is
        not touched. The counts, by kind, of what went (with ``dry_run``: of what would
        go, nothing deleted).

        - ``turns``: turns created before it (``"turns"``, their trace and context
          with them); ended sessions that then have no turn left, ended before it
          (``"sessions"``: an open session stays, even empty, since it may go on);
          extraction jobs ``done`` or ``failed`` last changed before it
          (``"extraction_jobs"``: their ops quote what was extracted from those turns).
          A session's ``turns`` count keeps counting its expired turns (it numbers the
          next one).
        - ``events_closed``: key events ``closed`` whose last change (``updated_at``,
          the closing or a later edit) is before it (``"key_events"``), with their
          update history (``"key_event_updates"``). Open and in-progress events stay,
          however old.
        - ``traces``: the tool trace and the context record of turns created before it
          (``"traces"``: turns whose trace or context were dropped), the user message
          and the replies kept.

        Each batch of at most ``batch_size`` rows is its own short transaction (on
        SQLite with ``secure_delete``, as an erase: the deleted bytes are overwritten in
        the file, and the WAL checkpointed), so a large purge never holds the store's
        lock for long; a purge interrupted midway leaves whole batches done, and running
        it again finishes it. Raises ``ConfigurationError`` for a naive moment or a bad
        ``batch_size`` (nothing deleted), ``MemoryStoreUnavailable`` when the store
        fails.
        """
        for name, moment in (
            ("turns", turns),
            ("events_closed", events_closed),
            ("traces", traces),
        ):
            if moment is not None and (not isinstance(moment, datetime) or moment.tzinfo is None):
                raise ConfigurationError(
                    f"{name} must be a timezone-aware datetime or None, got {moment!r}; "
                    "nothing was deleted"
                )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
        counts: dict[str, int] = {}
        if turns is not None:
            cut = self._enc(turns)
            if dry_run:
                counts["turns"] = await self._count("count_old_turns", (cut,))
                counts["sessions"] = await self._count("count_emptied_sessions", (cut, cut))
                counts["extraction_jobs"] = await self._count("count_finished_jobs", (cut,))
            else:
                counts["turns"] = await self._batches("delete_old_turns", (cut, cut), batch_size)
                counts["sessions"] = await self._batches(
                    "delete_empty_sessions", (cut, cut), batch_size
                )
                counts["extraction_jobs"] = await self._batches(
                    "delete_finished_jobs", (cut, cut), batch_size
                )
        if events_closed is not None:
            cut = self._enc(events_closed)
            if dry_run:
                counts["key_events"] = await self._count("count_closed_events", (cut,))
                counts["key_event_updates"] = await self._count("count_closed_updates", (cut,))
            else:
                counts["key_events"], counts["key_event_updates"] = await self._closed_events(
                    cut, batch_size
                )
        if traces is not None and self._seal.encryption is not None:
            counts["traces"] = await self._sealed_traces(self._enc(traces), batch_size, dry_run)
            if dry_run and turns is not None:  # the turns that go anyway are not counted twice
                both = self._enc(min(turns, traces))
                counts["traces"] -= await self._sealed_traces(both, batch_size, True)
        elif traces is not None:
            cut = self._enc(traces)
            if not dry_run:
                counts["traces"] = await self._batches("drop_traces", (cut, cut), batch_size)
            else:  # the turns that go anyway are not counted twice
                counts["traces"] = await self._count("count_traces", (cut,))
                if turns is not None:
                    both = self._enc(min(turns, traces))
                    counts["traces"] -= await self._count("count_traces", (both,))
        return counts

    async def _sealed_traces(self, cut: Any, size: int, dry_run: bool) -> int:
        """The traces purge of an encrypted store, whose trace and context SQL cannot
        read: the turns created before ``cut``, a page of ``size`` per transaction in key
        order, each opened; those with a trace or a context get a sealed ``[]`` and a
        sealed ``null`` (the turn still opens). How many had one (with ``dry_run``:
        counted, nothing changed). Turns already without either (known by their
        tokens' length: ``old_turn_traces``) are not read again, so a purge run every
        day reads what changed since. A value that does not open raises
        ``DecisionHistoryRecordInvalid`` (the pages before it stay done)."""
        seal = self._seal
        assert seal.encryption is not None
        after: tuple[Any, Any] = (None, None)
        prefix = f"{TOKEN_PREFIX}{seal.encryption.current}."
        dropped_already = (
            *(len(prefix), prefix, len(seal.seal("[]", "turns", ("", 0), "trace"))),
            *(len(prefix), prefix, len(seal.seal("null", "turns", ("", 0), "context"))),
        )

        async def page(db: Db) -> tuple[int, int, tuple[Any, Any]]:
            params = (cut, after[0], *after, *dropped_already, size)
            found = await db.all("old_turn_traces", params)
            dropped = 0
            for session_id, idx, trace, context in found:
                where = (session_id, idx)
                if (
                    seal.open(trace, "turns", where, "trace") == "[]"
                    and seal.open(context, "turns", where, "context") == "null"
                ):
                    continue
                dropped += 1
                if not dry_run:
                    values = (
                        seal.seal("[]", "turns", where, "trace"),
                        seal.seal("null", "turns", where, "context"),
                    )
                    await db.run("set_trace", (*values, session_id, idx))
            last = (found[-1][0], found[-1][1]) if found else after
            return dropped, len(found), last

        total = 0
        while True:
            dropped, read, after = await (
                self._atomic(page, write=False) if dry_run else self._erase_atomic(page)
            )
            total += dropped
            if read < size:
                return total

    async def _count(self, name: str, params: Sequence[Any]) -> int:
        return int((await self._read(name, params))[0][0])

    async def _batches(self, name: str, params: Sequence[Any], size: int) -> int:
        """Run ``name`` (its last parameter the batch size) one transaction at a time,
        until a batch changes fewer rows than ``size``; the rows changed in all. Each is
        an erase's transaction: SQLite overwrites what it deletes (``secure_delete``)."""

        async def body(db: Db) -> int:
            return await db.run(name, (*params, size))

        total = 0
        while True:
            changed = await self._erase_atomic(body)
            total += changed
            if changed < size:
                return total

    async def _closed_events(self, cut: Any, size: int) -> tuple[int, int]:
        """Delete closed events last changed before ``cut`` and their update history,
        a batch per transaction; how many of each."""

        async def body(db: Db) -> tuple[int, int]:
            gone = await db.all("delete_closed_events", (cut, cut, size))
            updates = 0
            for (event_id,) in gone:
                updates += await db.run("delete_event_history", (event_id,))
            return len(gone), updates

        events = updates = 0
        while True:
            batch, history = await self._erase_atomic(body)
            events, updates = events + batch, updates + history
            if batch < size:
                return events, updates

    async def list_sessions(
        self,
        *,
        owner: str | None = None,
        limit: int = 100,
        offset: int = 0,
        mode: SessionMode | None = None,
    ) -> list[SessionMeta]:
        """Sessions, newest first (all owners when ``owner`` is None, every mode when
        ``mode`` is None), from ``offset``. ``ConfigurationError`` for another mode."""
        params = (owner, owner, *_mode_filter(mode), max(limit, 0), max(offset, 0))
        rows = await self._read("list_sessions", params)
        return [session_from_row(row, self._dec) for row in rows]

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session and its turns; its owner's key events and jobs stay."""

        async def body(db: Db) -> bool:
            await db.run("delete_turns", (session_id,))
            return await db.run("delete_session", (session_id,)) > 0

        return await self._atomic(body)

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def _owned_rows(
        self, db: Db, owners: Collection[str], session_ids: Collection[str]
    ) -> dict[str, Any]:
        """The ids of every row of ``owners`` and of ``session_ids`` (one read of each)."""
        sessions: set[str] = set()
        events: set[str] = set()
        jobs: set[str] = set()
        for owner in owners:
            sessions.update(str(r[0]) for r in await db.all("owner_session_ids", (owner,)))
            events.update(str(r[0]) for r in await db.all("owner_event_ids", (owner,)))
            jobs.update(str(r[0]) for r in await db.all("owner_job_ids", (owner,)))
        for session_id in session_ids:
            if await db.one("session_exists", (session_id,)) is not None:
                sessions.add(session_id)
        for session_id in set(sessions) | set(session_ids):
            jobs.update(str(r[0]) for r in await db.all("session_job_ids", (session_id,)))
        turns = 0
        for session_id in set(sessions) | set(session_ids):
            found = await db.one("session_turn_count", (session_id,))
            turns += int(found[0]) if found is not None else 0
        updates = 0
        for event_id in events:
            found = await db.one("event_history_count", (event_id,))
            updates += int(found[0]) if found is not None else 0
        return {
            "sessions": sessions,
            "all_sessions": set(sessions) | set(session_ids),
            "turns": turns,
            "events": events,
            "updates": updates,
            "jobs": jobs,
        }

    @staticmethod
    def _owned_counts(found: Mapping[str, Any]) -> dict[str, int]:
        counts = {
            "sessions": len(found["sessions"]),
            "turns": int(found["turns"]),
            "key_events": len(found["events"]),
            "key_event_updates": int(found["updates"]),
            "extraction_jobs": len(found["jobs"]),
        }
        return {kind: n for kind, n in counts.items() if n}

    async def _erase_atomic(self, body: Callable[[Db], Awaitable[R]]) -> R:
        """The erase transaction; SQLite overwrites the deleted bytes (``secure_delete``)."""
        return await self._atomic(body)

    async def erase_owner(
        self, owners: Collection[str], session_ids: Collection[str] = ()
    ) -> dict[str, int]:
        """Delete, in one transaction, every session of ``owners`` (owner strings such as
        ``owner_for(user_id, ...)``) and the sessions ``session_ids``, their turns (with
        each turn's context), the key events of ``owners`` with their update history,
        and the extraction jobs of those owners or sessions. Per-agent memory settings
        are kept. Returns the rows deleted by kind (``sessions``, ``turns``,
        ``key_events``, ``key_event_updates``, ``extraction_jobs``; kinds with none left
        out); running it again deletes nothing more. Other owners' rows are untouched.
        A SQLite store overwrites the deleted bytes in the file (``secure_delete``) and
        checkpoints its WAL. ``MemoryStoreUnavailable`` (nothing deleted) when the store
        fails."""
        owners, session_ids = _ids("owners", owners), _ids("session_ids", session_ids)

        async def body(db: Db) -> dict[str, int]:
            found = await self._owned_rows(db, owners, session_ids)
            for event_id in found["events"]:
                await db.run("erase_event_history", (event_id,))
                await db.run("erase_event", (event_id,))
            for job_id in found["jobs"]:
                await db.run("erase_job", (job_id,))
            for session_id in found["all_sessions"]:
                await db.run("delete_turns", (session_id,))
                await db.run("delete_session", (session_id,))
            return self._owned_counts(found)

        return await self._erase_atomic(body)

    async def count_owner(
        self, owners: Collection[str], session_ids: Collection[str] = ()
    ) -> dict[str, int]:
        """What :meth:`erase_owner` would delete now, by kind (kinds with none left out):
        empty once they are erased. Reads only."""
        owners, session_ids = _ids("owners", owners), _ids("session_ids", session_ids)

        async def body(db: Db) -> dict[str, int]:
            return self._owned_counts(await self._owned_rows(db, owners, session_ids))

        return await self._atomic(body, write=False)

    async def append_turn(
        self,
        session_id: str,
        *,
        user: str,
        replies: Sequence[str],
        trace: Sequence[Sequence[TraceCall]] = (),
        invocation_id: str | None = None,
        context: Mapping[str, JSON] | None = None,
    ) -> StoredTurn:
        """Add the next turn of an open session; its index is given by the store.
        ``context`` (a JSON object, or None) is kept as the turn's ``context``."""
        # All as JSON: PostgreSQL text cannot hold a NUL character, JSON escapes it.
        user_json, replies_json = dumps(user, "user"), dumps(list(replies), "replies")
        trace_json = dumps(trace_to_data(trace), "trace")
        context_json = None
        if context is not None:
            if not isinstance(context, Mapping):
                raise ConfigurationError(
                    f"context must be a JSON object (a mapping with str keys) or None, got "
                    f"{type(context).__name__}; nothing was saved"
                )
            context_json = dumps(dict(context), "context")

        async def body(db: Db) -> StoredTurn:
            row = await db.one("next_turn", (session_id,))
            if row is None:
                if await db.one("session", (session_id,)) is None:
                    raise unknown_session(session_id)
                raise ended(session_id)
            now = self._enc(self.now())
            values = (
                session_id,
                row[0] - 1,
                user_json,
                replies_json,
                trace_json,
                invocation_id,
                now,
                context_json,
            )
            await db.run("insert_turn", self._seal.seal_turn(values))
            return turn_from_row(values, self._dec)

        return await self._atomic(body)

    async def recent_turns(self, session_id: str, limit: int) -> tuple[StoredTurn, ...]:
        """The last ``limit`` turns, oldest first (none for an unknown session)."""
        rows = await self._read("recent_turns", (session_id, max(limit, 0)))
        return tuple(self._turn_of(row) for row in reversed(rows))

    # -- fork and rewind (whole turns) ---------------------------------------------------

    async def fork_session(
        self, session_id: str, new_session_id: str, *, at_turn: int, owner: str
    ) -> SessionMeta:
        """Copy turns 1 .. ``at_turn`` of a session (text, replies, tool trace, context
        and time, each turn whole) into a new open session of ``owner``, with the
        original's agent and mode, atomically; return the new session. The original
        is not changed (its row is locked while the copy runs, so that an append or
        a rewind of it waits). Key events and jobs are not copied.

        ``ConfigurationError`` (nothing written) for a session never opened, an
        ``at_turn`` that is not an int from 1 to its turn count, an empty
        ``new_session_id`` or ``owner``, or a ``new_session_id`` already used;
        ``MemoryStoreUnavailable`` when the original's turns are not all there.
        """
        _check_turn("at_turn", at_turn, 1)
        for name, value in (("new_session_id", new_session_id), ("owner", owner)):
            if not isinstance(value, str) or not value.strip():
                raise ConfigurationError(f"{name} must be a non-empty str, got {value!r}")

        async def body(db: Db) -> SessionMeta:
            row = await db.one("session_locked", (session_id,))
            if row is None:
                raise unknown_session(session_id)
            original = session_from_row(row, self._dec)
            _check_range("at_turn", at_turn, 1, original)
            values = (new_session_id, owner, original.agent_ref, original.mode)
            if not await db.run("insert_session", (*values, self._enc(self.now()))):
                raise ConfigurationError(
                    f"chat session {new_session_id!r} already exists; fork into a new "
                    "session id. Nothing was written"
                )
            if self._seal.encryption is None:
                copied = await db.run("copy_turns", (new_session_id, session_id, at_turn))
            else:  # each value is bound to its session: opened and sealed for the copy's
                copied = await self._copy_sealed_turns(db, session_id, new_session_id, at_turn)
            if copied != at_turn:
                raise MemoryStoreUnavailable(
                    f"chat session {session_id!r} counts {original.turns} turns but "
                    f"{copied} of its first {at_turn} are stored; nothing was written. "
                    "Inspect the session"
                )
            await db.run("set_turns", (at_turn, new_session_id))
            created = await db.one("session", (new_session_id,))
            assert created is not None
            return session_from_row(created, self._dec)

        return await self._atomic(body)

    async def _copy_sealed_turns(
        self, db: Db, session_id: str, new_session_id: str, at: int
    ) -> int:
        """``copy_turns`` in an encrypted store: the turns of ``session_id`` under index
        ``at``, a page at a time, opened and sealed again for ``new_session_id``; how
        many. ``DecisionHistoryRecordInvalid`` for a value that does not open."""
        copied, page = 0, 200
        while True:
            found = await db.all("turns_page", (session_id, page, copied))
            for row in found:
                if row[1] >= at:
                    return copied
                _, idx, *rest = self._seal.open_turn(row)
                await db.run("insert_turn", self._seal.seal_turn((new_session_id, idx, *rest)))
                copied += 1
            if len(found) < page:
                return copied

    async def rewind_session(self, session_id: str, *, to_turn: int) -> int:
        """Keep turns 1 .. ``to_turn`` of an open session and delete the later ones
        (each whole), atomically; return how many were deleted. The next turn
        appended is turn ``to_turn + 1``. Key events and jobs are not changed.

        ``ConfigurationError`` (nothing written) for a session never opened or
        already ended (its extraction job names its turn count), or a ``to_turn``
        that is not an int from 0 to its turn count.
        """
        _check_turn("to_turn", to_turn, 0)

        async def body(db: Db) -> int:
            row = await db.one("session_locked", (session_id,))
            if row is None:
                raise unknown_session(session_id)
            meta = session_from_row(row, self._dec)
            if meta.ended_at is not None:
                raise ConfigurationError(
                    f"chat session {session_id!r} has ended; an ended session is not "
                    "rewound (fork it instead). Nothing was changed"
                )
            _check_range("to_turn", to_turn, 0, meta)
            dropped = await db.run("drop_turns_after", (session_id, to_turn))
            await db.run("set_turns", (to_turn, session_id))
            return dropped

        return await self._atomic(body)

    # -- key events ----------------------------------------------------------------------

    async def create_event(
        self,
        *,
        owner: str,
        type: str,
        title: str,
        details: str,
        session_id: str,
        op_id: str | None = None,
    ) -> KeyEvent:
        """Insert an open event; with ``op_id`` seen before, return that event instead."""

        async def body(db: Db) -> KeyEvent:
            now = self._enc(self.now())
            while True:
                if op_id is not None and (row := await db.one("event_by_op", (op_id,))):
                    return check_op_owner(self._event_of(row), owner, op_id)
                values = (new_event_id(), owner, type, title, details, now, now, session_id)
                sealed = self._seal.seal_event(owner, values[0], title, details)
                stored = (*values[:3], *sealed, *values[5:])
                if await db.run("insert_event", (*stored, owner, op_id)):
                    return event_from_row((*values[:4], "open", *values[4:]), self._dec)
                # an id collision (next to impossible), or the same op_id committed meanwhile

        return await self._atomic(body)

    async def update_event(
        self,
        owner: str,
        event_id: str,
        changes: Mapping[str, str],
        *,
        session_id: str,
        op_id: str | None = None,
        actor: KeyEventActor = "model",
    ) -> KeyEvent | None:
        """Apply the changes that alter something and record them as made by ``actor``;
        None if not the owner's."""
        if actor not in ("model", "operator"):
            raise ConfigurationError(f"actor must be 'model' or 'operator', got {actor!r}")

        async def body(db: Db) -> KeyEvent | None:
            row = await db.one("event_locked", (event_id, owner))
            if row is None:
                return None
            event = self._event_of(row)
            if op_id is not None and await db.one("op_applied", (op_id,)):
                return event
            diff = diff_fields(event, changes)
            if not diff:
                return event
            new: dict[str, Any] = {change.field: change.new for change in diff}
            now = self.now()
            status, title, details = (
                new.get(name, getattr(event, name)) for name in ("status", "title", "details")
            )
            sealed = self._seal.seal_event(owner, event_id, title, details)
            await db.run("update_event", (status, *sealed, self._enc(now), owner, event_id))
            changed = changes_json(diff)
            history = (event_id, self._enc(now), session_id, changed, op_id, actor)
            if self._seal.encryption is None:
                await db.run("insert_history", history)
            else:  # sealed bound to its seq, which the insert gives
                inserted = await db.one("insert_history_seq", (*history[:3], "", *history[4:]))
                assert inserted is not None
                where = (event_id, inserted[0])
                value = self._seal.seal(changed, "history", where, "changes")
                await db.run("reseal_history", (value, inserted[0]))
            row = await db.one("event", (event_id, owner))
            assert row is not None
            return self._event_of(row)

        return await self._atomic(body)

    async def get_event(self, owner: str, event_id: str) -> KeyEvent | None:
        """The event with its update history, oldest first; None for another owner's id."""

        async def body(db: Db) -> KeyEvent | None:
            row = await db.one("event", (event_id, owner))
            if row is None:
                return None
            history = await db.all("history_seq", (event_id,))
            updates = tuple(
                update_from_row(self._seal.open_history(event_id, h), self._dec) for h in history
            )
            return self._event_of(row, updates)

        return await self._atomic(body, write=False)

    async def query_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
        limit: int = 20,
        offset: int = 0,
    ) -> list[KeyEvent]:
        """The owner's events, most recently updated first (history not loaded), from
        ``offset``. With encryption, ``text`` is matched in Python on the opened rows
        (the columns are sealed), reading the rows the other filters select."""
        filters = _event_filters(type, status, text, include_closed)
        if self._seal.encryption is not None and text is not None:
            found = await self._search("query_events", (owner,), filters, offset + limit)
            return found[max(offset, 0) : max(offset, 0) + max(limit, 0)]
        params = (owner, *filters, max(limit, 0), max(offset, 0))
        rows = await self._read("query_events", params)
        return [self._event_of(row) for row in rows]

    async def count_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int:
        """How many events ``query_events`` would find with these filters and no limit
        (with encryption and ``text``: counted in Python, reading every candidate)."""
        filters = _event_filters(type, status, text, include_closed)
        if self._seal.encryption is not None and text is not None:
            return len(await self._search("query_events", (owner,), filters, None))
        rows = await self._read("count_events", (owner, *filters))
        return int(rows[0][0])

    async def query_all_events(
        self,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
        limit: int = 20,
        offset: int = 0,
    ) -> list[KeyEvent]:
        """Every owner's events that match, most recently updated first (history not
        loaded), from ``offset``: the operator's search, never a turn's (a turn reads
        only its owner's, with ``query_events``).

        ``type`` matches exactly; ``text`` is a case-insensitive substring of the title
        or the details, taken literally (``%`` and ``_`` are plain characters). A
        filter that is not a str (``status``: not a key-event status), or a NUL
        character in one, is a ``ConfigurationError``. With encryption the title and
        details are sealed: ``text`` is then matched in Python on the opened rows,
        reading every row the other filters select (a search costs a scan).
        """
        filters = _event_filters(type, status, text, include_closed)
        if self._seal.encryption is not None and text is not None:
            found = await self._search("query_all_events", (), filters, offset + limit)
            return found[max(offset, 0) : max(offset, 0) + max(limit, 0)]
        rows = await self._read("query_all_events", (*filters, max(limit, 0), max(offset, 0)))
        return [self._event_of(row) for row in rows]

    async def count_all_events(
        self,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int:
        """How many events ``query_all_events`` would find with these filters and no limit
        (with encryption and ``text``: counted in Python, reading every candidate)."""
        filters = _event_filters(type, status, text, include_closed)
        if self._seal.encryption is not None and text is not None:
            return len(await self._search("query_all_events", (), filters, None))
        rows = await self._read("count_all_events", filters)
        return int(rows[0][0])

    async def _search(
        self, name: str, head: tuple[Any, ...], filters: tuple[Any, ...], stop: int | None
    ) -> list[KeyEvent]:
        """The events of statement ``name`` whose opened title or details contain the
        text filter (case-insensitive, as in SQL), in its order; the first ``stop``
        when given. One read transaction, ``_SEARCH_PAGE`` rows per statement."""
        needle = str(filters[5]).lower()
        plain = (*filters[:5], None, None, None)

        async def body(db: Db) -> list[KeyEvent]:
            found: list[KeyEvent] = []
            offset = 0
            while stop is None or len(found) < stop:
                rows = await db.all(name, (*head, *plain, _SEARCH_PAGE, offset))
                for row in rows:
                    event = self._event_of(row)
                    if needle in event.title.lower() or needle in event.details.lower():
                        found.append(event)
                if len(rows) < _SEARCH_PAGE:
                    break
                offset += _SEARCH_PAGE
            return found

        return await self._atomic(body, write=False)

    # -- extraction jobs -----------------------------------------------------------------

    async def enqueue_job(
        self, *, session_id: str, owner: str, agent_ref: str, transcript_ref: str, max_attempts: int
    ) -> tuple[ExtractionJob, bool]:
        """Queue the job of one session end; the same end again returns the same job."""
        job_id = job_id_for(session_id, transcript_ref)

        async def body(db: Db) -> tuple[ExtractionJob, bool]:
            now = self._enc(self.now())
            values = (job_id, session_id, owner, agent_ref, transcript_ref, max_attempts)
            created = await db.run("insert_job", (*values, now, now, now))
            return await self._job(db, job_id), created > 0

        return await self._atomic(body)

    async def claim_job(
        self, worker_id: str, lease_seconds: float, *, job_id: str | None = None
    ) -> ExtractionJob | None:
        """Lease the next due job (only ``job_id`` if given): pending and due, or running
        with an expired lease."""

        async def body(db: Db) -> ExtractionJob | None:
            moment = self.now()
            now = self._enc(moment)
            await db.run("expire_jobs", (EXPIRED_LAST_ATTEMPT, now, now))
            row = await db.one("due_job", (now, now, job_id, job_id))
            if row is None:
                return None
            until = self._enc(moment + timedelta(seconds=lease_seconds))
            await db.run("claim_job", (worker_id, secrets.token_hex(16), until, now, row[0]))
            return await self._job(db, row[0])

        return await self._atomic(body)

    async def _leased(
        self, job_id: str, token: str, change: Callable[[Db, ExtractionJob], Awaitable[None]]
    ) -> ExtractionJob:
        async def body(db: Db) -> ExtractionJob:
            row = await db.one("leased_job", (job_id, token))
            if row is None:
                raise lease_lost(job_id)
            await change(db, self._job_of(row))
            return await self._job(db, job_id)

        return await self._atomic(body)

    async def record_job_ops(
        self, job_id: str, lease_token: str, ops: Sequence[ExtractedOp]
    ) -> tuple[ExtractedOp, ...]:
        """Record the extracted ops once; return the recorded ones (the first run's)."""
        encoded = ops_json(ops)

        async def change(db: Db, job: ExtractionJob) -> None:
            sealed = self._seal.seal_job(job_id, "ops", encoded)
            await db.run("set_ops", (sealed, self._enc(self.now()), job_id))

        job = await self._leased(job_id, lease_token, change)
        assert job.ops is not None
        return job.ops

    async def _finish(
        self, job_id: str, token: str, result: JSON, error: str | None, retry_at: datetime | None
    ) -> ExtractionJob:
        """Done (``error`` None), pending again at ``retry_at``, or failed for good."""
        encoded = None if result is None else dumps(result, "result")

        async def change(db: Db, job: ExtractionJob) -> None:
            status, next_at, message = "done", job.next_attempt_at, None  # old errors go
            if error is not None:
                message = error[:MAX_ERROR_CHARS]
                if retry_at is None or job.attempts >= job.max_attempts:
                    status = "failed"
                else:
                    status, next_at = "pending", retry_at
            now = self._enc(self.now())
            sealed = self._seal.seal_job(job_id, "result", encoded)
            values = (status, sealed, self._enc(next_at), message, now, job_id)
            await db.run("finish_job", values)

        return await self._leased(job_id, token, change)

    async def complete_job(self, job_id: str, lease_token: str, result: JSON) -> ExtractionJob:
        """Mark the job done with its result (JSON)."""
        return await self._finish(job_id, lease_token, result, None, None)

    async def fail_job(
        self, job_id: str, lease_token: str, error: str, retry_at: datetime | None
    ) -> ExtractionJob:
        """Pending again at ``retry_at``; ``failed`` for good when None or out of attempts."""
        return await self._finish(job_id, lease_token, None, error, retry_at)

    async def requeue_job(self, job_id: str) -> ExtractionJob:
        """Give a ``failed`` job a fresh set of attempts, due now."""

        async def body(db: Db) -> ExtractionJob:
            now = self._enc(self.now())
            requeued = await db.run("requeue_job", (now, now, job_id))
            row = await db.one("job", (job_id,))
            return requeued_job(job_id, None if row is None else self._job_of(row), requeued)

        return await self._atomic(body)

    async def get_job(self, job_id: str) -> ExtractionJob | None:
        """The job, or None (``MemoryStore.get_job``)."""
        rows = await self._read("job", (job_id,))
        return self._job_of(rows[0]) if rows else None

    # -- import (touba.data.import_records): records as exported, ids and times kept -----

    async def import_session(self, session: SessionMeta) -> bool:
        """Insert ``session`` as exported (its times and turn count kept); False, changing
        nothing, when a session of that id exists. ``ConfigurationError`` for a bad mode."""
        check_mode(session.mode)
        ended_at = None if session.ended_at is None else self._enc(session.ended_at)
        values = (
            session.session_id,
            session.owner,
            session.agent_ref,
            session.mode,
            self._enc(session.created_at),
            ended_at,
            session.turns,
        )

        async def body(db: Db) -> bool:
            return await db.run("import_session", values) > 0

        return await self._atomic(body)

    async def import_turn(self, turn: StoredTurn) -> bool:
        """Insert ``turn`` at its index, its time and context kept (the session's turn
        count is not changed: import the session as exported); False, changing nothing,
        when that turn exists. ``ConfigurationError`` (nothing written) for a session
        never opened, or content that is not JSON data."""
        context = None if turn.context is None else dumps(dict(turn.context), "context")
        values = (
            turn.session_id,
            turn.index,
            dumps(turn.user, "user"),
            dumps(list(turn.replies), "replies"),
            dumps(trace_to_data(turn.trace), "trace"),
            turn.invocation_id,
            self._enc(turn.created_at),
            context,
        )

        async def body(db: Db) -> bool:
            if await db.one("session", (turn.session_id,)) is None:
                raise unknown_session(turn.session_id)
            return await db.run("import_turn", self._seal.seal_turn(values)) > 0

        return await self._atomic(body)

    async def import_event(self, event: KeyEvent) -> bool:
        """Insert ``event`` (its history apart: :meth:`import_event_change`) keeping its
        id, status and times, ordered before its owner's other events; False, changing
        nothing, when an event of that id exists."""
        if event.status not in KEY_EVENT_STATUSES:
            raise ConfigurationError(f"status must be one of {', '.join(KEY_EVENT_STATUSES)}")
        title, details = self._seal.seal_event(event.owner, event.id, event.title, event.details)
        values = (
            event.id,
            event.owner,
            event.type,
            title,
            event.status,
            details,
            self._enc(event.created_at),
            self._enc(event.updated_at),
            event.session_id,
            event.owner,
        )

        async def body(db: Db) -> bool:
            return await db.run("import_event", values) > 0

        return await self._atomic(body)

    async def event_owner(self, event_id: str) -> str | None:
        """The owner of key event ``event_id``, or None when there is none (an operator's
        read: an import checks that an event id it brings is not another owner's)."""
        rows = await self._read("event_owner", (event_id,))
        return str(rows[0][0]) if rows else None

    async def import_event_change(self, event_id: str, index: int, update: KeyEventUpdate) -> bool:
        """Append ``update`` as entry ``index`` (from 0) of the event's history; False,
        changing nothing, when the history already holds ``index + 1`` entries or its
        ``op_id`` was recorded. ``ConfigurationError`` when the history holds fewer
        than ``index`` entries (the earlier ones come first) or the actor is unknown."""
        if update.actor not in ("model", "operator"):
            raise ConfigurationError(f"actor must be 'model' or 'operator', got {update.actor!r}")
        values = (
            event_id,
            self._enc(update.at),
            update.session_id,
            changes_json(update.changes),
            update.op_id,
            update.actor,
        )

        async def body(db: Db) -> bool:
            row = await db.one("event_history_count", (event_id,))
            held = 0 if row is None else int(row[0])
            if held > index:
                return False
            if held < index:
                raise ConfigurationError(
                    f"entry {index} of key event {event_id!r}'s history comes after entry "
                    f"{held}, which is missing; import the entries in order"
                )
            if self._seal.encryption is None:
                return await db.run("import_history", values) > 0
            # sealed bound to its seq, which the insert gives
            inserted = await db.one("import_history_seq", (*values[:3], "", *values[4:]))
            if inserted is None:
                return False
            where = (event_id, inserted[0])
            sealed = self._seal.seal(values[3], "history", where, "changes")
            await db.run("reseal_history", (sealed, inserted[0]))
            return True

        return await self._atomic(body)

    async def import_job(self, job: ExtractionJob) -> bool:
        """Insert ``job`` as exported (status, attempts, lease, ops and result kept);
        False, changing nothing, when a job of that id exists."""

        def moment(value: datetime | None) -> Any:
            return None if value is None else self._enc(value)

        values = (
            job.id,
            job.session_id,
            job.owner,
            job.agent_ref,
            job.transcript_ref,
            job.status,
            job.attempts,
            job.max_attempts,
            self._enc(job.next_attempt_at),
            self._enc(job.created_at),
            self._enc(job.updated_at),
            job.lease_owner,
            job.lease_token,
            moment(job.lease_expires_at),
            job.last_error,
            self._seal.seal_job(job.id, "ops", None if job.ops is None else ops_json(job.ops)),
            self._seal.seal_job(
                job.id, "result", None if job.result is None else dumps(job.result, "result")
            ),
        )

        async def body(db: Db) -> bool:
            return await db.run("import_job", values) > 0

        return await self._atomic(body)

    async def list_jobs(
        self, *, status: JobStatus | None = None, limit: int = 100, offset: int = 0
    ) -> list[ExtractionJob]:
        """Jobs, most recently changed first; ``status="failed"`` shows what needs a look."""
        rows = await self._read("list_jobs", (status, status, max(limit, 0), max(offset, 0)))
        return [self._job_of(row) for row in rows]

    async def count_jobs(self) -> dict[str, int]:
        """How many jobs there are of each status (statuses with none left out)."""
        rows = await self._read("job_counts", ())
        return {str(status): int(count) for status, count in rows}

    # -- per-agent memory settings (the memory panel's) ----------------------------------

    async def save_memory_config(
        self, agent_ref: str, config: MemoryConfig, *, actor: str = "api"
    ) -> None:
        """Save ``agent_ref``'s settings, replacing any saved before, and record the change
        (before, after, the store's time, ``actor``) in the same transaction; settings
        equal to the saved ones change and record nothing (saved ones this touba cannot
        read are replaced, recorded as ``before`` None). Every ``ChatSession`` of that
        agent reads them at the start of its next turn. ``ConfigurationError`` (nothing
        written) for an empty ``agent_ref``, a ``config`` that is not a ``MemoryConfig``
        or a bad ``actor``."""
        _check_agent(agent_ref)
        if not isinstance(config, MemoryConfig):
            raise ConfigurationError("config must be a touba.MemoryConfig")
        check_actor(actor)
        encoded = dumps(config_to_data(config))

        async def body(db: Db) -> None:
            now = self._enc(self.now())
            while True:
                if await db.run("insert_config", (agent_ref, encoded, now, actor)):
                    before = None
                    break
                row = await db.one("config_locked", (agent_ref,))
                if row is not None:
                    before = _readable(row[0])
                    if before == encoded:
                        return
                    await db.run("update_config", (encoded, now, actor, agent_ref))
                    break
                # deleted by a reset committed meanwhile: insert again
            await db.run("insert_change", (agent_ref, before, encoded, now, actor))

        await self._atomic(body)

    async def reset_memory_config(self, agent_ref: str, *, actor: str = "api") -> bool:
        """Delete ``agent_ref``'s saved settings and record the change (``after`` None) in
        the same transaction: the program's settings apply again from the next turn.
        False, with nothing recorded, when none were saved. ``ConfigurationError``
        (nothing written) for an empty ``agent_ref`` or a bad ``actor``."""
        _check_agent(agent_ref)
        check_actor(actor)

        async def body(db: Db) -> bool:
            row = await db.one("delete_config", (agent_ref,))
            if row is None:
                return False
            now = self._enc(self.now())
            await db.run("insert_change", (agent_ref, row[0], None, now, actor))
            return True

        return await self._atomic(body)

    async def load_memory_config(self, agent_ref: str) -> MemoryConfig | None:
        """``agent_ref``'s saved settings, or None. Saved settings this touba cannot
        read raise ``MemoryStoreUnavailable`` (save them again to repair)."""
        saved = await self.load_saved_memory_config(agent_ref)
        return None if saved is None else saved.config

    async def load_saved_memory_config(self, agent_ref: str) -> SavedMemoryConfig | None:
        """``agent_ref``'s saved settings with when and by whom they were saved, or None.
        Saved settings this touba cannot read raise ``MemoryStoreUnavailable``."""
        rows = await self._read("load_config", (agent_ref,))
        if not rows:
            return None
        text, saved_at, saved_by = rows[0]
        what = f"the saved memory settings of agent {agent_ref!r}"
        config = config_from_text(text, what, "save them again (touba panel)")
        return SavedMemoryConfig(config, self._dec(saved_at), saved_by)

    async def memory_config_history(
        self, agent_ref: str, *, limit: int = 50
    ) -> list[MemoryConfigChange]:
        """The last ``limit`` changes of ``agent_ref``'s saved settings, newest first
        (in the order they were made, even when clock readings tie)."""
        rows = await self._read("config_changes", (agent_ref, max(limit, 0)))
        return [change_from_row(row, self._dec) for row in rows]

    # -- operator reads (the memory panel's lists: counts and pages) ---------------------

    async def count_sessions(
        self, *, owner: str | None = None, mode: SessionMode | None = None
    ) -> int:
        """How many sessions there are (of one owner, or of all; of one mode, or of both)."""
        rows = await self._read("count_sessions", (owner, owner, *_mode_filter(mode)))
        return int(rows[0][0])

    async def count_owners(self, *, mode: SessionMode | None = None) -> int:
        """How many owners have at least one session (of ``mode``, when given)."""
        rows = await self._read("count_owners", _mode_filter(mode))
        return int(rows[0][0])

    async def list_owners(
        self, *, limit: int = 50, offset: int = 0, mode: SessionMode | None = None
    ) -> list[OwnerSummary]:
        """Owners of sessions, the one with the newest session first, with their counts.

        With ``mode`` (``"live"`` or ``"preview"``) only sessions of that mode count:
        an owner with none is left out, and its session counts are of that mode
        alone (its key-event counts are all of its events)."""
        filters = _mode_filter(mode)

        async def body(db: Db) -> list[OwnerSummary]:
            found = await db.all("owners", (*filters, max(limit, 0), max(offset, 0)))
            out = []
            for owner, sessions, turns, last, previews in found:
                counted = await db.one("owner_events", (owner,))
                events, open_events = counted if counted is not None else (0, 0)
                out.append(
                    OwnerSummary(
                        owner,
                        int(sessions),
                        int(turns or 0),
                        self._dec(last),
                        int(previews or 0),
                        int(events or 0),
                        int(open_events or 0),
                    )
                )
            return out

        return await self._atomic(body, write=False)

    async def list_event_owners(self, *, limit: int = 500, offset: int = 0) -> list[str]:
        """Every owner of at least one key event (with a session or not), in order,
        from ``offset``: what a copy of the whole store walks. Reads only."""
        rows = await self._read("event_owners", (max(limit, 0), max(offset, 0)))
        return [str(row[0]) for row in rows]

    async def list_turns(
        self, session_id: str, *, limit: int = 50, offset: int = 0, newest_first: bool = False
    ) -> tuple[StoredTurn, ...]:
        """Turns ``offset`` .. ``offset + limit - 1`` of a session, oldest first (with
        ``newest_first``, counted from the last turn, the last one first)."""
        name = "turns_page_newest" if newest_first else "turns_page"
        rows = await self._read(name, (session_id, max(limit, 0), max(offset, 0)))
        return tuple(self._turn_of(row) for row in rows)

    # -- encryption at rest: key rotation ------------------------------------------------

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with the current key up to ``batch`` rows (turns, key events, update
        history rows, extraction jobs) holding a value sealed with another key, in one
        transaction; how many rows were re-sealed (0: none is left, rotation is done).

        Resumable: call it until it returns 0; an interrupted call changed nothing or
        committed its whole batch. Rows sealed with an older key stay readable meanwhile
        (keep that key in the ``Encryption`` until then). The store remembers where its
        last call stopped in each table (in key order), so a rotation reads each row
        about once; it returns 0 only after a pass from the start found nothing, which
        also catches rows another process sealed with the older key meanwhile.
        ``ConfigurationError`` without ``encryption=`` or for a ``batch`` under 1;
        ``DecisionHistoryRecordInvalid`` (nothing changed) for a value that does not
        open: repair or erase that row.
        """
        encryption = self._seal.encryption
        if encryption is None:
            raise ConfigurationError("rekey needs a store opened with encryption=")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigurationError(f"batch must be an int >= 1, got {batch!r}")
        prefix = f"{TOKEN_PREFIX}{encryption.current}."
        stale = (len(prefix), prefix)
        seal = self._seal
        start: dict[str, Any] = dict(getattr(self, "_rekey_cursors", {}))

        def again(value: Any, table: str, where: tuple[Any, ...], field: str) -> Any:
            if value is None:
                return None
            return seal.seal(seal.open(value, table, where, field), table, where, field)

        async def turns(db: Db, after: Any, room: int) -> tuple[int, Any]:
            session_id, idx = after if after is not None else (None, None)
            params = (session_id, session_id, idx, *stale * 4, room)
            last, found = after, await db.all("stale_turns", params)
            for session_id, idx, *values in found:
                fields = ("user_text", "replies", "trace", "context")
                where = (session_id, idx)
                new = [again(v, "turns", where, f) for v, f in zip(values, fields, strict=True)]
                await db.run("reseal_turn", (*new, session_id, idx))
                last = where
            return len(found), last

        async def events(db: Db, after: Any, room: int) -> tuple[int, Any]:
            last, found = after, await db.all("stale_events", (after, after, *stale * 2, room))
            for event_id, owner, title, details in found:
                where = (owner, event_id)
                title = again(title, "events", where, "title")
                details = again(details, "events", where, "details")
                await db.run("reseal_event", (title, details, event_id))
                last = event_id
            return len(found), last

        async def history(db: Db, after: Any, room: int) -> tuple[int, Any]:
            last, found = after, await db.all("stale_history", (after, after, *stale, room))
            for seq, event_id, changes in found:
                value = again(changes, "history", (event_id, seq), "changes")
                await db.run("reseal_history", (value, seq))
                last = seq
            return len(found), last

        async def jobs(db: Db, after: Any, room: int) -> tuple[int, Any]:
            last, found = after, await db.all("stale_jobs", (after, after, *stale * 2, room))
            for job_id, ops, result in found:
                ops = again(ops, "jobs", (job_id,), "ops")
                result = again(result, "jobs", (job_id,), "result")
                await db.run("reseal_job", (ops, result, job_id))
                last = job_id
            return len(found), last

        tables = {"turns": turns, "events": events, "history": history, "jobs": jobs}

        async def body(db: Db) -> tuple[int, dict[str, Any]]:
            cursors, done = dict(start), 0
            from_start = not cursors
            while True:
                for name, step in tables.items():
                    if cursors.get(name) is _DONE:
                        continue
                    count, last = await step(db, cursors.get(name), batch - done)
                    done += count
                    if done >= batch:
                        cursors[name] = last
                        return done, cursors
                    cursors[name] = _DONE  # fewer than asked: none left after the cursor
                if done or from_start:
                    return done, {}
                cursors, from_start = {}, True  # a last pass from the start

        done, self._rekey_cursors = await self._atomic(body)
        return done


def _ids(name: str, values: object) -> tuple[str, ...]:
    """A collection of ids (not one str), each a str; ``ConfigurationError`` otherwise."""
    if isinstance(values, str | bytes) or not isinstance(values, Collection):
        raise ConfigurationError(f"{name} must be a collection of str ids, not one str")
    if not all(isinstance(v, str) for v in values):
        raise ConfigurationError(f"{name} must hold str ids only")
    return tuple(dict.fromkeys(values))


def _check_turn(name: str, value: object, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ConfigurationError(
            f"{name} must be an int of at least {lowest} (a turn number), got {value!r}"
        )


def _check_range(name: str, value: int, lowest: int, meta: SessionMeta) -> None:
    if value > meta.turns:
        raise ConfigurationError(
            f"{name}={value} is out of range: chat session {meta.session_id!r} holds "
            f"{meta.turns} turn(s), so {name} goes from {lowest} to {meta.turns}. "
            "Nothing was written"
        )


def _check_agent(agent_ref: object) -> None:
    if not isinstance(agent_ref, str) or not agent_ref:
        raise ConfigurationError(f"agent_ref must be a non-empty str, got {agent_ref!r}")


def _readable(stored: str) -> str | None:
    """Saved settings in the canonical form of ``encoded``, or None when this touba cannot
    read them (a save repairs them; its change records ``before`` as None, so that the
    history stays readable)."""
    try:
        config = config_from_text(stored, "saved memory settings", "")
    except MemoryStoreUnavailable:
        return None
    return dumps(config_to_data(config))


def _mode_filter(mode: object) -> tuple[str | None, str | None]:
    """The two parameters of the optional session-mode filter (None: every mode)."""
    if mode is not None:
        check_mode(mode)
    value = None if mode is None else str(mode)
    return value, value


def _event_filters(
    type: object, status: object, text: object, include_closed: object
) -> tuple[object, ...]:
    """The parameters of the key-event filters, each checked (``ConfigurationError``)."""
    for name, value in (("type", type), ("text", text)):
        if value is not None and not isinstance(value, str):
            raise ConfigurationError(f"{name} must be a str or None, got {value!r}")
        if isinstance(value, str) and "\x00" in value:
            raise ConfigurationError(f"{name} must not contain a NUL character")
    if status is not None and status not in KEY_EVENT_STATUSES:
        raise ConfigurationError(
            f"status must be one of {', '.join(KEY_EVENT_STATUSES)} or None, got {status!r}"
        )
    return (type, type, status, status, bool(include_closed), text, text, text)
