"""The chat memory storage contract (SPEC sections 8 and 9) and its small shared helpers.

A ``MemoryStore`` keeps three things: each session's turns (with its
``SessionMeta``), key events with their update history, and extraction jobs.
Every method is one atomic step. Stores hold no business rules beyond
atomicity: validation of what the model sent lives in ``KeyEventService``,
the retry policy in ``ExtractionQueue``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

from touba.errors import ConfigurationError, ExtractionLeaseLost
from touba.history._model import JSON
from touba.memory._config import MemoryConfig
from touba.memory._model import (
    EffectiveMemoryConfig,
    ExtractedOp,
    ExtractionJob,
    JobStatus,
    KeyEvent,
    KeyEventActor,
    KeyEventStatus,
    MemoryConfigChange,
    SavedMemoryConfig,
    SessionMeta,
    SessionMode,
    StoredTurn,
)
from touba.providers._types import TraceCall

__all__ = [
    "Clock",
    "MemoryConfigStore",
    "MemoryStore",
    "check_clock",
    "check_mode",
    "check_op_owner",
    "check_actor",
    "check_reopen",
    "ended",
    "job_id_for",
    "lease_lost",
    "new_event_id",
    "requeued_job",
    "resolve_memory_config",
    "resolve_memory_settings",
    "unknown_session",
    "utc_now",
]

Clock = Callable[[], datetime]


@runtime_checkable
class MemoryStore(Protocol):
    """Turns per session, key events and extraction jobs; ``close()`` or ``async with``.

    Every method is one atomic step and raises ``MemoryStoreUnavailable`` (the driver's
    error chained, nothing written) when the store fails, stays locked or holds data this
    touba cannot read; a misuse (an unknown or ended session, a foreign ``op_id``) is a
    ``ConfigurationError``, as each method says.
    """

    def now(self) -> datetime:
        """The store's clock (aware): it stamps writes and decides leases and retries."""

    async def open_session(
        self, session_id: str, *, owner: str, agent_ref: str, mode: SessionMode
    ) -> SessionMeta:
        """Create a session, or return it when owner, agent and mode match; another
        owner, agent or mode is a ``ConfigurationError``."""

    async def get_session(self, session_id: str) -> SessionMeta | None:
        """The session, or None."""

    async def end_session(self, session_id: str) -> SessionMeta:
        """Mark a session ended (the first end time stays); no turn is added after.
        ``ConfigurationError`` for a session never opened."""

    async def list_sessions(
        self, *, owner: str | None = None, limit: int = 100
    ) -> list[SessionMeta]:
        """Sessions, newest first, of one owner or of all."""

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session and its turns (True if it existed); key events and jobs stay."""

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
        """Add the next turn of an open session; the store numbers it. ``context``: what
        the turn's invocation was given (a JSON object of sizes, ids and settings, never
        content), kept as the turn's ``context``. ``ConfigurationError`` for a session
        never opened or already ended, or a ``context`` that is not a JSON object
        (nothing written)."""

    async def recent_turns(self, session_id: str, limit: int) -> tuple[StoredTurn, ...]:
        """The last ``limit`` turns, oldest first (none for an unknown session)."""

    async def fork_session(
        self, session_id: str, new_session_id: str, *, at_turn: int, owner: str
    ) -> SessionMeta:
        """Copy turns 1 .. ``at_turn`` (each whole: text, replies, trace, context) into a
        new open session of ``owner`` with the original's agent and mode, atomically;
        the original is unchanged, key events are not copied. ``ConfigurationError``
        (nothing written) for an unknown session, an ``at_turn`` out of 1 .. its turn
        count, or a ``new_session_id`` already used."""

    async def rewind_session(self, session_id: str, *, to_turn: int) -> int:
        """Delete the turns after ``to_turn`` of an open session (each whole),
        atomically; return how many went. ``ConfigurationError`` (nothing changed) for
        an unknown or ended session or a ``to_turn`` out of 0 .. its turn count."""

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
        """Insert an open event; an ``op_id`` seen before returns that event
        (``ConfigurationError`` when it was another owner's)."""

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
        """Apply real changes and record them (made by ``actor``, ``"model"`` or
        ``"operator"``, else ``ConfigurationError``); an ``op_id`` seen before changes
        nothing; None if the id is not the owner's."""

    async def get_event(self, owner: str, event_id: str) -> KeyEvent | None:
        """The event with its history; None if the id is not the owner's."""

    async def query_events(
        self,
        owner: str,
        *,
        type: str | None = None,
        status: KeyEventStatus | None = None,
        text: str | None = None,
        include_closed: bool = False,
        limit: int = 20,
    ) -> list[KeyEvent]:
        """The owner's events by ``touched`` (latest write first), history not loaded."""

    async def enqueue_job(
        self, *, session_id: str, owner: str, agent_ref: str, transcript_ref: str, max_attempts: int
    ) -> tuple[ExtractionJob, bool]:
        """Queue one session end's job (same end, same job); True if new."""

    async def claim_job(
        self, worker_id: str, lease_seconds: float, *, job_id: str | None = None
    ) -> ExtractionJob | None:
        """Lease the next due job, or a job whose lease expired (only ``job_id`` if
        given); None if none."""

    async def record_job_ops(
        self, job_id: str, lease_token: str, ops: Sequence[ExtractedOp]
    ) -> tuple[ExtractedOp, ...]:
        """Record a leased job's ops once; return the recorded ones (the first ops win).
        ``ExtractionLeaseLost`` if ``lease_token`` no longer holds the job."""

    async def complete_job(self, job_id: str, lease_token: str, result: JSON) -> ExtractionJob:
        """Mark a leased job done, with no error left from earlier attempts
        (``ExtractionLeaseLost`` if not leased)."""

    async def fail_job(
        self, job_id: str, lease_token: str, error: str, retry_at: datetime | None
    ) -> ExtractionJob:
        """Pending again at ``retry_at``; failed when None or out of attempts.
        ``ExtractionLeaseLost`` if ``lease_token`` no longer holds the job."""

    async def requeue_job(self, job_id: str) -> ExtractionJob:
        """Make a failed job pending with fresh attempts; ``ConfigurationError`` for an
        unknown job or one that is not ``failed``."""

    async def get_job(self, job_id: str) -> ExtractionJob | None:
        """The job, or None."""

    async def list_jobs(
        self, *, status: JobStatus | None = None, limit: int = 100
    ) -> list[ExtractionJob]:
        """Jobs, most recently changed first, optionally of one status."""

    async def close(self) -> None:
        """Let running calls finish, then release connections (idempotent)."""


@runtime_checkable
class MemoryConfigStore(Protocol):
    """A store that keeps per-agent memory settings and their history (the built-in
    ones do).

    The memory panel saves them; every :class:`~touba.ChatSession` and
    extraction worker reads them, and saved settings win over the program's.
    Every change (a save that changes something, a reset) is recorded with its
    time and actor in the same transaction. ``actor`` is a non-empty printable str
    of at most 64 characters (``"operator"`` from the panel, ``"cli"`` from the
    command line); anything else is a ``ConfigurationError`` and nothing is written.
    """

    async def save_memory_config(
        self, agent_ref: str, config: MemoryConfig, *, actor: str = "api"
    ) -> None:
        """Save ``agent_ref``'s settings (replacing any saved before) and record the
        change, atomically; settings equal to the saved ones change and record nothing."""

    async def reset_memory_config(self, agent_ref: str, *, actor: str = "api") -> bool:
        """Delete ``agent_ref``'s saved settings (the program's apply again) and record
        the change; False, with nothing recorded, when none were saved."""

    async def load_memory_config(self, agent_ref: str) -> MemoryConfig | None:
        """``agent_ref``'s saved settings, or None when none were saved."""

    async def load_saved_memory_config(self, agent_ref: str) -> SavedMemoryConfig | None:
        """``agent_ref``'s saved settings with when and by whom, or None."""

    async def memory_config_history(
        self, agent_ref: str, *, limit: int = 50
    ) -> list[MemoryConfigChange]:
        """The last ``limit`` changes of ``agent_ref``'s saved settings, newest first."""


@runtime_checkable
class _LoadsMemoryConfig(Protocol):
    """A store of settings written before their history was recorded: it loads them only."""

    async def load_memory_config(self, agent_ref: str) -> MemoryConfig | None: ...


# -- shared pieces -----------------------------------------------------------------------


async def resolve_memory_settings(
    store: object, agent_ref: str, program_config: MemoryConfig | None
) -> EffectiveMemoryConfig:
    """The settings an agent runs with now and where they come from: those saved in
    ``store`` (the panel's) when there are any, else the program's ``MemoryConfig``,
    else the defaults. One read of the store (none when it keeps no settings)."""
    if isinstance(store, MemoryConfigStore):
        saved = await store.load_saved_memory_config(agent_ref)
        if saved is not None:
            return EffectiveMemoryConfig(saved.config, "saved", saved.saved_at, saved.saved_by)
    elif isinstance(store, _LoadsMemoryConfig):  # a store of the user's, written before
        config = await store.load_memory_config(agent_ref)  # settings had a history
        if config is not None:
            return EffectiveMemoryConfig(config, "saved")
    if program_config is not None:
        return EffectiveMemoryConfig(program_config, "program")
    return EffectiveMemoryConfig(MemoryConfig(), "defaults")


async def resolve_memory_config(
    store: object, agent_ref: str, program_config: MemoryConfig | None
) -> MemoryConfig:
    """The settings an agent runs with now (:func:`resolve_memory_settings`' config)."""
    return (await resolve_memory_settings(store, agent_ref, program_config)).config


MAX_ACTOR_CHARS = 64


def check_actor(actor: object) -> str:
    """Who changes memory settings: a non-empty printable str of at most 64 characters."""
    if (
        not isinstance(actor, str)
        or not actor
        or len(actor) > MAX_ACTOR_CHARS
        or not actor.isprintable()
    ):
        raise ConfigurationError(
            f"actor must be a non-empty printable str of at most {MAX_ACTOR_CHARS} characters "
            f"(such as 'operator'), got {actor!r:.80}; nothing was saved"
        )
    return actor


def utc_now() -> datetime:
    return datetime.now(UTC)


def check_clock(clock: Clock) -> datetime:
    """The clock's time, refusing a naive datetime."""
    now = clock()
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigurationError(f"clock must return a timezone-aware datetime, got {now!r}")
    return now


def new_event_id() -> str:
    return "ke_" + secrets.token_hex(8)


def job_id_for(session_id: str, transcript_ref: str) -> str:
    """One job per session end: the same session and transcript give the same id."""
    digest = hashlib.sha256(f"{session_id}\x00{transcript_ref}".encode()).hexdigest()
    return "xj_" + digest[:24]


def unknown_session(session_id: str) -> ConfigurationError:
    return ConfigurationError(
        f"chat session {session_id!r} was never opened in this store; call open_session first"
    )


def ended(session_id: str) -> ConfigurationError:
    return ConfigurationError(
        f"chat session {session_id!r} has ended; start a new session to add turns"
    )


def lease_lost(job_id: str) -> ExtractionLeaseLost:
    return ExtractionLeaseLost(
        f"extraction job {job_id} is no longer leased to this worker (its lease expired and "
        "it was claimed again, or it finished); nothing was changed",
        job_id=job_id,
    )


def requeued_job(job_id: str, job: ExtractionJob | None, requeued: int) -> ExtractionJob:
    """The job ``requeue_job`` made pending again, or the error saying why it could not."""
    if job is None:
        raise ConfigurationError(f"there is no extraction job {job_id!r}")
    if not requeued:
        raise ConfigurationError(f"only a failed job can be requeued; job {job_id} is {job.status}")
    return job


def check_mode(mode: object) -> None:
    if mode not in ("live", "preview"):
        raise ConfigurationError(f"mode must be 'live' or 'preview', got {mode!r}")


def check_op_owner(event: KeyEvent, owner: str, op_id: str) -> KeyEvent:
    """The event an op id already made, only to its own owner."""
    if event.owner != owner:
        raise ConfigurationError(f"op_id {op_id!r} was already used for another owner")
    return event


def check_reopen(found: SessionMeta, owner: str, agent_ref: str, mode: str) -> SessionMeta:
    """An existing session may only be reopened with the same owner, agent and mode.

    The ``ConfigurationError`` names which of them differ, with the session's agent
    and mode; never its owner (a user id the caller did not give).
    """
    differ = []
    if found.owner != owner:
        differ.append("owner")
    if found.agent_ref != agent_ref:
        differ.append(f"agent (it is agent {found.agent_ref!r}'s, not {agent_ref!r})")
    if found.mode != mode:
        differ.append(f"mode (it is a {found.mode} session, not {mode})")
    if differ:
        raise ConfigurationError(
            f"chat session {found.session_id!r} already exists with another "
            + ", another ".join(differ)
            + "; reopen it as it was opened, or use a new session_id"
        )
    return found
