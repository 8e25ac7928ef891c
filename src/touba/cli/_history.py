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
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Unpack

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

import touba
from touba._encryption import Encryption
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
from touba.cli._holder import holder_lines, process_state, recover_command
from touba.cli._keys import CurrentOption, KeysFileOption, encryption_of
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
from touba.history import (
    RawConversation,
    RecordProblem,
    RepairPlan,
    StoredConversation,
    StoreUsage,
    check_record,
    plan_repair,
)
from touba.history._repair import RepairableStore, export_lines

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
Key = Annotated[
    str,
    typer.Argument(help="The session key, whole or shortened as `touba history ls` shows it."),
]
logger = logging.getLogger("touba.history")
KEY_SHOWN = 21
"""How many characters of a key ``ls`` shows on a terminal (without ``--wide``)."""
ELLIPSIS = "…"


@dataclass(frozen=True, slots=True)
class _Target:
    backend: Backend
    table: str | None
    prefix: str | None
    encryption: Encryption | None = None


def _target(
    db: Path | None,
    dsn: str | None,
    redis_url: str | None,
    table: str | None,
    prefix: str | None,
    keys_file: Path | None = None,
    current: str | None = None,
) -> _Target:
    backend = choose_backend(db, dsn, redis_url, redis=True)
    only_with(backend, "postgresql", table=table)
    only_with(backend, "redis", prefix=prefix)
    return _Target(backend, table, prefix, encryption_of(keys_file, current))


