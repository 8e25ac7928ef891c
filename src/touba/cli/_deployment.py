"""Every store of one deployment, from the command line: the ``touba.data.Stores`` that
``touba users`` (and the other commands over a user's data) work on.

- Memory: ``--db PATH`` or ``--dsn DSN`` (``$TOUBA_DSN``), ``--prefix`` with ``--dsn``.
- Decision histories: ``--history-db PATH``, ``--history-dsn DSN`` (``--history-table``)
  or ``--redis-url URL`` (``--history-prefix``), at most one.
- Checkpoints: ``--checkpoints-db PATH`` or ``--checkpoints-dsn DSN`` (table
  ``touba_checkpoints``); resources: ``--resources-db PATH`` or ``--resources-dsn DSN``
  (table ``touba_resources``).

Each is optional, but at least one store must be given (exit 2 otherwise). Nothing is
created: the memory and history stores are opened as :mod:`touba.cli._stores` opens them
(checked first, ``create=False``); a checkpoint or resource file must exist and hold that
kind of store, a PostgreSQL checkpoint or resource table must exist (exit 1, nothing
created). Every address is masked in errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape

from touba._encryption import Encryption
from touba.cli._common import errors, run
from touba.cli._keys import CurrentOption, KeysFileOption, encryption_of
from touba.cli._stores import (
    Backend,
    DsnOption,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    Limits,
    RedisUrlOption,
    choose_backend,
    only_with,
    open_history,
    open_memory,
    postgres_connection,
    store_deadline,
)
from touba.data import Stores
from touba.errors import ToubaError

__all__ = ["DEPLOYMENT_OPTIONS", "Deployment", "deployment", "open_stores"]

T = TypeVar("T")

MemoryDbOption = Annotated[
    Path | None, typer.Option("--db", help="Path of the SQLite memory file.")
]
MemoryPrefixOption = Annotated[
    str | None,
    typer.Option("--prefix", help="With --dsn: the memory store's table prefix (touba_memory)."),
]
CheckpointsDbOption = Annotated[
    Path | None, typer.Option("--checkpoints-db", help="Path of the SQLite checkpoint file.")
]
CheckpointsDsnOption = Annotated[
    str | None,
    typer.Option("--checkpoints-dsn", help="A PostgreSQL DSN of the checkpoint store."),
]
ResourcesDbOption = Annotated[
    Path | None, typer.Option("--resources-db", help="Path of the SQLite resource file.")
]
ResourcesDsnOption = Annotated[
    str | None,
    typer.Option("--resources-dsn", help="A PostgreSQL DSN of the resource binding."),
]

DEPLOYMENT_OPTIONS: dict[str, Any] = {
    "db": MemoryDbOption,
    "dsn": DsnOption,
    "prefix": MemoryPrefixOption,
    "history_db": HistoryDbOption,
    "history_dsn": HistoryDsnOption,
    "history_table": HistoryTableOption,
    "redis_url": RedisUrlOption,
    "history_prefix": HistoryPrefixOption,
    "checkpoints_db": CheckpointsDbOption,
    "checkpoints_dsn": CheckpointsDsnOption,
    "resources_db": ResourcesDbOption,
    "resources_dsn": ResourcesDsnOption,
    "keys_file": KeysFileOption,
    "current": CurrentOption,
}
"""The options of a command over a deployment (for :func:`touba.cli._common.store_command`,
with :func:`deployment` as its target)."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """The stores a command was given (each None when not given)."""

    memory: Backend | None = None
    prefix: str | None = None
    history: Backend | None = None
    history_table: str | None = None
    history_prefix: str | None = None
    checkpoints: Backend | None = None
    resources: Backend | None = None
    encryption: Encryption | None = None
    """Given to every store opened (``--keys-file``, ``--current``); None: not encrypted."""

    def backends(self) -> list[Backend]:
        found = (self.memory, self.history, self.checkpoints, self.resources)
        return [b for b in found if b is not None]

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """:func:`touba.cli._common.run`, masking every address's secrets in an error."""
        secrets = [b.address for b in self.backends() if b.kind != "sqlite"]
        drivers: tuple[type[BaseException], ...] = ()
        for backend in self.backends():
            try:
                if backend.kind == "postgresql":
                    import psycopg

                    drivers += (psycopg.Error,)
                elif backend.kind == "redis":
                    from redis.exceptions import RedisError

                    drivers += (RedisError,)
            except ImportError:  # the extra is missing: opening the store says so
                pass
        return run(coroutine, secret=secrets, driver_errors=drivers)


