"""``touba events``: inspect the key events and extraction jobs of a memory store.

The store is a SQLite file (``--db``) or PostgreSQL (``--dsn`` or
``TOUBA_DSN``, ``--prefix``); see :mod:`touba.cli._stores`.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.markup import escape

from touba._encryption import Encryption
from touba.cli._common import (
    JsonOption,
    console,
    errors,
    print_json,
    print_table,
    store_command,
    table,
)
from touba.cli._keys import CurrentOption, KeysFileOption, encryption_of
from touba.cli._stores import (
    Backend,
    DsnOption,
    choose_backend,
    memory_table,
    only_with,
    open_memory,
    postgres_connection,
)
from touba.errors import ConfigurationError
from touba.memory import KeyEvent, MemoryStore, owner_for
from touba.memory._model import ExtractionJob, JobStatus

app = typer.Typer(
    help="Inspect key events and extraction jobs of a memory store (SQLite or PostgreSQL).",
    no_args_is_help=True,
)

Db = Annotated[Path | None, typer.Option("--db", help="Path of the SQLite memory file.")]
PrefixOption = Annotated[
    str | None,
    typer.Option(
        "--prefix",
        help="With --dsn: the store's table prefix, as given to it (default touba_memory).",
    ),
]
User = Annotated[str | None, typer.Option("--user", "-u", help="The user id (owner user:<id>).")]
Session = Annotated[
    str | None,
    typer.Option(
        "--session",
        "-s",
        help="A session id: the events that session sees (its user's, or session:<id> for an "
        "anonymous session); with --user, that user's events created in this session.",
    ),
]
EventId = Annotated[str, typer.Argument(help="The event id (see `touba events ls`).")]


@dataclass(frozen=True, slots=True)
class MemoryTarget:
    """The memory store a command was given: its backend and PostgreSQL prefix."""

    backend: Backend
    prefix: str | None
    encryption: Encryption | None = None


def memory_target(
    db: Path | None,
    dsn: str | None,
    prefix: str | None,
    keys_file: Path | None = None,
    current: str | None = None,
) -> MemoryTarget:
    """The store of ``--db`` / ``--dsn`` (exactly one), ``--prefix`` only with ``--dsn``;
    its keys from ``--keys-file`` / ``--current`` (:mod:`touba.cli._keys`)."""
    backend = choose_backend(db, dsn)
    only_with(backend, "postgresql", prefix=prefix)
    return MemoryTarget(backend, prefix, encryption_of(keys_file, current))


_store_command = functools.partial(
    store_command,
    app,
    options={
        "db": Db,
        "dsn": DsnOption,
        "prefix": PrefixOption,
        "keys_file": KeysFileOption,
        "current": CurrentOption,
    },
    target=memory_target,
)
"""``@_store_command(NAME)``: ``touba events NAME``, written ``fn(target, *its own)``."""


@asynccontextmanager
async def open_store(
    target: MemoryTarget, *, read_only: bool = False
) -> AsyncIterator[MemoryStore]:
    """Open an existing memory store (never create one by mistake); ``read_only`` for
    the commands that only read (``ls``, ``show``, ``jobs``), which then change nothing."""
    async with open_memory(
        target.backend, prefix=target.prefix, read_only=read_only, encryption=target.encryption
    ) as store:
        yield store


async def _owner(store: MemoryStore, user: str | None, session: str | None) -> str:
    if user is not None:
        return owner_for(user, session or "-")
    if session is None:
        errors.print("give --user U or --session S: key events belong to a user or a session")
        raise typer.Exit(2)
    meta = await store.get_session(session)
    return meta.owner if meta is not None else owner_for(None, session)


def _when(event: KeyEvent) -> str:
    return event.updated_at.isoformat(timespec="seconds")


@_store_command("ls")
def ls(
    target: MemoryTarget,
    user: User = None,
    session: Session = None,
    include_closed: Annotated[
        bool, typer.Option("--all", "-a", help="Include closed events.")
    ] = False,
    limit: Annotated[int, typer.Option("--limit", help="At most this many events.")] = 100,
    raw: JsonOption = False,
) -> None:
    """List the key events of a user or a session, most recently updated first."""

    async def go() -> None:
        async with open_store(target, read_only=True) as store:
            owner = await _owner(store, user, session)
            events = await store.query_events(owner, include_closed=include_closed, limit=limit)
        if user is not None and session is not None:
            events = [e for e in events if e.session_id == session]
        if raw:
            print_json({"owner": owner, "events": events})
            return
        shown = table("id", "type", "status", "title", "updated", "session", title=escape(owner))
        for event in events:
            shown.add_row(
                event.id,
                escape(event.type),
                event.status,
                escape(event.title),
                _when(event),
                escape(event.session_id),
            )
        print_table(shown)
        closed = "" if include_closed else " not closed (--all for every one)"
        console.print(f"{len(events)} event(s){closed} of {escape(owner)}")

    target.backend.run(go())


def _sqlite_owner_of(db: Path, event_id: str) -> str | None:
    uri = db.resolve().as_uri() + "?mode=ro"
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        row = conn.execute(
            "SELECT owner FROM touba_memory_events WHERE id = ?", (event_id,)
        ).fetchone()
    return None if row is None else str(row[0])


async def _owner_of(target: MemoryTarget, event_id: str) -> str | None:
    """The owner of an event, read directly (an admin lookup across owners), read-only."""
    if target.backend.kind == "sqlite":
        return await asyncio.to_thread(_sqlite_owner_of, Path(target.backend.address), event_id)
    from psycopg import sql

    events = sql.Identifier(*memory_table(target.prefix, "events"))
    async with postgres_connection(target.backend.address) as conn:
        query = sql.SQL("SELECT owner FROM {} WHERE id = %s").format(events)
        row = await (await conn.execute(query, (event_id,))).fetchone()
    return None if row is None else str(row[0])


@_store_command("show")
def show(
    target: MemoryTarget,
    event_id: EventId,
    user: User = None,
    session: Session = None,
    raw: JsonOption = False,
) -> None:
    """Show one key event with its update history."""

    async def go() -> None:
        async with open_store(target, read_only=True) as store:
            if user is not None or session is not None:
                owner: str | None = await _owner(store, user, session)
            else:
                owner = await _owner_of(target, event_id)
            found = None if owner is None else await store.get_event(owner, event_id)
        if found is None:
            errors.print(f"[bold red]no key event {escape(event_id)}[/]")
            raise typer.Exit(1)
        if raw:
            print_json(found)
            return
        for field in ("id", "owner", "type", "status", "title", "session_id"):
            console.print(f"[bold]{field}[/]: {escape(str(getattr(found, field)))}")
        console.print(f"[bold]created[/]: {found.created_at.isoformat(timespec='seconds')}")
        console.print(f"[bold]updated[/]: {_when(found)}")
        console.print(f"[bold]details[/]: {escape(found.details)}")
        shown = table("at", "session", "field", "old", "new", title="update history")
        for update in found.history or ():
            for change in update.changes:
                shown.add_row(
                    update.at.isoformat(timespec="seconds"),
                    escape(update.session_id),
                    change.field,
                    escape(change.old),
                    escape(change.new),
                )
        print_table(shown)
        console.print(f"{len(found.history or ())} update(s)")

    target.backend.run(go())


@_store_command("jobs")
def jobs(
    target: MemoryTarget,
    status: Annotated[
        str | None,
        typer.Option("--status", help="Only jobs in this status: pending, running, done, failed."),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many jobs.")] = 100,
    raw: JsonOption = False,
) -> None:
    """List extraction jobs (kind agent/flow), most recently changed first."""
    if status not in (None, "pending", "running", "done", "failed"):
        errors.print(f"[bold red]unknown status {escape(str(status))}[/]")
        raise typer.Exit(2)
    wanted = cast("JobStatus | None", status)

    async def go() -> None:
        async with open_store(target, read_only=True) as store:
            found = await store.list_jobs(status=wanted, limit=limit)
        if raw:
            print_json({"jobs": [_job(j) for j in found]})
            return
        shown = table("id", "session", "owner", "agent", "status", "attempts", "last error")
        for job in found:
            shown.add_row(
                job.id,
                escape(job.session_id),
                escape(job.owner),
                escape(job.agent_ref),
                job.status,
                f"{job.attempts}/{job.max_attempts}",
                escape(_last_error(job)),
            )
        print_table(shown)
        console.print(f"{len(found)} job(s)")

    target.backend.run(go())


def _last_error(job: ExtractionJob) -> str:
    """A done job's error is history: only a job still trying, or failed, shows one."""
    return "" if job.status == "done" else job.last_error or ""


def _job(job: ExtractionJob) -> dict[str, object]:
    """A job as JSON: everything but its lease token (a worker's own credential)."""
    data = {f: getattr(job, f) for f in _JOB_FIELDS}
    data["last_error"] = _last_error(job) or None
    return data


_JOB_FIELDS = (
    "id",
    "session_id",
    "owner",
    "agent_ref",
    "transcript_ref",
    "status",
    "attempts",
    "max_attempts",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "lease_owner",
    "lease_expires_at",
    "last_error",
    "ops",
    "result",
)


@_store_command("requeue")
def requeue(
    target: MemoryTarget,
    job_id: Annotated[str, typer.Argument(help="A failed job's id.")],
) -> None:
    """Give a failed extraction job a fresh set of attempts (after fixing its cause)."""

    async def go() -> None:
        async with open_store(target) as store:
            try:
                job = await store.requeue_job(job_id)
            except ConfigurationError as e:
                errors.print(f"[bold red]{escape(str(e))}[/]")
                raise typer.Exit(1) from e
        console.print(f"job {job.id} is {job.status} again")

    target.backend.run(go())
