"""The logic of the SQL memory stores, written once over a three-method connection.

``SqlMemoryStore`` implements every ``MemoryStore`` operation as one
transaction of the statements of :mod:`touba.memory._rows`. A backend
supplies the transaction (``_atomic``), the statements compiled for its
dialect, and its timestamp codec. Key events are ordered by ``touched``, a
per-owner write counter, so "most recently updated" follows the order of
writes even when clock readings tie.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

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

__all__ = ["Db", "SqlMemoryStore"]

R = TypeVar("R")


class Db(Protocol):
    """One open transaction of a backend, running statements by name."""

    async def one(self, name: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def all(self, name: str, params: Sequence[Any] = ()) -> list[Row]: ...

    async def run(self, name: str, params: Sequence[Any] = ()) -> int: ...


class SqlMemoryStore(ABC):
    """Every ``MemoryStore`` operation, each one atomic; a backend provides the rest."""

    _clock: Clock

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
        return job_from_row(row, self._dec)

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
            await db.run("insert_turn", values)
            return turn_from_row(values, self._dec)

        return await self._atomic(body)

    async def recent_turns(self, session_id: str, limit: int) -> tuple[StoredTurn, ...]:
        """The last ``limit`` turns, oldest first (none for an unknown session)."""
        rows = await self._read("recent_turns", (session_id, max(limit, 0)))
        return tuple(turn_from_row(row, self._dec) for row in reversed(rows))

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
                    return check_op_owner(event_from_row(row, self._dec), owner, op_id)
                values = (new_event_id(), owner, type, title, details, now, now, session_id)
                if await db.run("insert_event", (*values, owner, op_id)):
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
            event = event_from_row(row, self._dec)
            if op_id is not None and await db.one("op_applied", (op_id,)):
                return event
            diff = diff_fields(event, changes)
            if not diff:
                return event
            new: dict[str, Any] = {change.field: change.new for change in diff}
            now = self.now()
            fields = [
                new.get(name, getattr(event, name)) for name in ("status", "title", "details")
            ]
            await db.run("update_event", (*fields, self._enc(now), owner, event_id))
            history = (event_id, self._enc(now), session_id, changes_json(diff), op_id, actor)
            await db.run("insert_history", history)
            row = await db.one("event", (event_id, owner))
            assert row is not None
            return event_from_row(row, self._dec)

        return await self._atomic(body)

    async def get_event(self, owner: str, event_id: str) -> KeyEvent | None:
        """The event with its update history, oldest first; None for another owner's id."""

        async def body(db: Db) -> KeyEvent | None:
            row = await db.one("event", (event_id, owner))
            if row is None:
                return None
            history = await db.all("history", (event_id,))
            updates = tuple(update_from_row(h, self._dec) for h in history)
            return event_from_row(row, self._dec, updates)

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
        ``offset``."""
        filters = (owner, *_event_filters(type, status, text, include_closed))
        rows = await self._read("query_events", (*filters, max(limit, 0), max(offset, 0)))
        return [event_from_row(row, self._dec) for row in rows]

    async def count_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int:
        """How many events ``query_events`` would find with these filters and no limit."""
        filters = (owner, *_event_filters(type, status, text, include_closed))
        rows = await self._read("count_events", filters)
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
        character in one, is a ``ConfigurationError``.
        """
        filters = _event_filters(type, status, text, include_closed)
        rows = await self._read("query_all_events", (*filters, max(limit, 0), max(offset, 0)))
        return [event_from_row(row, self._dec) for row in rows]

    async def count_all_events(
        self,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
    ) -> int:
        """How many events ``query_all_events`` would find with these filters and no limit."""
        rows = await self._read(
            "count_all_events", _event_filters(type, status, text, include_closed)
        )
        return int(rows[0][0])

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
            await change(db, job_from_row(row, self._dec))
            return await self._job(db, job_id)

        return await self._atomic(body)

    async def record_job_ops(
        self, job_id: str, lease_token: str, ops: Sequence[ExtractedOp]
    ) -> tuple[ExtractedOp, ...]:
        """Record the extracted ops once; return the recorded ones (the first run's)."""
        encoded = ops_json(ops)

        async def change(db: Db, job: ExtractionJob) -> None:
            await db.run("set_ops", (encoded, self._enc(self.now()), job_id))

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
            values = (status, encoded, self._enc(next_at), message, now, job_id)
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
            return requeued_job(
                job_id, None if row is None else job_from_row(row, self._dec), requeued
            )

        return await self._atomic(body)

    async def get_job(self, job_id: str) -> ExtractionJob | None:
        """The job, or None (``MemoryStore.get_job``)."""
        rows = await self._read("job", (job_id,))
        return job_from_row(rows[0], self._dec) if rows else None

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
            return await db.run("import_turn", values) > 0

        return await self._atomic(body)

    async def import_event(self, event: KeyEvent) -> bool:
        """Insert ``event`` (its history apart: :meth:`import_event_change`) keeping its
        id, status and times, ordered before its owner's other events; False, changing
        nothing, when an event of that id exists."""
        if event.status not in KEY_EVENT_STATUSES:
            raise ConfigurationError(f"status must be one of {', '.join(KEY_EVENT_STATUSES)}")
        values = (
            event.id,
            event.owner,
            event.type,
            event.title,
            event.status,
            event.details,
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
            return await db.run("import_history", values) > 0

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
            None if job.ops is None else ops_json(job.ops),
            None if job.result is None else dumps(job.result, "result"),
        )

        async def body(db: Db) -> bool:
            return await db.run("import_job", values) > 0

        return await self._atomic(body)

    async def list_jobs(
        self, *, status: JobStatus | None = None, limit: int = 100, offset: int = 0
    ) -> list[ExtractionJob]:
        """Jobs, most recently changed first; ``status="failed"`` shows what needs a look."""
        rows = await self._read("list_jobs", (status, status, max(limit, 0), max(offset, 0)))
        return [job_from_row(row, self._dec) for row in rows]

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
        return tuple(turn_from_row(row, self._dec) for row in rows)


def _ids(name: str, values: object) -> tuple[str, ...]:
    """A collection of ids (not one str), each a str; ``ConfigurationError`` otherwise."""
    if isinstance(values, str | bytes) or not isinstance(values, Collection):
        raise ConfigurationError(f"{name} must be a collection of str ids, not one str")
    if not all(isinstance(v, str) for v in values):
        raise ConfigurationError(f"{name} must hold str ids only")
    return tuple(dict.fromkeys(values))


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