_store_command = functools.partial(
    store_command,
    app,
    options={
        "db": Db,
        "dsn": DsnOption,
        "redis_url": RedisUrlOption,
        "table": TableOption,
        "prefix": PrefixOption,
        "keys_file": KeysFileOption,
        "current": CurrentOption,
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
    if target.encryption is not None:
        limits["encryption"] = target.encryption
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
    wide: Annotated[
        bool,
        typer.Option(
            "--wide", help="Every column and whole keys, one row per line (as when piped)."
        ),
    ] = False,
    raw: JsonOption = False,
) -> None:
    """List conversations: identity, sizes, expiry and reservations (never content),
    then the store's usage against its limits.

    On a terminal, keys are shortened in the middle (``show``, ``rm`` and ``recover``
    take the short form while it names one conversation) and the columns fit its
    width; ``--wide``, or a pipe, gives every column and whole keys."""
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
        whole = wide or not console.is_terminal
        print_table(_wide_table(rows) if whole else _narrow_table(rows), whole=whole)
        if not whole:
            _holders(rows)
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


def _wide_table(rows: list[StoredConversation]) -> Table:
    """Every column, whole keys (``--wide``, or piped)."""
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
    return shown


def _narrow_table(rows: list[StoredConversation]) -> Table:
    """What an operator scans on a terminal of 80 columns: the key shortened in the
    middle, the agent, sizes, the last update (UTC, to the minute), whether it is held
    (:func:`_holders` says by whom, under the table)."""
    shown = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    shown.add_column("key", no_wrap=True)
    shown.add_column("agent", overflow="fold")
    shown.add_column("msgs", justify="right")
    shown.add_column("bytes", justify="right")  # stored bytes, as in --wide
    shown.add_column("updated (UTC)", no_wrap=True)
    shown.add_column("active", overflow="fold")
    for row in rows:
        shown.add_row(
            escape(shorten(row.key)),
            escape((row.identity or {}).get("agent_ref", "-")),
            str(row.messages),
            str(row.bytes),
            row.updated_at[:16].replace("T", " "),
            "yes" if row.active else "no",
        )
    return shown


def _holders(rows: list[StoredConversation]) -> None:
    """Under the narrow table: who holds each active conversation, one line each."""
    for row in rows:
        if row.active and row.reservation:
            held = row.reservation
            console.print(
                f"{escape(shorten(row.key))} is held by pid {held.get('pid')} on "
                f"{escape(str(held.get('host')))} since {str(held.get('since'))[:16]}",
                highlight=False,
            )


def shorten(key: str, width: int = KEY_SHOWN) -> str:
    """``key`` cut to ``width`` characters by an ellipsis in the middle: its start (the
    namespace's part) and its end (which tells keys of one namespace apart)."""
    if len(key) <= width:
        return key
    head = width // 2
    return f"{key[:head]}{ELLIPSIS}{key[len(key) - (width - 1 - head) :]}"


async def _resolve(store: HistoryAdmin, key: str) -> str:
    """The whole key of ``key``, which may be shortened as ``ls`` shows it; exits 1
    when a short form names no conversation, or several."""
    if ELLIPSIS not in key:
        return key
    head, _, tail = key.partition(ELLIPSIS)
    keys = [row.key for row in await store.list(purge=False)]
    if key in keys:  # a session key of the application's may hold an ellipsis itself
        return key
    found = [
        k
        for k in keys
        if len(k) >= len(head) + len(tail) and k.startswith(head) and k.endswith(tail)
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        errors.print(f"[bold red]no conversation {escape(key)}[/] (absent or expired)")
    else:
        errors.print(
            f"[bold red]{escape(key)} names {len(found)} conversations[/]: give the whole key "
            "(`touba history ls --wide`)"
        )
    raise typer.Exit(1)


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
        nonlocal key
        async with _open(target, read_only=True) as store:
            key = await _resolve(store, key)
            try:
                record = await store.read(key, purge=False)  # purges nothing: read-only
            except DecisionHistoryBusy as e:
                held = await _listed(store, key)
                if held is None or not held.active:
                    raise
                _show_reserved(target, held, raw)
                raise typer.Exit(1) from e
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


async def _listed(store: HistoryAdmin, key: str) -> StoredConversation | None:
    """The listing row of ``key`` (sizes, identity, reservation), or None."""
    for row in await store.list(purge=False):
        if row.key == key:
            return row
    return None


def _recover_hint(target: _Target, key: str) -> str:
    command, masked = recover_command(target.backend, key, table=target.table, prefix=target.prefix)
    note = " (with your password in place of ***)" if masked else ""
    return f"{command}{note}"


def _show_reserved(target: _Target, row: StoredConversation, raw: bool) -> None:
    """``history show`` of a conversation a worker holds: its metadata, the holder,
    and what to run (the record itself is read only once it is free)."""
    reservation = row.reservation or {}
    command = _recover_hint(target, row.key)
    if raw:
        print_json(
            {
                **_row(row),
                "holder_process": process_state(reservation.get("pid"), reservation.get("host")),
                "recover_command": command,
            }
        )
        return
    errors.print(
        f"[bold red]DecisionHistoryBusy[/]: conversation {escape(row.key)} is reserved by a "
        "worker; its messages are shown once it is free"
    )
    for field, value in (row.identity or {}).items():
        console.print(f"[bold]{escape(str(field))}[/]: {escape(str(value))}")
    console.print(
        f"[bold]stored[/]: {row.messages} messages, {row.bytes} stored bytes; updated "
        f"{row.updated_at[:19]}, expires {(row.expires_at or '-')[:19]}"
    )
    console.print("[bold]held by[/]:")
    for line in holder_lines(reservation):
        console.print(f"  {escape(line)}")
    console.print(
        "If that worker is working, wait for it. If it crashed, stop it and check it is "
        "gone, then free the conversation (storage only; it decides nothing about what the "
        "worker did):"
    )
    console.print(f"  {escape(command)}", soft_wrap=True)


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
        nonlocal key
        async with _open(target) as store:
            key = await _resolve(store, key)
            try:
                deleted = await store.delete(key)
            except DecisionHistoryBusy as e:
                errors.print(
                    f"[bold red]{e.code}[/]: conversation {escape(key)} is active: a worker "
                    "holds it (`touba history show` says which). Retry once it finishes. If "
                    "that worker crashed, stop and check it, free the conversation with "
                    f"`{escape(_recover_hint(target, key))}`, then remove it"
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
    """Free a reservation left by a crashed worker (storage only, no business effect).

    Says who holds the conversation first, and exits 1 when nothing holds it."""

    async def held() -> tuple[str, StoredConversation | None]:
        async with _open(target) as store:
            whole = await _resolve(store, key)
            return whole, await _listed(store, whole)

    key, found = target.backend.run(held())
    if found is None or not found.active:
        errors.print(
            f"no reservation on conversation {escape(key)}"
            + (" (no such conversation)" if found is None else "")
            + "; nothing to recover"
        )
        raise typer.Exit(1)
    console.print(f"conversation {escape(key)} is held by:")
    for line in holder_lines(found.reservation or {}):
        console.print(f"  {escape(line)}")
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
        if not freed:  # freed by its worker, or by another operator, meanwhile
            errors.print("no reservation on that key any more; nothing done")
            raise typer.Exit(1)
        console.print("reservation freed")

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


# -- check and repair (issue 27) -----------------------------------------------------------
#
# ``check`` reads only (``read_raw``: the rows as stored, refusing nothing; the store is
# opened read-only and nothing is purged); ``repair`` shows the plan and writes it only
# with ``--yes``, the originals first kept in the export format (JSON Lines, mode 0600,
# a file that does not exist yet).


def _problem_data(problem: RecordProblem) -> dict[str, str]:
    return {"kind": problem.kind, "where": problem.where, "why": problem.why}


def _print_problems(key: str, problems: list[RecordProblem] | tuple[RecordProblem, ...]) -> None:
    console.print(f"[bold]{escape(key)}[/]: {len(problems)} problem(s)", highlight=False)
    for problem in problems:
        console.print(
            f"  {problem.kind}  {escape(problem.where)}: {escape(problem.why)}", highlight=False
        )


async def _raw(store: HistoryAdmin, key: str) -> RawConversation | None:
    reader: RepairableStore = store  # type: ignore[assignment]  # every built-in store
    return await reader.read_raw(key)


@_store_command("check")
def check(
    target: _Target,
    key: Annotated[
        str | None,
        typer.Argument(help="The session key (whole or as `ls` shortens it); or --all."),
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Check every conversation.")] = False,
    raw: JsonOption = False,
) -> None:
    """List the conversations a decision would refuse as damaged, and why (orphan call,
    result without call, duplicated id, unreadable row, head mismatch, ...).

    Reads only: nothing is purged, created or changed. Exits 1 when any problem is
    found; `touba history repair KEY` shows the fix."""
    if (key is None) == (not every):
        errors.print("[bold red]give a KEY or --all[/] (not both)")
        raise typer.Exit(2)

    async def go() -> list[tuple[RawConversation, list[RecordProblem]]]:
        nonlocal key
        async with _open(target, read_only=True) as store:
            if key is not None:
                key = await _resolve(store, key)
                keys = [key]
            else:
                keys = [r.key for r in await store.list(purge=False) if not r.expired]
            found = []
            for one in keys:
                conversation = await _raw(store, one)
                if conversation is not None:
                    found.append((conversation, check_record(conversation)))
        if key is not None and not found:
            errors.print(f"[bold red]no conversation {escape(key)}[/] (absent or expired)")
            raise typer.Exit(1)
        return found

    found = target.backend.run(go())
    damaged = [(c, p) for c, p in found if p]
    if raw:
        print_json(
            {
                "checked": len(found),
                "damaged": len(damaged),
                "conversations": [
                    {
                        "key": c.key,
                        "active": c.active,
                        "problems": [_problem_data(p) for p in problems],
                    }
                    for c, problems in damaged
                ],
            }
        )
    else:
        for conversation, problems in damaged:
            _print_problems(conversation.key, problems)
            if conversation.active:
                console.print("  (reserved now: a decision may be changing it)")
        console.print(f"{len(found)} conversation(s) checked, {len(damaged)} damaged")
        if damaged:
            console.print("repair one with `touba history repair KEY` (it shows the fix first)")
    if damaged:
        raise typer.Exit(1)


def _default_backup(key: str) -> Path:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(f"touba-repair-{digest}-{stamp}.jsonl")


def write_backup(path: Path, plan: RepairPlan) -> None:
    """The plan's originals in the export format, in a new file of mode 0600
    (``FileExistsError`` when ``path`` exists: nothing is overwritten)."""
    lines = export_lines(
        plan, touba_version=touba.__version__, created_at=datetime.now(UTC).isoformat()
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), 0o600)  # whatever the umask
        out.write("".join(line + "\n" for line in lines))


@_store_command("repair")
def repair(
    target: _Target,
    key: Key,
    yes: Annotated[bool, typer.Option("--yes", help="Apply the repair shown.")] = False,
    backup: Annotated[
        Path | None,
        typer.Option(
            "--backup",
            help="Where to keep the originals (export format, mode 0600; a new file). "
            "Default: touba-repair-<key digest>-<UTC time>.jsonl here.",
        ),
    ] = None,
) -> None:
    """Show the smallest fix of a damaged conversation; apply it only with --yes.

    An orphan call is answered with an error result "not run: repaired"; a result
    without its call, an unreadable row and later copies of a duplicated id are
    dropped; the head is rebuilt from the rows. With --yes the originals are written
    first to the backup file (export format), then the repair, under a reservation
    (refused while a worker holds the conversation). Exits 1 when nothing was
    applied (no --yes, cannot be repaired, busy)."""

    async def plan_of() -> RepairPlan | None:
        nonlocal key
        async with _open(target, read_only=not yes) as store:
            key = await _resolve(store, key)
            conversation = await _raw(store, key)
        return None if conversation is None else plan_repair(conversation)

    plan = target.backend.run(plan_of())
    if plan is None:
        errors.print(f"[bold red]no conversation {escape(key)}[/] (absent or expired)")
        raise typer.Exit(1)
    if not plan.problems:
        console.print(f"conversation {escape(key)} is healthy: nothing to repair")
        return
    _print_problems(key, plan.problems)
    if plan.record is None:
        errors.print(
            f"[bold red]cannot be repaired[/]: {escape(plan.unrepairable or '')} "
            f"(`touba history rm {escape(key)}`)"
        )
        raise typer.Exit(1)
    console.print(
        f"repair: {len(plan.removed_rows)} row(s) dropped or changed, {plan.added} result(s) "
        "added, the head rebuilt from the rows"
    )
    if not yes:
        console.print("not applied: run again with --yes to apply it")
        raise typer.Exit(1)
    path = backup if backup is not None else _default_backup(key)
    try:
        write_backup(path, plan)
    except OSError as e:
        errors.print(
            f"[bold red]cannot write the backup {escape(str(path))}[/] ({type(e).__name__}: "
            f"{escape(e.strerror or '')}); nothing was repaired. Give another --backup FILE"
        )
        raise typer.Exit(1) from e
    console.print(f"originals kept in {escape(str(path))}", highlight=False)

    async def apply() -> None:
        async with _open(target) as store:
            writer: RepairableStore = store  # type: ignore[assignment]
            await writer.repair(plan)

    try:
        target.backend.run(apply())
    except DecisionHistoryBusy as e:
        errors.print(f"[bold red]{e.code}[/]: {escape(str(e))}")
        raise typer.Exit(1) from e
    event = plan.event()
    logger.info("history_repaired %s", json.dumps(event.to_dict(), sort_keys=True))
    console.print(
        f"repaired: {event.count} problem(s) fixed ({event.repaired_kinds}); the "
        "conversation now passes the window check",
        highlight=False,
    )
