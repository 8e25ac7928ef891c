"""``touba copy``: a deployment's stores into others (SQLite, PostgreSQL, Redis).

- Decision histories: ``--from-db | --from-dsn | --from-redis-url`` to ``--to-db |
  --to-dsn | --to-redis-url``; the memory store (``--from-memory-db | --from-memory-dsn``
  to ``--to-memory-db | --to-memory-dsn``) and the checkpoint store
  (``--from-checkpoints-db | --from-checkpoints-dsn`` to ``--to-checkpoints-...``) when
  given. Each kind is given on both sides or on neither (exit 2), and at least one.

- The source is opened as the read-only commands open a store (it must exist and be
  a touba store of its kind; nothing in it changes). The target may be new: a missing
  SQLite file is created (0600), missing PostgreSQL tables created, an empty Redis
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

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba._encryption import Encryption
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
from touba.cli._deployment import _open_checkpoints
from touba.cli._keys import encryption_of
from touba.cli._stores import (
    Backend,
    Limits,
    _driver_errors,
    _opened,
    _opening,
    check_store,
    choose_backend,
    only_with,
    open_history,
    open_memory,
    postgres_connection,
    store_deadline,
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
FromMemoryDb = Annotated[
    Path | None, typer.Option("--from-memory-db", help="The source SQLite memory file.")
]
FromMemoryDsn = Annotated[
    str | None, typer.Option("--from-memory-dsn", help="The source memory store's DSN.")
]
FromMemoryPrefix = Annotated[
    str | None,
    typer.Option("--from-memory-prefix", help="With --from-memory-dsn: the prefix (touba_memory)."),
]
ToMemoryDb = Annotated[
    Path | None, typer.Option("--to-memory-db", help="The target SQLite memory file.")
]
ToMemoryDsn = Annotated[
    str | None, typer.Option("--to-memory-dsn", help="The target memory store's DSN.")
]
ToMemoryPrefix = Annotated[
    str | None,
    typer.Option("--to-memory-prefix", help="With --to-memory-dsn: the prefix (touba_memory)."),
]
FromCheckpointsDb = Annotated[
    Path | None, typer.Option("--from-checkpoints-db", help="The source SQLite checkpoint file.")
]
FromCheckpointsDsn = Annotated[
    str | None, typer.Option("--from-checkpoints-dsn", help="The source checkpoint store's DSN.")
]
ToCheckpointsDb = Annotated[
    Path | None, typer.Option("--to-checkpoints-db", help="The target SQLite checkpoint file.")
]
ToCheckpointsDsn = Annotated[
    str | None, typer.Option("--to-checkpoints-dsn", help="The target checkpoint store's DSN.")
]
FromKeysFile = Annotated[
    Path | None,
    typer.Option(
        "--from-keys-file",
        help="The source's keys file, when it is encrypted (as --keys-file elsewhere).",
    ),
]
FromCurrent = Annotated[
    str | None, typer.Option("--from-current", help="With --from-keys-file: the current key id.")
]
ToKeysFile = Annotated[
    Path | None,
    typer.Option(
        "--to-keys-file", help="The target's keys file: its new rows are sealed with them."
    ),
]
ToCurrent = Annotated[
    str | None,
    typer.Option("--to-current", help="With --to-keys-file: the key id new rows are sealed with."),
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
    from_memory_db: FromMemoryDb = None,
    from_memory_dsn: FromMemoryDsn = None,
    from_memory_prefix: FromMemoryPrefix = None,
    to_memory_db: ToMemoryDb = None,
    to_memory_dsn: ToMemoryDsn = None,
    to_memory_prefix: ToMemoryPrefix = None,
    from_checkpoints_db: FromCheckpointsDb = None,
    from_checkpoints_dsn: FromCheckpointsDsn = None,
    to_checkpoints_db: ToCheckpointsDb = None,
    to_checkpoints_dsn: ToCheckpointsDsn = None,
    from_keys_file: FromKeysFile = None,
    from_current: FromCurrent = None,
    to_keys_file: ToKeysFile = None,
    to_current: ToCurrent = None,
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
    (--from-redis-url/--to-redis-url); with --from-memory-... / --to-memory-... and
    --from-checkpoints-... / --to-checkpoints-..., the memory and checkpoint stores too.

    Resumable: rerun after an interruption, nothing is doubled and nothing in the
    target is overwritten (a different conversation under the same key is reported
    as a conflict). Active conversations are listed and skipped unless
    --include-active. Exit 1 when a conversation was left out or --verify finds a
    mismatch."""
    source: Side | None = None
    target: Side | None = None
    history_options = (from_db, from_dsn, from_redis_url, to_db, to_dsn, to_redis_url)
    if any(v is not None for v in history_options):
        source = _side("--from", from_db, from_dsn, from_redis_url, from_table, from_prefix)
        target = _side("--to", to_db, to_dsn, to_redis_url, to_table, to_prefix)
    memory = _pair(
        "memory",
        (from_memory_db, from_memory_dsn, from_memory_prefix),
        (to_memory_db, to_memory_dsn, to_memory_prefix),
    )
    checkpoints = _pair(
        "checkpoints",
        (from_checkpoints_db, from_checkpoints_dsn, None),
        (to_checkpoints_db, to_checkpoints_dsn, None),
    )
    if source is None and memory is None and checkpoints is None:
        raise _usage(
            "give the stores to copy: --from-db PATH, --from-dsn DSN or --from-redis-url URL "
            "and a --to-... store (and/or --from-memory-... / --from-checkpoints-... pairs)"
        )
    if source is not None and source == target:
        raise _usage("the source and the target are the same store")
    for other in (memory, checkpoints):
        if other is not None and other[0] == other[1]:
            raise _usage("the source and the target are the same store")
    src_keys = encryption_of(
        from_keys_file,
        from_current,
        keys_option="--from-keys-file",
        current_option="--from-current",
    )
    dst_keys = encryption_of(
        to_keys_file, to_current, keys_option="--to-keys-file", current_option="--to-current"
    )
    limits: dict[str, Any] = {
        "max_sessions": max_sessions,
        "max_store_bytes": max_store_bytes,
        "ttl_seconds": ttl_seconds,
    }
    src_limits: Limits = {}
    if src_keys is not None:
        src_limits["encryption"] = src_keys
    if dst_keys is not None:
        limits["encryption"] = dst_keys

    async def go() -> tuple[CopyReport, VerifyReport | None]:
        async with AsyncExitStack() as stack:
            src, dst = Stores(), Stores()
            if source is not None and target is not None:
                src_store = await stack.enter_async_context(
                    open_history(
                        source[0],
                        table=source[1],
                        prefix=source[2],
                        read_only=True,
                        **src_limits,
                    )
                )
                dst_store = await stack.enter_async_context(_open_target(target, limits))
                src, dst = Stores(histories=[src_store]), Stores(histories=[dst_store])
            if memory is not None:
                (mem_from, mem_from_prefix), (mem_to, mem_to_prefix) = memory
                src = dataclasses.replace(
                    src,
                    memory=await stack.enter_async_context(
                        open_memory(
                            mem_from, prefix=mem_from_prefix, read_only=True, encryption=src_keys
                        )
                    ),
                )
                dst = dataclasses.replace(
                    dst,
                    memory=await stack.enter_async_context(
                        open_memory(mem_to, prefix=mem_to_prefix, create=True, encryption=dst_keys)
                    ),
                )
            if checkpoints is not None:
                (cp_from, _), (cp_to, _) = checkpoints
                src = dataclasses.replace(
                    src, checkpoints=await _open_checkpoints(stack, cp_from, src_keys)
                )
                dst = dataclasses.replace(
                    dst, checkpoints=await _target_checkpoints(stack, cp_to, dst_keys)
                )
            with progress(total=True) as bar:
                task = bar.add_task("copying", total=None)

                def advance(kind: str, done: int, total: int) -> None:
                    what = "conversations" if kind == "conversation" else "memory and checkpoints"
                    bar.update(
                        task, description=f"copying {what}", completed=done, total=total or None
                    )

                report = await copy_stores(
                    src, dst, include_active=include_active, progress=advance
                )
            checked = await verify_copy(src, dst) if verify else None
        return report, checked

    report, checked = _run(_backends(source, target, memory, checkpoints), go())
    if raw:
        print_json({"copy": report, "verify": checked})
    else:
        _summary(report, checked)
    if not report.complete or (checked is not None and not checked.clean):
        raise typer.Exit(1)


