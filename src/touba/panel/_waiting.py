"""What waits in the runtime's checkpoint store, read for the approvals page and the session page.

Below both :mod:`touba.panel._routes` (a session page lists its paused turn)
and :mod:`touba.panel._approvals` (the approvals pages), so that neither
imports the other.

- **What is listed.** Checkpoints ``awaiting_approval`` (the operator
  approves or denies each pending call) and ``running`` ones: a resume or a
  run in progress, or one whose worker died after claiming it. Checkpoints
  of a retryable failure (``failed``) wait for a retry, not for a reviewer,
  and are not listed.
- **Dead workers.** A running checkpoint names its holder (worker, pid,
  host, since). When the host is this one, whether the pid is alive is
  checked (``kill(pid, 0)``): alive, the checkpoint is running and nothing is
  offered; gone, it is ``recover``-able. On another host nothing can be
  checked from here: ``recover`` is offered behind the same confirmation
  (stop and check the worker first).
- **Chat turns.** A checkpoint whose ``run_id`` is a live chat session of
  the panel's memory store, of the same agent, is a paused chat turn: it is
  resumed through :meth:`~touba.memory.ChatSession.resume` so that the turn
  is stored in the session.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from touba.errors import ConfigurationError
from touba.history._model import JSON, CapabilityCall
from touba.memory import MemoryStore, SessionMeta
from touba.runtime import Runtime
from touba.runtime._checkpoints import CheckpointInfo, status_of
from touba.runtime._state import Paused

__all__ = ["Holder", "Waiting", "find_waiting", "list_waiting", "paused_turns"]

Action = Literal["decide", "recover", "none"]
LISTED = ("awaiting_approval", "running")


@dataclass(frozen=True, slots=True)
class Holder:
    """The worker a running checkpoint names; ``alive`` None when it cannot be checked."""

    worker_id: str | None
    pid: int | None
    host: str | None
    since: str | None
    alive: bool | None


@dataclass(frozen=True, slots=True)
class Waiting:
    """One listed checkpoint: who, what it waits for, since when, and what can be done."""

    checkpoint_id: str
    status: str
    agent: str
    run_id: str
    user_id: str | None
    input: JSON
    calls: tuple[CapabilityCall, ...]
    since: datetime | None
    holder: Holder | None
    session: SessionMeta | None

    @property
    def action(self) -> Action:
        """``decide`` (approve or deny each call), ``recover`` (a dead or unknown
        worker holds it) or ``none`` (a live worker runs it now)."""
        if self.status == "awaiting_approval":
            return "decide"
        if self.holder is not None and self.holder.alive is True:
            return "none"
        return "recover"

    @property
    def user(self) -> str | None:
        """The user id the invocation was given, or the chat session's owner."""
        if self.user_id is not None:
            return self.user_id
        return self.session.owner if self.session is not None else None


def _alive(host: object, pid: object) -> bool | None:
    """Whether process ``pid`` runs, when ``host`` is this machine; None otherwise."""
    if host != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _holder(value: object) -> Holder | None:
    if not isinstance(value, dict):
        return None

    def text(name: str) -> str | None:
        found = value.get(name)
        return found if isinstance(found, str) else None

    pid = value.get("pid")
    number = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    return Holder(
        text("worker_id"), number, text("host"), text("since"), _alive(value.get("host"), pid)
    )


def _moment(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


async def _session(memory: MemoryStore, run_id: str, agent: str) -> SessionMeta | None:
    """The live chat session ``run_id`` of ``agent``, when the paused invocation is its turn."""
    meta = await memory.get_session(run_id)
    if meta is None or meta.agent_ref != agent or meta.mode != "live":
        return None
    return meta


async def _waiting(
    memory: MemoryStore, checkpoint_id: str, status: str, created_at: str, body: dict[str, JSON]
) -> Waiting | None:
    try:
        paused = Paused.from_dict(body)
    except ConfigurationError:
        return None  # another version, or damaged: not something the panel can resume
    state = paused.state
    holder = _holder(body.get("holder")) if status == "running" else None
    since = holder.since if holder is not None else created_at
    return Waiting(
        checkpoint_id=checkpoint_id,
        status=status,
        agent=state.agent_ref,
        run_id=state.run_id,
        user_id=state.user_id,
        input=state.input,
        calls=tuple(paused.awaiting()),
        since=_moment(since),
        holder=holder,
        session=await _session(memory, state.run_id, state.agent_ref),
    )


async def list_waiting(
    runtime: Runtime, memory: MemoryStore, *, run_id: str | None = None, limit: int | None = None
) -> tuple[list[Waiting], int]:
    """The listed checkpoints of ``runtime``'s store (``run_id``'s only when given),
    oldest first, the first ``limit`` read whole; and how many are listed in all.
    ConfigurationError when the store cannot list its checkpoints."""
    store: Any = runtime.checkpoints
    if not callable(getattr(store, "list", None)):
        raise ConfigurationError(
            f"the runtime's checkpoint store ({type(store).__name__}) cannot list its "
            "checkpoints (it has no list method)"
        )
    infos: list[CheckpointInfo] = await store.list(run_id=run_id)
    listed = [info for info in infos if info.status in LISTED]
    found: list[Waiting] = []
    for info in listed[:limit]:
        body = await store.get(info.checkpoint_id)
        if body is None:
            continue  # resumed meanwhile
        waiting = await _waiting(memory, info.checkpoint_id, info.status, info.created_at, body)
        if waiting is not None:
            found.append(waiting)
    return found, len(listed)


async def find_waiting(runtime: Runtime, memory: MemoryStore, checkpoint_id: str) -> Waiting:
    """The listed checkpoint ``checkpoint_id``; ConfigurationError (one line) when it is
    gone (unknown, or resumed meanwhile), unreadable, or waits for nothing."""
    store: Any = runtime.checkpoints
    body = await store.get(checkpoint_id) if checkpoint_id else None
    if body is None:
        raise ConfigurationError(
            f"no checkpoint {checkpoint_id!r}: it is unknown, or it was already resumed "
            "(by this panel or another worker)"
        )
    status = status_of(body)
    if status not in LISTED:
        raise ConfigurationError(
            f"checkpoint {checkpoint_id!r} is {status}: it waits for a retry, not for a reviewer"
        )
    created = body.get("created_at")
    created_at = created if isinstance(created, str) else ""
    waiting = await _waiting(memory, checkpoint_id, status, created_at, body)
    if waiting is None:
        raise ConfigurationError(
            f"checkpoint {checkpoint_id!r} was written by another touba version or is "
            "damaged; this panel cannot resume it"
        )
    return waiting


async def paused_turns(
    runtime: Runtime | None, memory: MemoryStore, session_id: str
) -> list[Waiting]:
    """The paused turns of chat session ``session_id`` (none without a runtime, or when
    its store cannot list checkpoints): what its session page links to."""
    if runtime is None:
        return []
    try:
        found, _ = await list_waiting(runtime, memory, run_id=session_id)
    except ConfigurationError:
        return []
    return [w for w in found if w.session is not None]
