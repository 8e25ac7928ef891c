"""``touba copy``: every decision history of one store into another (SQLite, PostgreSQL, Redis).

- The source is opened as the read-only commands open a store (it must exist and be
  a touba history store; nothing in it changes). The target may be new: a missing
  SQLite file is created (0600), a missing PostgreSQL table created, an empty Redis
  prefix written to; stderr says which.
- The target is opened with the limits and TTL the options give (the store's defaults
  otherwise, as an application would): pass your application's, since a copy is
  refused, conversation by conversation, where they would be exceeded. Its
  ``worker_id`` is :func:`touba.data.copy_worker_id`, so a rerun recovers the
  reservations of a copy that was killed.
- A progress bar on a terminal (stderr), then a summary table; keys of the
  conversations not copied are listed, never content. ``--verify`` compares every
  conversation afterwards. Exit 1 when a conversation was left out (conflict, refusal,
  busy, unreadable) or verify finds a mismatch; active conversations skipped on purpose
  do not fail the command.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import (
    JsonOption,
    console,
    errors,
    print_json,
    print_table,
    progress,
    run,
    table,
)
from touba.cli._stores import (
    Backend,
    _driver_errors,
    _opened,
    _opening,
    check_store,
    choose_backend,
    only_with,
    open_history,
)
from touba.data import CopyReport, Stores, VerifyReport, copy_stores, copy_worker_id, verify_copy
from touba.history._common import MiB
from touba.history._store import AdminStore

__all__ = ["copy"]

_DEFAULT_TABLE = "touba_history"
_DEFAULT_PREFIX = "touba:"

FromDb = Annotated[Path | None, typer.Option("--from-db", help="The source SQLite history file.")]
FromDsn = Annotated[
    str | None, typer.Option("--from-dsn", help="The source PostgreSQL DSN.", show_default=False)
]
FromRedis = Annotated[str | None, typer.Option("--from-redis-url", help="The source Redis URL.")]
FromTable = Annotated[
    str | None, typer.Option("--from-table", help="With --from-dsn: the table (touba_history).")
]
FromPrefix = Annotated[
    str | None, typer.Option("--from-prefix", help="With --from-redis-url: the prefix ('touba:').")
]
ToDb = Annotated[
    Path | None, typer.Option("--to-db", help="The target SQLite file (created 0600 if missing).")
]
ToDsn = Annotated[
    str | None,
    typer.Option("--to-dsn", help="The target PostgreSQL DSN (table created if missing)."),
]
ToRedis = Annotated[str | None, typer.Option("--to-redis-url", help="The target Redis URL.")]
ToTable = Annotated[
    str | None, typer.Option("--to-table", help="With --to-dsn: the table (touba_history).")
]
ToPrefix = Annotated[
    str | None, typer.Option("--to-prefix", help="With --to-redis-url: the prefix ('touba:').")
]


def copy(
    from_db: FromDb = None,
    from_dsn: FromDsn = None,
    from_redis_url: FromRedis = None,
    from_table: FromTable = None,
    from_prefix: FromPrefix = None,
    to_db: ToDb = None,
    to_dsn: ToDsn = None,
    to_redis_url: ToRedis = None,
    to_table: ToTable = None,
    to_prefix: ToPrefix = None,
    max_sessions: Annotated[
        int, typer.Option("--max-sessions", min=1, help="The target's max_sessions.")
    ] = 128,
    max_store_bytes: Annotated[
        int, typer.Option("--max-store-bytes", min=1, help="The target's max_store_bytes.")
    ] = 32 * MiB,
    ttl_seconds: Annotated[
        float,
        typer.Option("--ttl-seconds", min=1, help="The target's ttl_seconds (from the copy)."),
    ] = 86400,
    verify: Annotated[
        bool, typer.Option("--verify", help="Compare every conversation afterwards.")
    ] = False,
    include_active: Annotated[
        bool,
        typer.Option(
            "--include-active",
            help="Copy the last saved state of reserved conversations, as inactive ones.",
        ),
    ] = False,
    raw: JsonOption = False,
) -> None:
    """Copy every decision history from one store to another: any pair of SQLite
    (--from-db/--to-db), PostgreSQL (--from-dsn/--to-dsn) and Redis
    (--from-redis-url/--to-redis-url).

    Resumable: rerun after an interruption, nothing is doubled and nothing in the
    target is overwritten (a different conversation under the same key is reported
    as a conflict). Active conversations are listed and skipped unless
    --include-active. Exit 1 when a conversation was left out or --verify finds a
    mismatch."""
    source = _side("--from", from_db, from_dsn, from_redis_url, from_table, from_prefix)
    target = _side("--to", to_db, to_dsn, to_redis_url, to_table, to_prefix)
    if source == target:
        errors.print("[bold red]usage[/]: the source and the target are the same store")
        raise typer.Exit(2)
    limits = {
        "max_sessions": max_sessions,
        "max_store_bytes": max_store_bytes,
        "ttl_seconds": ttl_seconds,
    }

    async def go() -> tuple[CopyReport, VerifyReport | None]:
        async with (
            open_history(source[0], table=source[1], prefix=source[2], read_only=True) as src_store,
            _open_target(target, limits) as dst_store,
        ):
            pair = Stores(histories=[src_store]), Stores(histories=[dst_store])
            with progress(total=True) as bar:
                task = bar.add_task("copying conversations", total=None)

                def advance(kind: str, done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                report = await copy_stores(*pair, include_active=include_active, progress=advance)
            checked = await verify_copy(*pair) if verify else None
        return report, checked

    report, checked = _run(source[0], target[0], go())
    if raw:
        print_json({"copy": report, "verify": checked})
    else:
        _summary(report, checked)
    if not report.complete or (checked is not None and not checked.clean):
        raise typer.Exit(1)


Side = tuple[Backend, str | None, str | None]


def _side(
    flag: str,
    db: Path | None,
    dsn: str | None,
    redis_url: str | None,
    name: str | None,
    prefix: str | None,
) -> Side:
    given = [(f"{flag}-db", db), (f"{flag}-dsn", dsn), (f"{flag}-redis-url", redis_url)]
    chosen = [(option, value) for option, value in given if value]
    if len(chosen) != 1:
        choices = f"{flag}-db PATH, {flag}-dsn DSN or {flag}-redis-url URL"
        got = " and ".join(option for option, _ in chosen)
        errors.print(
            f"[bold red]usage[/]: give one store with {choices}" + (f"; got {got}" if got else "")
        )
        raise typer.Exit(2)
    backend = choose_backend(db, dsn, redis_url, redis=True)
    only_with(backend, "postgresql", **{f"{flag[2:]}_table": name})
    only_with(backend, "redis", **{f"{flag[2:]}_prefix": prefix})
    return backend, name, prefix


def _run(
    source: Backend, target: Backend, coroutine: Any
) -> tuple[CopyReport, VerifyReport | None]:
    secrets = tuple(b.address for b in (source, target) if b.kind != "sqlite")
    drivers = _driver_errors(source.kind) + _driver_errors(target.kind)
    result: tuple[CopyReport, VerifyReport | None] = run(
        coroutine, secret=secrets, driver_errors=drivers
    )
    return result


@asynccontextmanager
async def _open_target(target: Side, limits: dict[str, Any]) -> AsyncIterator[AdminStore]:
    """The target store, created if missing (stderr says so), with the copy's worker id."""
    backend, name, prefix = target
    worker = copy_worker_id()
    if backend.kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        existed = await check_store(backend, "history", create=True)
        with _opening(backend, "history store"):
            store: Any = SqliteHistoryStore(backend.address, worker_id=worker, **limits)
        try:
            if not existed:
                errors.print(f"created history store at {escape(backend.shown)} (mode 0600)")
            yield store
        finally:
            await store.close()
        return
    if backend.kind == "postgresql":
        with _opening(backend, "history store"):
            from touba.history.postgres import PostgresHistoryStore

            table_name = name or _DEFAULT_TABLE
            pg = PostgresHistoryStore(
                backend.address, table=table_name, worker_id=worker, create=True, **limits
            )
        existed = await check_store(backend, "history", name=table_name, create=True)
        async with _opened(backend, "history store", pg) as opened:
            if not existed:
                errors.print(
                    f"created history table {escape(table_name)!r} at {escape(backend.shown)}"
                )
            yield opened
        return
    with _opening(backend, "history store"):
        from redis.asyncio import Redis

        from touba.history.redis import RedisHistoryStore

        client = Redis.from_url(backend.address)
    try:
        with _opening(backend, "history store"):
            redis_store = RedisHistoryStore(
                client=client, prefix=prefix or _DEFAULT_PREFIX, worker_id=worker, **limits
            )
            await client.ping()
            empty = await redis_store.is_empty()
        try:
            if empty:
                shown_prefix = escape(prefix or _DEFAULT_PREFIX)
                errors.print(
                    f"writing a new history store under prefix {shown_prefix!r} "
                    f"at {escape(backend.shown)}"
                )
            yield redis_store
        finally:
            await redis_store.close()
    finally:
        await client.aclose()


