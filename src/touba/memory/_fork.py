"""A chat session forked in its store: who owns the copy.

A fork keeps its original's owner, so that a user's key events (which are per
user, never copied) serve both sessions. An anonymous session is owned by
itself (``session:<id>``, :func:`~touba.memory._key_events.owner_for`): its
fork is anonymous too, owned by the new session, as a session opened with that
id and no user would be; the original's key events stay with the original.
"""

from __future__ import annotations

import uuid

from touba.memory._key_events import owner_for
from touba.memory._model import SessionMeta
from touba.memory._store import MemoryStore, unknown_session

__all__ = ["fork_stored_session", "forked_owner"]


def forked_owner(owner: str, session_id: str, new_session_id: str) -> str:
    """The owner of ``session_id``'s fork ``new_session_id`` (see the module docstring)."""
    if owner == owner_for(None, session_id):
        return owner_for(None, new_session_id)
    return owner


async def fork_stored_session(
    store: MemoryStore, session_id: str, at_turn: int, new_session_id: str | None = None
) -> SessionMeta:
    """Fork ``session_id`` at turn ``at_turn`` into ``new_session_id`` (None: a new
    uuid4) with :meth:`MemoryStore.fork_session`; return the new session.
    ``ConfigurationError`` as that method raises it, and for an unknown session."""
    meta = await store.get_session(session_id)
    if meta is None:
        raise unknown_session(session_id)
    new_id = str(uuid.uuid4()) if new_session_id is None else new_session_id
    owner = forked_owner(meta.owner, session_id, new_id)
    return await store.fork_session(session_id, new_id, at_turn=at_turn, owner=owner)
