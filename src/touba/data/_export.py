"""Export: a selection of a deployment's records, streamed in the export format.

Decisions:

- **One selection.** Exactly one of ``user``, ``session``, ``conversation`` or
  ``namespace``: none or several is a ``ConfigurationError`` before anything is read.
- **What a selection holds.** ``user``: what :func:`touba.data.owned_by` derives, the
  derivation erase uses (what an erase would delete is what the export shows): the
  user's sessions with their turns, the key events of the user's owner strings with
  their update history, the extraction jobs of those owners or sessions, the decision
  histories and checkpoints of the user's runs. ``session``: the chat session, its
  turns, the key events it owns (``session:<id>``, an anonymous session's), its
  extraction jobs, the decision histories of its turns (identity ``run_id`` = the
  session id, as :class:`~touba.ChatSession` runs them) and its checkpoints.
  ``conversation``: that key's decision history, from the first history store that
  holds it. ``namespace``: every decision history of that namespace in every history
  store. Resource values: with ``user``, scope ``user`` under the user id, ``session``
  under the user's sessions, ``run`` under the user's runs; with ``session``, scopes
  ``session`` and ``run`` under the session id (a binding without ``scope_items``, the
  built-in ones' primitive, has none to give).
- **Constant memory.** Records are read a page at a time (``PAGE`` rows) and yielded
  one by one; a conversation is read whole (its store bounds it by
  ``max_retained_bytes``). What grows with the selection is only the list of keys of
  one history store (``store.list``: sizes, never content).
- **Reads change nothing.** Every history read is ``purge=False``; a record that
  disappears while the export runs is left out.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Final

from touba.data._format import dump_line, end_line, header_line
from touba.data._owned import owned_by
from touba.data._stores import Stores
from touba.errors import ConfigurationError
from touba.history._store import AdminStore
from touba.memory._model import (
    ExtractionJob,
    KeyEvent,
    KeyEventUpdate,
    SessionMeta,
    StoredTurn,
    op_to_dict,
    trace_to_data,
)
from touba.runtime._resources import ResourceAddress, ResourceItem

__all__ = [
    "PAGE",
    "checkpoint_line",
    "conversation_line",
    "event_change_line",
    "event_line",
    "export_records",
    "job_line",
    "resource_line",
    "session_line",
    "turn_line",
    "write_export",
]

PAGE: Final = 100


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def session_line(session: SessionMeta) -> dict[str, Any]:
    """A ``session`` record."""
    return {
        "kind": "session",
        "session_id": session.session_id,
        "owner": session.owner,
        "agent_ref": session.agent_ref,
        "mode": session.mode,
        "created_at": _iso(session.created_at),
        "ended_at": _iso(session.ended_at),
        "turns": session.turns,
    }


def turn_line(turn: StoredTurn) -> dict[str, Any]:
    """A ``turn`` record, with its context."""
    return {
        "kind": "turn",
        "session_id": turn.session_id,
        "index": turn.index,
        "user": turn.user,
        "replies": list(turn.replies),
        "trace": trace_to_data(turn.trace),
        "invocation_id": turn.invocation_id,
        "created_at": _iso(turn.created_at),
        "context": None if turn.context is None else dict(turn.context),
    }


def event_line(event: KeyEvent) -> dict[str, Any]:
    """A ``key_event`` record (its history goes in ``key_event_change`` records)."""
    return {
        "kind": "key_event",
        "id": event.id,
        "owner": event.owner,
        "type": event.type,
        "title": event.title,
        "status": event.status,
        "details": event.details,
        "created_at": _iso(event.created_at),
        "updated_at": _iso(event.updated_at),
        "session_id": event.session_id,
    }


def event_change_line(event_id: str, index: int, update: KeyEventUpdate) -> dict[str, Any]:
    """A ``key_event_change`` record: entry ``index`` of the event's update history."""
    return {
        "kind": "key_event_change",
        "event_id": event_id,
        "index": index,
        "at": _iso(update.at),
        "session_id": update.session_id,
        "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in update.changes],
        "op_id": update.op_id,
        "actor": update.actor,
    }


def job_line(job: ExtractionJob) -> dict[str, Any]:
    """An ``extraction_job`` record."""
    return {
        "kind": "extraction_job",
        "id": job.id,
        "session_id": job.session_id,
        "owner": job.owner,
        "agent_ref": job.agent_ref,
        "transcript_ref": job.transcript_ref,
        "status": job.status,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "next_attempt_at": _iso(job.next_attempt_at),
        "created_at": _iso(job.created_at),
        "updated_at": _iso(job.updated_at),
        "lease_owner": job.lease_owner,
        "lease_token": job.lease_token,
        "lease_expires_at": _iso(job.lease_expires_at),
        "last_error": job.last_error,
        "ops": None if job.ops is None else [op_to_dict(op) for op in job.ops],
        "result": job.result,
    }


