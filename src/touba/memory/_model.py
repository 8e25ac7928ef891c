"""The records of chat memory and key events (SPEC sections 8 and 9), as plain data.

Every timestamp is timezone-aware (UTC when read back from a store). A
``KeyEvent`` read by ``get`` carries its update history; one returned by a
query or a write carries ``history=None`` (not loaded), never a fake empty one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeAlias

from touba.history._model import JSON
from touba.memory._config import MemoryConfig
from touba.providers._types import TraceCall, Turn

__all__ = [
    "KEY_EVENT_ACTORS",
    "KEY_EVENT_STATUSES",
    "CreateEventOp",
    "EffectiveMemoryConfig",
    "ExtractedOp",
    "ExtractionJob",
    "FieldChange",
    "JobStatus",
    "KeyEvent",
    "KeyEventActor",
    "KeyEventStatus",
    "KeyEventUpdate",
    "MemoryConfigChange",
    "MemoryConfigSource",
    "OwnerSummary",
    "SavedMemoryConfig",
    "SessionMeta",
    "SessionMode",
    "StoredTurn",
    "UpdateEventOp",
    "diff_fields",
    "op_from_dict",
    "op_to_dict",
    "trace_from_data",
    "trace_to_data",
]

SessionMode = Literal["live", "preview"]
KeyEventStatus = Literal["open", "in_progress", "closed"]
KEY_EVENT_STATUSES: tuple[KeyEventStatus, ...] = ("open", "in_progress", "closed")
JobStatus = Literal["pending", "running", "done", "failed"]
KeyEventActor = Literal["model", "operator"]
KEY_EVENT_ACTORS: tuple[KeyEventActor, ...] = ("model", "operator")
EventField = Literal["status", "title", "details"]
MemoryConfigSource = Literal["saved", "program", "defaults"]


@dataclass(frozen=True, slots=True)
class SessionMeta:
    """One chat session: whose it is, which agent, live or preview, and its turn count."""

    session_id: str
    owner: str
    agent_ref: str
    mode: SessionMode
    created_at: datetime
    ended_at: datetime | None = None
    turns: int = 0


@dataclass(frozen=True, slots=True)
class OwnerSummary:
    """One owner of sessions, as the memory panel lists them (counts, never content)."""

    owner: str
    sessions: int
    turns: int
    last_session_at: datetime
    preview_sessions: int
    events: int
    open_events: int


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """A stored chat turn: the user message, every reply, the tool trace by decision."""

    session_id: str
    index: int
    user: str
    replies: tuple[str, ...]
    trace: tuple[tuple[TraceCall, ...], ...]
    invocation_id: str | None
    created_at: datetime
    context: Mapping[str, JSON] | None = None
    """What the turn's invocation was given (sizes, ids and settings, never content),
    as its caller recorded it; None for turns stored without one (and older ones)."""

    def as_turn(self, *, with_trace: bool) -> Turn:
        """The turn as providers take it, with or without its whole trace."""
        return Turn(self.user, self.replies, self.trace if with_trace else ())


@dataclass(frozen=True, slots=True)
class SavedMemoryConfig:
    """An agent's memory settings as saved in a store (by the memory panel or an API
    call), with when and by whom they were last saved."""

    config: MemoryConfig
    saved_at: datetime
    saved_by: str


@dataclass(frozen=True, slots=True)
class MemoryConfigChange:
    """One change of an agent's saved memory settings.

    ``before`` is None when none were saved (the program's were in effect),
    ``after`` None when a reset deleted them. ``actor``: who made it
    (``"operator"`` from the panel, ``"cli"`` from ``touba agents settings``, the
    API caller's name, ``"api"`` by default; ``"unknown"`` for settings saved
    before touba kept this history).
    """

    agent_ref: str
    before: MemoryConfig | None
    after: MemoryConfig | None
    at: datetime
    actor: str


@dataclass(frozen=True, slots=True)
class EffectiveMemoryConfig:
    """The settings an agent runs with now, and where they come from.

    ``source``: ``"saved"`` (saved in the store, at ``saved_at`` by ``saved_by``),
    ``"program"`` (the ``MemoryConfig`` the program gave the agent) or
    ``"defaults"`` (neither: ``MemoryConfig()``); ``saved_at`` and ``saved_by`` are
    None unless saved.
    """

    config: MemoryConfig
    source: MemoryConfigSource
    saved_at: datetime | None = None
    saved_by: str | None = None


@dataclass(frozen=True, slots=True)
class FieldChange:
    """One field an update changed, with its old and new values."""

    field: EventField
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class KeyEventUpdate:
    """One entry of an event's update history: what changed, when, in which session.

    ``actor``: ``"model"`` (a tool call or an extraction, in session
    ``session_id``) or ``"operator"`` (an edit in the memory panel, whose
    ``session_id`` is ``"panel"``).
    """

    at: datetime
    session_id: str
    changes: tuple[FieldChange, ...]
    op_id: str | None = None
    actor: KeyEventActor = "model"


@dataclass(frozen=True, slots=True)
class KeyEvent:
    """A long-term, ticket-like record of one owner (``user:<id>`` or ``session:<id>``).

    ``session_id`` is the session that created it; ``history`` its updates,
    oldest first (``None`` when not loaded).
    """

    id: str
    owner: str
    type: str
    title: str
    status: KeyEventStatus
    details: str
    created_at: datetime
    updated_at: datetime
    session_id: str
    history: tuple[KeyEventUpdate, ...] | None = None


def diff_fields(event: KeyEvent, changes: Mapping[str, str]) -> tuple[FieldChange, ...]:
    """The changes that really alter ``event``, in a fixed field order."""
    out: list[FieldChange] = []
    for name in ("status", "title", "details"):
        new = changes.get(name)
        old = getattr(event, name)
        if new is not None and new != old:
            out.append(FieldChange(name, old, new))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CreateEventOp:
    """An extracted creation (validated like the ``create_key_event`` tool)."""

    type: str
    title: str
    details: str = ""
    kind: Literal["create"] = "create"


@dataclass(frozen=True, slots=True)
class UpdateEventOp:
    """An extracted update (validated like the ``update_key_event`` tool)."""

    event_id: str
    status: KeyEventStatus | None = None
    title: str | None = None
    details: str | None = None
    kind: Literal["update"] = "update"


ExtractedOp: TypeAlias = CreateEventOp | UpdateEventOp
_CREATE_FIELDS = {"type", "title", "details"}
_UPDATE_FIELDS = {"event_id", "status", "title", "details"}


def op_to_dict(op: ExtractedOp) -> dict[str, Any]:
    if isinstance(op, CreateEventOp):
        return {"kind": "create", "type": op.type, "title": op.title, "details": op.details}
    fields = {"status": op.status, "title": op.title, "details": op.details}
    return {"kind": "update", "event_id": op.event_id} | {
        k: v for k, v in fields.items() if v is not None
    }


def op_from_dict(data: Mapping[str, Any]) -> ExtractedOp:
    """An op from its stored form; ``ValueError`` on anything else."""
    kind = data.get("kind")
    values = {k: v for k, v in data.items() if k != "kind"}
    texts = all(isinstance(v, str) for v in values.values())
    if kind == "create" and texts and {"type", "title"} <= set(values) <= _CREATE_FIELDS:
        return CreateEventOp(**values)
    if kind == "update" and texts and "event_id" in values and set(values) <= _UPDATE_FIELDS:
        return UpdateEventOp(**values)
    raise ValueError(f"not a key-event op: {dict(data)!r}")


@dataclass(frozen=True, slots=True)
class ExtractionJob:
    """A durable background extraction of key events from one ended session.

    ``status``: ``pending`` (due at ``next_attempt_at``), ``running`` (leased
    to ``lease_owner`` until ``lease_expires_at``; an expired lease is claimed
    again), ``done`` (``result`` set) or ``failed`` (after ``max_attempts``;
    ``last_error`` says why). ``ops``: the extracted operations, recorded once
    so that a retry applies the same ones instead of asking the model again.
    """

    id: str
    session_id: str
    owner: str
    agent_ref: str
    transcript_ref: str
    status: JobStatus
    attempts: int
    max_attempts: int
    next_attempt_at: datetime
    created_at: datetime
    updated_at: datetime
    lease_owner: str | None = None
    lease_token: str | None = None
    lease_expires_at: datetime | None = None
    last_error: str | None = None
    ops: tuple[ExtractedOp, ...] | None = None
    result: JSON = None


def trace_to_data(trace: Sequence[Sequence[TraceCall]]) -> list[list[dict[str, Any]]]:
    return [
        [
            {
                "call_id": c.call_id,
                "name": c.name,
                "arguments": dict(c.arguments),
                "status": c.status,
                "result": c.result,
                "error": c.error,
            }
            for c in group
        ]
        for group in trace
    ]


def trace_from_data(data: Any) -> tuple[tuple[TraceCall, ...], ...]:
    """A stored trace; ``ValueError`` when it is not one."""
    if not isinstance(data, list) or not all(isinstance(g, list) for g in data):
        raise ValueError("a trace is a list of lists of calls")
    try:
        return tuple(tuple(TraceCall(**call) for call in group) for group in data)
    except TypeError as e:
        raise ValueError(f"a stored call is malformed: {e}") from e
