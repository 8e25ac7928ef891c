"""``touba history``: inspect and administer a decision-history store.

The store is a SQLite file (``--db``), PostgreSQL (``--dsn`` or ``TOUBA_DSN``,
``--table``) or Redis (``--redis-url``, ``--prefix``); see
:mod:`touba.cli._stores`. ``ls`` also prints how full the store is against
its limits, which live in the application, not in the store: give them with
``--max-sessions`` / ``--max-store-bytes`` when yours are not the defaults.

Two sizes describe a conversation, and each command names both the same way:
its **stored bytes** (what it takes in the store, head and rows, counted
against ``max_store_bytes``; the ``bytes`` of ``store.list()``) and its
**message bytes** (its messages by the measure of SPEC section 3, counted
against ``max_retained_bytes``; the record's ``stats.bytes``). ``ls`` and
``show`` report the same stored bytes for one conversation.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Unpack

import typer
from rich.markup import escape

from touba.cli._common import (
    JsonOption,
    console,
    errors,
    print_json,
    print_table,
    progress,
    store_command,
)
from touba.cli._common import table as make_table
from touba.cli._stores import (
    Backend,
    DsnOption,
    HistoryAdmin,
    Limits,
    RedisUrlOption,
    choose_backend,
    only_with,
    open_history,
)
from touba.errors import DecisionHistoryBusy
from touba.history import StoredConversation, StoreUsage

app = typer.Typer(
    help="Inspect and administer a decision-history store (SQLite, PostgreSQL or Redis).",
    no_args_is_help=True,
)

Db = Annotated[Path | None, typer.Option("--db", help="Path of the SQLite history file.")]
TableOption = Annotated[
    str | None,
    typer.Option(
        "--table", help="With --dsn: the store's table, as given to it (default touba_history)."
    ),
]
PrefixOption = Annotated[
    str | None,
    typer.Option("--prefix", help="With --redis-url: the store's key prefix (default 'touba:')."),
]
Namespace = Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace.")]
Key = Annotated[str, typer.Argument(help="The session key (see `touba history ls`).")]


@dataclass(frozen=True, slots=True)
class _Target:
    backend: Backend
    table: str | None
    prefix: str | None


def _target(
    db: Path | None, dsn: str | None, redis_url: str | None, table: str | None, prefix: str | None
) -> _Target:
    backend = choose_backend(db, dsn, redis_url, redis=True)
    only_with(backend, "postgresql", table=table)
    only_with(backend, "redis", prefix=prefix)
    return _Target(backend, table, prefix)


_store_command = functools.partial(
    store_command,
    app,
    options={
        "db": Db,
        "dsn": DsnOption,
        "redis_url": RedisUrlOption,
        "table": TableOption,
        "prefix": PrefixOption,
    },
    target=_target,
)
"""``@_store_command(NAME)``: ``touba history NAME``, written ``fn(target, *its own)``."""


@asynccontextmanager
async def _open(
    target: _Target, *, read_only: bool = False, **limits: Unpack[Limits]
) -> AsyncIterator[HistoryAdmin]:
    """Open an existing store (never create one by mistake); ``read_only`` for the
    commands that only read (``ls``, ``show``), which then change nothing."""
    async with open_history(
        target.backend, table=target.table, prefix=target.prefix, read_only=read_only, **limits
    ) as store:
        yield store


@_store_command("ls")
def ls(
    target: _Target,
    namespace: Namespace = None,
    max_sessions: Annotated[
        int | None,
        typer.Option("--max-sessions", min=1, help="The store's max_sessions (default 128)."),
    ] = None,
    max_store_bytes: Annotated[
        int | None,
        typer.Option(
            "--max-store-bytes", min=1, help="The store's max_store_bytes (default 32 MiB)."
        ),
    ] = None,
    raw: JsonOption = False,
) -> None:
    """List conversations: identity, sizes, expiry and reservations (never content),
    then the store's usage against its limits."""
    limits = Limits()
    if max_sessions is not None:
        limits["max_sessions"] = max_sessions
    if max_store_bytes is not None:
        limits["max_store_bytes"] = max_store_bytes

    async def go() -> None:
        async with _open(target, read_only=True, **limits) as store:
            # purge=False: a read-only command leaves expired conversations for a purge.
            every = await store.list(namespace, purge=False)
            usage = await store.usage(purge=False)
        rows = [r for r in every if r.active or not r.expired]
        expired = len(every) - len(rows)
        if raw:
            print_json(
                {
                    "conversations": [_row(r) for r in rows],
                    "expired": expired,
                    "usage": _usage_data(usage),
                }
            )
            return
        shown = make_table(
            "key",
            "namespace",
            "agent",
            "invocation",
            "messages",
            "stored bytes",
            "updated",
            "expires",
            "active",
        )
        for row in rows:
            identity = row.identity or {}
            shown.add_row(
                escape(row.key),
                escape(identity.get("namespace", "-")),
                escape(identity.get("agent_ref", "-")),
                escape(identity.get("invocation_id", "-")),
                str(row.messages),
                str(row.bytes),
                row.updated_at[:19],
                (row.expires_at or "-")[:19],
                escape(_active(row.reservation)) if row.active else "no",
            )
        print_table(shown)
        console.print(f"{len(rows)} conversation(s)")
        if expired:
            console.print(
                f"{expired} expired conversation(s) still stored, counted below until "
                "`touba history purge` (or the application's next access) removes them"
            )
        console.print(
            f"store usage: {usage.sessions}/{usage.max_sessions} conversations, "
            f"{usage.bytes}/{usage.max_store_bytes} bytes ({usage.fraction:.0%} full)"
        )

    target.backend.run(go())