def conversation_line(key: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``conversation`` record: ``key``, the record's ``identity`` and the record as
    the store's ``read()`` returned it (the repair and the copy write these too)."""
    identity = record.get("identity")
    return {
        "kind": "conversation",
        "key": key,
        "identity": dict(identity) if isinstance(identity, Mapping) else None,
        "record": dict(record),
    }


def checkpoint_line(checkpoint_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A ``checkpoint`` record."""
    return {"kind": "checkpoint", "id": checkpoint_id, "body": dict(body)}


def resource_line(address: ResourceAddress, item: ResourceItem) -> dict[str, Any]:
    """A ``resource`` record."""
    return {
        "kind": "resource",
        "address": {
            "resource": address.resource,
            "scope": address.scope,
            "scope_key": address.scope_key,
        },
        "key": item.key,
        "value": item.value,
        "updated_at": _iso(item.updated_at),
    }


def _selection(
    user: str | None, session: str | None, conversation: str | None, namespace: str | None
) -> dict[str, str]:
    given = {
        name: value
        for name, value in (
            ("user", user),
            ("session", session),
            ("conversation", conversation),
            ("namespace", namespace),
        )
        if value is not None
    }
    if len(given) != 1:
        raise ConfigurationError(
            "export exactly one selection: user=, session=, conversation= or namespace= "
            f"(got {', '.join(given) or 'none'})"
        )
    ((name, value),) = given.items()
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be a non-empty str")
    return given


async def export_records(
    stores: Stores,
    *,
    user: str | None = None,
    session: str | None = None,
    conversation: str | None = None,
    namespace: str | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The lines of an export of one selection, as dicts: the header, the records,
    the end line. Streamed: records are read a page at a time, never all at once.

    Exactly one of ``user``, ``session``, ``conversation`` or ``namespace`` (what each
    holds: docs/data/export.md); anything else raises ``ConfigurationError`` before
    anything is read. Store failures raise the store's own typed error (the lines
    already yielded make an incomplete file, which import refuses: no end line).
    """
    selection = _selection(user, session, conversation, namespace)
    yield header_line(selection)
    count = 0
    if user is not None:
        records = _user_records(stores, user)
    elif session is not None:
        records = _session_records(stores, session)
    elif conversation is not None:
        records = _conversation_records(stores.histories, conversation)
    else:
        assert namespace is not None
        records = _namespace_records(stores.histories, namespace)
    async for record in records:
        count += 1
        yield record
    yield end_line(count)


async def _session_records(stores: Stores, session_id: str) -> AsyncIterator[dict[str, Any]]:
    memory: Any = stores.memory
    if memory is not None:
        async for record in _session_and_turns(memory, session_id):
            yield record
        async for record in _event_records(memory, f"session:{session_id}"):
            yield record
        async for record in _job_records(memory, lambda job: job.session_id == session_id):
            yield record
    runs = frozenset({session_id})
    async for record in _run_records(stores, runs):
        yield record
    async for record in _checkpoint_records(stores, runs, None):
        yield record
    async for record in _resource_records(stores, {"session": runs, "run": runs}):
        yield record


async def _user_records(stores: Stores, user: str) -> AsyncIterator[dict[str, Any]]:
    owned = await owned_by(user, stores)
    memory: Any = stores.memory
    if memory is not None:
        for session_id in sorted(owned.session_ids):
            async for record in _session_and_turns(memory, session_id):
                yield record
        for owner in owned.owners:
            async for record in _event_records(memory, owner):
                yield record
        async for record in _job_records(
            memory, lambda job: job.owner in owned.owners or job.session_id in owned.session_ids
        ):
            yield record
    async for record in _run_records(stores, owned.run_ids):
        yield record
    async for record in _checkpoint_records(stores, owned.run_ids, user):
        yield record
    async for record in _resource_records(stores, owned.resource_keys()):
        yield record


async def _session_and_turns(memory: Any, session_id: str) -> AsyncIterator[dict[str, Any]]:
    meta = await memory.get_session(session_id)
    if meta is None:
        return
    yield session_line(meta)
    offset = 0
    while page := await _list_turns(memory, session_id, offset):
        for turn in page:
            yield turn_line(turn)
        offset += len(page)


async def _job_records(
    memory: Any, mine: Callable[[ExtractionJob], bool]
) -> AsyncIterator[dict[str, Any]]:
    """The jobs ``mine`` selects, a page at a time over every job."""
    offset = 0
    while jobs := await memory.list_jobs(limit=PAGE, offset=offset):
        for job in jobs:
            if mine(job):
                yield job_line(job)
        offset += len(jobs)


async def _run_records(stores: Stores, run_ids: frozenset[str]) -> AsyncIterator[dict[str, Any]]:
    """The decision histories whose identity ``run_id`` is one of ``run_ids``."""
    for store in stores.histories:
        keys = [
            row.key
            for row in await store.list(purge=False)
            if row.identity is not None and row.identity.get("run_id") in run_ids
        ]
        for key in keys:
            record = await store.read(key, purge=False)
            if record is not None:
                yield conversation_line(key, record)


async def _checkpoint_records(
    stores: Stores, run_ids: frozenset[str], user: str | None
) -> AsyncIterator[dict[str, Any]]:
    """The checkpoints of ``run_ids`` (and, with ``user``, those naming the user)."""
    store: Any = stores.checkpoints
    if store is None:
        return
    finder = getattr(store, "owned_checkpoints", None)
    if finder is not None:
        infos = await finder(run_ids=run_ids, user=user)
    elif callable(getattr(store, "list", None)):
        infos = [info for info in await store.list() if info.run_id in run_ids]
    else:
        return  # a store that cannot be enumerated holds nothing we can find
    for info in infos:
        body = await store.get(info.checkpoint_id)
        if body is not None:
            yield checkpoint_line(info.checkpoint_id, body)


async def _list_turns(memory: Any, session_id: str, offset: int) -> tuple[StoredTurn, ...]:
    list_turns = getattr(memory, "list_turns", None)
    if list_turns is None:
        raise ConfigurationError(
            "this memory store cannot list a session's turns page by page (list_turns); "
            "export from a built-in store (SqliteMemoryStore, PostgresMemoryStore)"
        )
    page: tuple[StoredTurn, ...] = await list_turns(session_id, limit=PAGE, offset=offset)
    return page


async def _event_records(memory: Any, owner: str) -> AsyncIterator[dict[str, Any]]:
    """An owner's key events, most recently touched first, each with its history."""
    offset = 0
    while events := await memory.query_events(
        owner, include_closed=True, limit=PAGE, offset=offset
    ):
        for found in events:
            event = await memory.get_event(owner, found.id)
            if event is None:  # deleted meanwhile
                continue
            yield event_line(event)
            for index, update in enumerate(event.history or ()):
                yield event_change_line(event.id, index, update)
        offset += len(events)


async def _resource_records(
    stores: Stores, scope_keys: Mapping[str, frozenset[str]]
) -> AsyncIterator[dict[str, Any]]:
    """The values of every resource under these scope keys, a page at a time."""
    items = getattr(stores.resources, "scope_items", None)
    if items is None:
        return  # no binding, or one that cannot list by scope key (the built-in ones can)
    for scope in ("user", "session", "run"):
        for scope_key in sorted(scope_keys.get(scope, ())):
            after = ("", "")
            while page := await items(scope, scope_key, after=after, limit=PAGE):
                for address, item in page:
                    yield resource_line(address, item)
                last_address, last_item = page[-1]
                after = (last_address.resource, last_item.key)


async def _conversation_records(
    histories: Sequence[AdminStore], key: str
) -> AsyncIterator[dict[str, Any]]:
    for store in histories:
        record = await store.read(key, purge=False)
        if record is not None:
            yield conversation_line(key, record)
            return


async def _namespace_records(
    histories: Sequence[AdminStore], namespace: str
) -> AsyncIterator[dict[str, Any]]:
    for store in histories:
        keys = [row.key for row in await store.list(namespace, purge=False)]
        for key in keys:
            record = await store.read(key, purge=False)
            if record is not None:
                yield conversation_line(key, record)


async def write_export(
    stores: Stores,
    out: BinaryIO | str | os.PathLike[str],
    *,
    user: str | None = None,
    session: str | None = None,
    conversation: str | None = None,
    namespace: str | None = None,
) -> int:
    """Write the export of one selection (:func:`export_records`) to ``out`` (a binary
    file, or a path: created or truncated with mode 0600) and return how many records
    it holds (header and end line not counted). Raises what ``export_records`` raises;
    a file left by a failure midway has no end line, and import refuses it."""
    _selection(user, session, conversation, namespace)  # refused before a file is made
    lines = export_records(
        stores, user=user, session=session, conversation=conversation, namespace=namespace
    )
    if isinstance(out, str | os.PathLike):
        fd = os.open(Path(out), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as file:
            return await _write(lines, file)
    return await _write(lines, out)


async def _write(lines: AsyncIterator[dict[str, Any]], file: BinaryIO) -> int:
    records = 0
    async for line in lines:
        file.write(dump_line(line))
        if line.get("kind") == "end":
            records = int(line["records"])
    file.flush()
    return records