def _usage(message: str) -> typer.Exit:
    errors.print(f"[bold red]usage[/]: {message}")
    return typer.Exit(2)


def _one(name: str, offered: list[tuple[str, Backend | None]]) -> Backend | None:
    given = [(option, b) for option, b in offered if b is not None]
    if len(given) > 1:
        raise _usage(f"give at most one {name}; got " + " and ".join(o for o, _ in given))
    return given[0][1] if given else None


def deployment(
    db: Path | None = None,
    dsn: str | None = None,
    prefix: str | None = None,
    history_db: Path | None = None,
    history_dsn: str | None = None,
    history_table: str | None = None,
    redis_url: str | None = None,
    history_prefix: str | None = None,
    checkpoints_db: Path | None = None,
    checkpoints_dsn: str | None = None,
    resources_db: Path | None = None,
    resources_dsn: str | None = None,
    keys_file: Path | None = None,
    current: str | None = None,
) -> Deployment:
    """The stores of these options; exit 2 for a wrong combination or no store at all,
    exit 1 for a refused keys file (:func:`touba.cli._keys.encryption_of`)."""
    memory = None
    if db is not None or dsn is not None:
        memory = choose_backend(db, dsn)
        only_with(memory, "postgresql", prefix=prefix)
    elif prefix is not None:
        raise _usage("--prefix applies to a memory store given with --dsn")
    history = _one(
        "history store",
        [
            ("--history-db", None if history_db is None else Backend("sqlite", str(history_db))),
            ("--history-dsn", None if history_dsn is None else Backend("postgresql", history_dsn)),
            ("--redis-url", None if redis_url is None else Backend("redis", redis_url)),
        ],
    )
    if history_table is not None and (history is None or history.kind != "postgresql"):
        raise _usage("--history-table applies to a history store given with --history-dsn")
    if history_prefix is not None and (history is None or history.kind != "redis"):
        raise _usage("--history-prefix applies to a history store given with --redis-url")
    checkpoints = _one(
        "checkpoint store",
        [
            ("--checkpoints-db", _sqlite(checkpoints_db)),
            ("--checkpoints-dsn", _pg(checkpoints_dsn)),
        ],
    )
    resources = _one(
        "resource binding",
        [("--resources-db", _sqlite(resources_db)), ("--resources-dsn", _pg(resources_dsn))],
    )
    found = Deployment(
        memory, prefix, history, history_table, history_prefix, checkpoints, resources
    )
    if not found.backends():
        raise _usage(
            "give at least one store: --db/--dsn (memory), --history-db/--history-dsn/"
            "--redis-url, --checkpoints-db/--checkpoints-dsn, --resources-db/--resources-dsn"
        )
    encryption = encryption_of(keys_file, current)
    return replace(found, encryption=encryption) if encryption is not None else found


def _sqlite(path: Path | None) -> Backend | None:
    return None if path is None else Backend("sqlite", str(path))


def _pg(dsn: str | None) -> Backend | None:
    return None if dsn is None else Backend("postgresql", dsn)


def _refused(backend: Backend, why: str) -> typer.Exit:
    errors.print(f"[bold red]{escape(backend.shown)}[/]: {escape(why)}")
    return typer.Exit(1)