def _summary(report: CopyReport, checked: VerifyReport | None) -> None:
    shown = table("", "conversations")
    rows = [
        ("copied", report.copied.get("conversation", 0)),
        ("already in the target", report.already.get("conversation", 0)),
        ("active, skipped", len(report.of("active"))),
        ("active, copied inactive", len(report.copied_active)),
        ("expired, not copied", report.expired),
        ("conflicts (left untouched)", len(report.of("conflict"))),
        ("refused by the target", len(report.of("refused"))),
        ("busy in the target", len(report.of("busy"))),
        ("unreadable in the source", len(report.of("unreadable"))),
        ("reservations of a killed copy recovered", len(report.recovered)),
    ]
    for label, count in rows:
        if count or label in ("copied", "already in the target"):
            shown.add_row(label, str(count))
    print_table(shown, whole=True)
    console.print(f"{report.bytes / MiB:.1f} MiB written")
    for issue in report.issues:
        detail = f" ({issue.code})" if issue.code else ""
        console.print(f"{issue.reason}: {escape(issue.key)}{escape(detail)}")
    if checked is None:
        return
    source_count, target_count = checked.counts.get("conversation", (0, 0))
    state = "clean" if checked.clean else f"{len(checked.mismatches)} mismatch(es)"
    console.print(
        f"verify: {state}; {checked.matched} of {source_count} conversation(s) equal "
        f"(target holds {target_count})"
        + (f", {len(checked.active)} active not copied" if checked.active else "")
    )
    for mismatch in checked.mismatches:
        console.print(f"{mismatch.reason}: {escape(mismatch.key)}")
