"""``touba history``: inspect and administer a SQLite decision-history store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from touba.cli._common import console, errors, run
from touba.history.sqlite import SqliteHistoryStore

app = typer.Typer(
    help="Inspect and administer a SQLite decision-history store.", no_args_is_help=True
)

Db = Annotated[Path, typer.Option("--db", help="Path of the SQLite history file.")]
Namespace = Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace.")]
Key = Annotated[str, typer.Argument(help="The session key (see `touba history ls`).")]


@asynccontextmanager
async def _open(db: Path) -> AsyncIterator[SqliteHistoryStore]:
    """Open an existing store (never create one by mistake)."""
    if not await asyncio.to_thread(db.is_file):
        errors.print(f"[bold red]no history database at {db}[/]")
        raise typer.Exit(1)
    async with SqliteHistoryStore(db) as store:
        yield store


@app.command("ls")
def ls(db: Db, namespace: Namespace = None) -> None:
    """List conversations: identity, sizes, expiry and reservations (never content)."""

    async def go() -> None:
        async with _open(db) as store:
            rows = await store.list(namespace)
        table = Table(
            "key",
            "namespace",
            "agent",
            "invocation",
            "messages",
            "bytes",
            "updated",
            "expires",
            "active",
        )
        for row in rows:
            identity = row.identity or {}
            table.add_row(
                row.key,
                identity.get("namespace", "-"),
                identity.get("agent_ref", "-"),
                identity.get("invocation_id", "-"),
                str(row.messages),
                str(row.bytes),
                row.updated_at[:19],
                (row.expires_at or "-")[:19],
                _active(row.reservation) if row.active else "no",
            )
        console.print(table)
        console.print(f"{len(rows)} conversation(s)")

    run(go())


def _active(reservation: dict[str, Any] | None) -> str:
    if not reservation:
        return "yes"
    return f"yes: pid {reservation.get('pid')} on {reservation.get('host')}"


@app.command("show")
def show(
    key: Key,
    db: Db,
    raw: Annotated[bool, typer.Option("--json", help="Print the whole record as JSON.")] = False,
) -> None:
    """Show one conversation: identity, sizes, summary state and exchanges."""

    async def go() -> None:
        async with _open(db) as store:
            record = await store.read(key)
        if record is None:
            errors.print(f"[bold red]no conversation {key}[/] (absent or expired)")
            raise typer.Exit(1)
        if raw:
            console.print_json(json.dumps(record, ensure_ascii=False))
            return
        identity = record.get("identity", {})
        for field, value in identity.items():
            console.print(f"[bold]{field}[/]: {value}")
        stats = record.get("stats", {})
        console.print(
            f"[bold]retained[/]: {stats.get('exchanges')} exchanges, {stats.get('messages')} "
            f"messages, {stats.get('bytes')} bytes; pending calls: "
            f"{len(record.get('pending', []))}"
        )
        summary = record.get("summary")
        if summary:
            console.print(
                f"[bold]summary[/]: covers {summary.get('through')} exchanges, "
                f"{summary.get('bytes')} bytes, {summary.get('fingerprint')}"
            )
        table = Table("#", "messages", "decision", "results")
        for index, exchange in enumerate(record.get("exchanges", [])):
            table.add_row(str(index), str(len(exchange)), *_describe(exchange))
        console.print(table)

    run(go())


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


@app.command("rm")
def rm(key: Key, db: Db) -> None:
    """Delete an inactive conversation."""

    async def go() -> None:
        async with _open(db) as store:
            deleted = await store.delete(key)
        console.print("deleted" if deleted else f"no conversation {key}")
        if not deleted:
            raise typer.Exit(1)

    run(go())


@app.command("recover")
def recover(
    key: Key,
    db: Db,
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
        async with _open(db) as store:
            freed = await store.recover(key, worker_stopped=True)
        console.print("reservation freed" if freed else "no reservation on that key")

    run(go())


@app.command("purge")
def purge(db: Db) -> None:
    """Delete expired conversations now (they are otherwise purged on the next access)."""

    async def go() -> None:
        async with _open(db) as store:
            count = await store.purge_expired()
        console.print(f"purged {count} expired conversation(s)")

    run(go())