def _row(row: StoredConversation) -> dict[str, Any]:
    return {
        "key": row.key,
        "identity": row.identity,
        "messages": row.messages,
        "stored_bytes": row.bytes,
        "updated_at": row.updated_at,
        "expires_at": row.expires_at,
        "active": row.active,
        "reservation": row.reservation,
    }


def _usage_data(usage: StoreUsage) -> dict[str, Any]:
    return {
        "conversations": usage.sessions,
        "max_sessions": usage.max_sessions,
        "stored_bytes": usage.bytes,
        "max_store_bytes": usage.max_store_bytes,
    }


def _active(reservation: dict[str, Any] | None) -> str:
    if not reservation:
        return "yes"
    return f"yes: pid {reservation.get('pid')} on {reservation.get('host')}"


@_store_command("show")
def show(
    target: _Target,
    key: Key,
    raw: Annotated[
        bool, typer.Option("--json", help="Print the whole record, as stored, as JSON.")
    ] = False,
) -> None:
    """Show one conversation: identity, sizes, summary state and exchanges."""

    async def go() -> None:
        async with _open(target, read_only=True) as store:
            record = await store.read(key, purge=False)  # purges nothing: read-only
            namespace = (record or {}).get("identity", {}).get("namespace")
            found = await store.list(namespace, purge=False) if record else []
            listed = [r for r in found if r.key == key]
        if record is None:
            errors.print(f"[bold red]no conversation {escape(key)}[/] (absent or expired)")
            raise typer.Exit(1)
        if raw:
            print_json(record)
            return
        identity = record.get("identity", {})
        for field, value in identity.items():
            console.print(f"[bold]{escape(str(field))}[/]: {escape(str(value))}")
        stats = record.get("stats", {})
        stored = f"{listed[0].bytes} stored bytes" if listed else "stored bytes unknown"
        console.print(
            f"[bold]retained[/]: {stats.get('exchanges')} exchanges, {stats.get('messages')} "
            f"messages, {stored} ({stats.get('bytes')} message bytes); pending calls: "
            f"{len(record.get('pending', []))}"
        )
        summary = record.get("summary")
        if summary:
            console.print(
                f"[bold]summary[/]: covers {summary.get('through')} exchanges, "
                f"{summary.get('bytes')} bytes, {escape(str(summary.get('fingerprint')))}"
            )
        rows = make_table("#", "messages", "decision", "results")
        for index, exchange in enumerate(record.get("exchanges", [])):
            decision, results = _describe(exchange)
            rows.add_row(str(index), str(len(exchange)), escape(decision), escape(results))
        print_table(rows)

    target.backend.run(go())


def _describe(exchange: list[dict[str, Any]]) -> tuple[str, str]:
    decision, results = "", []
    for message in exchange:
        kind = message.get("kind")
        if kind == "decision":
            calls = [c.get("name", "?") for c in message.get("calls", [])]
            decision = "final" if message.get("final") else "calls " + ", ".join(calls)
        elif kind == "result":
            results.append(f"{message.get('name')}: {message.get('status')}")
        elif kind == "data":
            results.append(f"{len(message.get('observations', []))} observation(s) as data")
    return decision, "; ".join(results)


@_store_command("rm")
def rm(
    target: _Target,
    key: Key,
) -> None:
    """Delete an inactive conversation."""

    async def go() -> None:
        async with _open(target) as store:
            try:
                deleted = await store.delete(key)
            except DecisionHistoryBusy as e:
                errors.print(
                    f"[bold red]{e.code}[/]: conversation {escape(key)} is active: a worker "
                    "holds it. Retry once it finishes. If that worker crashed, stop and check "
                    "it, free the conversation with `touba history recover KEY` (same store "
                    "options), then remove it"
                )
                raise typer.Exit(1) from e
        console.print("deleted" if deleted else f"no conversation {escape(key)}")
        if not deleted:
            raise typer.Exit(1)

    target.backend.run(go())


@_store_command("recover")
def recover(
    target: _Target,
    key: Key,
    worker_stopped: Annotated[
        bool,
        typer.Option(
            "--worker-stopped",
            help="Confirm that the worker holding the reservation is stopped.",
        ),
    ] = False,
) -> None:
    """Free a reservation left by a crashed worker (storage only, no business effect)."""
    if not worker_stopped:
        confirmed = typer.confirm(
            "Recovering frees the conversation for another worker. Have you stopped and "
            "checked the worker that held it?",
            default=False,
        )
        if not confirmed:
            errors.print("nothing done")
            raise typer.Exit(1)

    async def go() -> None:
        async with _open(target) as store:
            freed = await store.recover(key, worker_stopped=True)
        console.print("reservation freed" if freed else "no reservation on that key")

    target.backend.run(go())


@_store_command("purge")
def purge(
    target: _Target,
) -> None:
    """Delete expired conversations now (they are otherwise purged on the next access)."""

    async def go() -> None:
        async with _open(target) as store:
            with progress(total=False) as shown:
                shown.add_task("purging expired conversations", total=None)
                count = await store.purge_expired()
        console.print(f"purged {count} expired conversation(s)")

    target.backend.run(go())