async def _check_sqlite_kind(backend: Backend, kind: str, what: str) -> None:
    """Refuse a file that is missing or holds no touba ``kind`` store (reads only)."""
    import sqlite3

    from touba.history._files import check_private_location
    from touba.history._sqlite import describe
    from touba.history._sqlite_kinds import sqlite_contents

    path = Path(backend.address)
    if not await asyncio.to_thread(path.exists):
        raise _refused(backend, f"no such file; nothing was created (give the {what} file)")
    try:
        await asyncio.to_thread(check_private_location, path)
        found = await asyncio.to_thread(sqlite_contents, path)
    except (sqlite3.Error, OSError) as e:
        raise _refused(backend, f"this file cannot be read as SQLite ({describe(e)})") from e
    except ToubaError as e:
        raise _refused(backend, e.message) from e
    if kind not in found.kinds:
        raise _refused(backend, f"this SQLite file holds no touba {what}; nothing was changed")


async def _check_pg_table(backend: Backend, table: str, what: str) -> None:
    """Refuse a PostgreSQL database without ``table`` (reads only; nothing created)."""
    try:
        async with postgres_connection(backend.address) as conn:
            row = await (await conn.execute("SELECT to_regclass(%s)", (table,))).fetchone()
    except ToubaError as e:
        raise _refused(backend, e.message) from e
    if row is None or row[0] is None:
        raise _refused(backend, f"no {what} table {table!r} here; nothing was created")


@asynccontextmanager
async def open_stores(target: Deployment) -> AsyncIterator[Stores]:
    """Open every store of ``target`` (none created), closed on exit, as a
    :class:`touba.data.Stores`."""
    async with AsyncExitStack() as stack:
        memory = None
        if target.memory is not None:
            memory = await stack.enter_async_context(
                open_memory(target.memory, prefix=target.prefix, encryption=target.encryption)
            )
        keyed: Limits = {} if target.encryption is None else {"encryption": target.encryption}
        histories = []
        if target.history is not None:
            histories.append(
                await stack.enter_async_context(
                    open_history(
                        target.history,
                        table=target.history_table,
                        prefix=target.history_prefix,
                        **keyed,
                    )
                )
            )
        checkpoints: Any = None
        if target.checkpoints is not None:
            checkpoints = await _open_checkpoints(stack, target.checkpoints, target.encryption)
        resources: Any = None
        if target.resources is not None:
            resources = await _open_resources(stack, target.resources, target.encryption)
        yield Stores(
            memory=memory, histories=tuple(histories), checkpoints=checkpoints, resources=resources
        )


async def _open_checkpoints(
    stack: AsyncExitStack, backend: Backend, encryption: Encryption | None
) -> Any:
    if backend.kind == "sqlite":
        from touba.runtime import SqliteCheckpointStore

        await _check_sqlite_kind(backend, "checkpoint", "checkpoint store")
        return await stack.enter_async_context(
            SqliteCheckpointStore(backend.address, encryption=encryption)
        )
    from touba.runtime import PostgresCheckpointStore

    await _check_pg_table(backend, "touba_checkpoints", "checkpoint")
    store = PostgresCheckpointStore(
        backend.address, encryption=encryption, deadline_seconds=store_deadline()
    )
    stack.push_async_callback(store.close)
    await store.open()
    return store


async def _open_resources(
    stack: AsyncExitStack, backend: Backend, encryption: Encryption | None
) -> Any:
    if backend.kind == "sqlite":
        from touba.runtime import SqliteResourceBinding

        await _check_sqlite_kind(backend, "resource", "resource binding")
        return await stack.enter_async_context(
            SqliteResourceBinding(backend.address, encryption=encryption)
        )
    from touba.runtime import PostgresResourceBinding

    await _check_pg_table(backend, "touba_resources", "resource")
    binding = PostgresResourceBinding(
        backend.address, encryption=encryption, deadline_seconds=store_deadline()
    )
    stack.push_async_callback(binding.close)
    await binding.open()
    return binding