Side = tuple[Backend, str | None, str | None]
Pair = tuple[tuple[Backend, str | None], tuple[Backend, str | None]]


def _usage(message: str) -> typer.Exit:
    errors.print(f"[bold red]usage[/]: {message}")
    return typer.Exit(2)


def _pair(
    what: str,
    source: tuple[Path | None, str | None, str | None],
    target: tuple[Path | None, str | None, str | None],
) -> Pair | None:
    """The source and target of one more kind of store (``--from-memory-db`` ...), or None."""
    sides: list[tuple[Backend | None, str | None]] = []
    for flag, (db, dsn, prefix) in ((f"--from-{what}", source), (f"--to-{what}", target)):
        if db is not None and dsn:
            raise _usage(f"give one of {flag}-db and {flag}-dsn, not both")
        if prefix is not None and not dsn:
            raise _usage(f"{flag}-prefix applies to {flag}-dsn only")
        backend = None
        if db is not None:
            backend = Backend("sqlite", str(db))
        elif dsn:
            backend = Backend("postgresql", dsn)
        sides.append((backend, prefix))
    (src, src_prefix), (dst, dst_prefix) = sides
    if src is None and dst is None:
        return None
    if src is None or dst is None:
        raise _usage(f"give the {what} store on both sides (--from-{what}-... and --to-{what}-...)")
    return (src, src_prefix), (dst, dst_prefix)


