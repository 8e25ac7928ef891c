"""What belongs to one user, across a deployment's stores: the derivation that erase and
export share.

Decisions:

- **Owner strings.** A chat session's key events, jobs and the session itself are owned
  by ``owner_for(user_id, session_id)`` = ``user:<id>`` (:mod:`touba.memory._key_events`).
  A host that called ``store.open_session(owner=...)`` itself may have used the bare user
  id: that is looked up too, unless the id itself looks like an owner string
  (``user:...`` or ``session:...``), which would name another user's rows.
- **Sessions**: the memory store's sessions of those owners.
- **Run ids**: each of those session ids (a :class:`~touba.ChatSession` invokes with
  ``run_id`` = its session id), the ``run_ids`` the caller names (runs invoked outside a
  chat session), and the ``run_id`` of every checkpoint whose body names the user
  (``user_id``) or one of those sessions (``session_id``).
- **Checkpoints**: those whose ``run_id`` is one of the run ids or whose body's
  ``user_id`` is the user. **Decision histories**: those whose identity ``run_id`` is one
  of the run ids. **Resource values**: scope ``user`` under the user id, scope
  ``session`` under a session id, scope ``run`` under a run id (scope ``agent`` is the
  agent's, kept). Memory settings are per agent: kept.

The derivation reads only. It is O(the user's sessions) on the memory store and
O(checkpoints) on a checkpoint store without an ``owned_checkpoints`` primitive (the
built-in ones have it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from touba.data._stores import Stores
from touba.errors import ConfigurationError
from touba.history._model import JSON
from touba.memory._sql import SqlMemoryStore

__all__ = ["Owned", "owned_by", "owner_strings"]

_PAGE = 500


@dataclass(frozen=True, slots=True)
class Owned:
    """Everything that identifies one user's rows (ids only, never content).

    ``owners``: the owner strings of the memory store's rows. ``session_ids``: the
    user's chat sessions. ``run_ids``: the runs whose histories, checkpoints and
    ``run``-scoped resources are the user's (the session ids included).
    """

    user: str
    owners: tuple[str, ...]
    session_ids: frozenset[str]
    run_ids: frozenset[str]

    def resource_keys(self) -> dict[str, frozenset[str]]:
        """The resource scope keys that are the user's, by scope."""
        return {
            "user": frozenset({self.user}),
            "session": self.session_ids,
            "run": self.run_ids,
        }


def check_user(user: object) -> str:
    """A user id: a non-empty str without NUL; ``ConfigurationError`` otherwise."""
    if not isinstance(user, str) or not user or "\x00" in user:
        raise ConfigurationError(
            "user must be a non-empty str (the user id the host passes as user_id), without "
            "NUL; nothing was read or changed"
        )
    return user


def owner_strings(user: str) -> tuple[str, ...]:
    """The owner strings of ``user``'s memory rows: ``user:<id>``, and the bare id unless it
    looks like an owner string itself (see the module docstring)."""
    check_user(user)
    if user.startswith(("user:", "session:")):
        return (f"user:{user}",)
    return (f"user:{user}", user)


def _run_ids(run_ids: Iterable[str]) -> frozenset[str]:
    if isinstance(run_ids, str | bytes):
        raise ConfigurationError("run_ids must be a collection of run ids, not one str")
    found = frozenset(run_ids)
    if not all(isinstance(r, str) and r for r in found):
        raise ConfigurationError("run_ids must hold non-empty str run ids only")
    return found


async def _sessions(stores: Stores, owners: tuple[str, ...]) -> set[str]:
    memory = stores.memory
    found: set[str] = set()
    if memory is None:
        return found
    for owner in owners:
        if isinstance(memory, SqlMemoryStore):
            offset = 0
            while True:
                page = await memory.list_sessions(owner=owner, limit=_PAGE, offset=offset)
                found.update(s.session_id for s in page)
                if len(page) < _PAGE:
                    break
                offset += _PAGE
        else:
            page = await memory.list_sessions(owner=owner, limit=1_000_000)
            found.update(s.session_id for s in page if s.owner == owner)
    return found


def _mine(body: dict[str, JSON], user: str, run_ids: frozenset[str]) -> bool:
    return body.get("user_id") == user or body.get("session_id") in run_ids


async def checkpoint_runs(stores: Stores, user: str, run_ids: frozenset[str]) -> set[str]:
    """The ``run_id`` of each checkpoint of ``user`` (its body's ``user_id``), or of one of
    ``run_ids`` (its ``run_id``, or its body's ``session_id``)."""
    store = stores.checkpoints
    found: set[str] = set()
    if store is None:
        return found
    owned = getattr(store, "owned_checkpoints", None)
    if owned is not None:
        for info in await owned(run_ids=run_ids, user=user):
            if info.run_id is not None:
                found.add(info.run_id)
        return found
    listing = getattr(store, "list", None)
    if listing is None:
        return found  # a store that cannot be enumerated: only the given run ids
    for info in await listing():
        if info.run_id in run_ids:
            continue
        body = await store.get(info.checkpoint_id)
        if body is not None and _mine(body, user, run_ids) and info.run_id is not None:
            found.add(info.run_id)
    return found


async def owned_by(user: str, stores: Stores, run_ids: Iterable[str] = ()) -> Owned:
    """What belongs to ``user`` in ``stores`` (see the module docstring), reading only.

    ``run_ids``: runs of the user's invoked outside a chat session, which no store can
    tie to the user otherwise. ``ConfigurationError`` for an empty user id or run id;
    a store's own error (``MemoryStoreUnavailable``, ``CheckpointStoreUnavailable``)
    when it fails.
    """
    check_user(user)
    given = _run_ids(run_ids)
    owners = owner_strings(user)
    sessions = frozenset(await _sessions(stores, owners))
    runs = given | sessions
    runs = runs | frozenset(await checkpoint_runs(stores, user, runs))
    return Owned(user=user, owners=owners, session_ids=sessions, run_ids=runs)