def _backends(source: Side | None, target: Side | None, *pairs: Pair | None) -> list[Backend]:
    found = [side[0] for side in (source, target) if side is not None]
    for pair in pairs:
        if pair is not None:
            found += [pair[0][0], pair[1][0]]
    return found


async def _target_checkpoints(
    stack: AsyncExitStack, backend: Backend, encryption: Encryption | None
) -> Any:
    """The target checkpoint store, created if missing (stderr says so)."""
    if backend.kind == "sqlite":
        from touba.runtime import SqliteCheckpointStore

        existed = await asyncio.to_thread(Path(backend.address).exists)
        with _opening(backend, "checkpoint store"):
            store: Any = SqliteCheckpointStore(backend.address, encryption=encryption)
        stack.push_async_callback(store.close)
        if not existed:
            errors.print(f"created checkpoint store at {escape(backend.shown)} (mode 0600)")
        return store
    from touba.runtime import PostgresCheckpointStore

    with _opening(backend, "checkpoint store"):
        async with postgres_connection(backend.address) as conn:
            cursor = await conn.execute("SELECT to_regclass('touba_checkpoints') IS NOT NULL")
            row = await cursor.fetchone()
        pg = PostgresCheckpointStore(
            backend.address, encryption=encryption, deadline_seconds=store_deadline()
        )
        stack.push_async_callback(pg.close)
        await pg.open()
    if not (row and row[0]):
        errors.print(f"created checkpoint table 'touba_checkpoints' at {escape(backend.shown)}")
    return pg


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
        raise _usage(f"give one store with {choices}" + (f"; got {got}" if got else ""))
    backend = choose_backend(db, dsn, redis_url, redis=True)
    only_with(backend, "postgresql", **{f"{flag[2:]}_table": name})
    only_with(backend, "redis", **{f"{flag[2:]}_prefix": prefix})
    return backend, name, prefix


def _run(backends: list[Backend], coroutine: Any) -> tuple[CopyReport, VerifyReport | None]:
    secrets = tuple(b.address for b in backends if b.kind != "sqlite")
    drivers: tuple[type[Exception], ...] = ()
    for kind in sorted({b.kind for b in backends}):
        drivers += _driver_errors(kind)
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
                backend.address,
                table=table_name,
                worker_id=worker,
                create=True,
                deadline_seconds=store_deadline(),
                **limits,
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
    others = sorted(set(report.copied) - {"conversation"})
    if others:
        kinds = table("records", "copied", "already in the target")
        for kind in others:
            kinds.add_row(kind, str(report.copied[kind]), str(report.already.get(kind, 0)))
        print_table(kinds, whole=True)
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
    console.print(f"{report.bytes:,} bytes of conversations written")
    for issue in report.issues:
        detail = f" ({issue.code})" if issue.code else ""
        kind = "" if issue.kind == "conversation" else f"{issue.kind} "
        console.print(f"{issue.reason}: {escape(kind + issue.key)}{escape(detail)}")
    if checked is None:
        return
    source_count = sum(mine for mine, _ in checked.counts.values())
    target_count = sum(theirs for _, theirs in checked.counts.values())
    state = "clean" if checked.clean else f"{len(checked.mismatches)} mismatch(es)"
    console.print(
        f"verify: {state}; {checked.matched} of {source_count} record(s) equal "
        f"(target holds {target_count})"
        + (f", {len(checked.active)} active not copied" if checked.active else "")
    )
    for mismatch in checked.mismatches:
        kind = "" if mismatch.kind == "conversation" else f"{mismatch.kind} "
        console.print(f"{mismatch.reason}: {escape(kind + mismatch.key)}")
