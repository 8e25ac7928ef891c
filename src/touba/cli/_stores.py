"""Which store a command works on: SQLite (``--db``), PostgreSQL (``--dsn``) or Redis.

- Exactly one backend per command: ``--db PATH``, ``--dsn DSN`` (default
  ``$TOUBA_DSN``) or, for ``touba history``, ``--redis-url URL``. None, or
  more than one, is a usage error (exit 2) naming the options; ``TOUBA_DSN``
  counts as ``--dsn``, so with it set a ``--db`` is refused, not guessed.
- ``--table`` (PostgreSQL history), ``--prefix`` (Redis history, PostgreSQL
  memory) name the store as the application's constructor does; they are
  refused with another backend rather than ignored.
- Administration commands never create a store: a missing SQLite file or
  missing touba tables in PostgreSQL is an error (exit 1) and nothing is
  created. ``touba chat`` creates its memory store, as a session would.
- A store that cannot be opened (server unreachable, bad credentials, bad
  DSN) is one line naming it by its redacted address; no password is printed
  (:func:`touba.cli._common.redact`), whatever the driver's message quotes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypedDict, TypeVar, Unpack

import typer
from rich.markup import escape

from touba.cli._common import errors, run, scrub
from touba.cli._common import redact as redact_address
from touba.errors import ToubaError
from touba.history._store import AdminStore
from touba.memory import MemoryStore, SqliteMemoryStore

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = [
    "DSN_ENV",
    "Backend",
    "DsnOption",
    "HistoryAdmin",
    "Kind",
    "Limits",
    "RedisUrlOption",
    "choose_backend",
    "memory_table",
    "only_with",
    "open_history",
    "open_memory",
    "postgres_connection",
]

T = TypeVar("T")
Kind = Literal["sqlite", "postgresql", "redis"]
DSN_ENV = "TOUBA_DSN"
_OPEN_TIMEOUT = 10
_NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "redis": "Redis"}

DsnOption = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        envvar=DSN_ENV,
        show_envvar=True,
        help="A PostgreSQL connection string: postgresql://user@host:5432/db or "
        "'host=... dbname=...' (instead of --db).",
    ),
]
RedisUrlOption = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        help="The URL of a Redis history store, redis://host:6379/0 (instead of --db).",
    ),
]


@dataclass(frozen=True, slots=True)
class Backend:
    """The one store a command was given: its kind and its address (path, DSN or URL)."""

    kind: Kind
    address: str

    @property
    def shown(self) -> str:
        """The address as it may be printed: a DSN or URL without its password."""
        return self.address if self.kind == "sqlite" else redact_address(self.address)

    @property
    def name(self) -> str:
        return _NAMES[self.kind]

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """:func:`touba.cli._common.run`, masking this address's secrets in any error."""
        secrets = () if self.kind == "sqlite" else (self.address,)
        return run(coroutine, secret=secrets, driver_errors=_driver_errors(self.kind))


def _driver_errors(kind: Kind) -> tuple[type[Exception], ...]:
    """The driver's exceptions that a store lets through during use (printed, not traced)."""
    try:
        if kind == "postgresql":
            import psycopg

            return (psycopg.Error,)
        if kind == "redis":
            from redis.exceptions import RedisError

            return (RedisError,)
    except ImportError:  # the extra is missing: opening the store says so
        pass
    return ()


def _usage(message: str) -> typer.Exit:
    errors.print(f"[bold red]usage[/]: {message}")
    return typer.Exit(2)


def choose_backend(
    db: Path | None, dsn: str | None, redis_url: str | None = None, *, redis: bool = False
) -> Backend:
    """The backend of ``--db``, ``--dsn`` (or ``TOUBA_DSN``) and, if ``redis``,
    ``--redis-url``; exits with status 2 unless exactly one is given."""
    from_env = dsn is not None and os.environ.get(DSN_ENV) == dsn
    dsn_name = f"--dsn ({DSN_ENV} is set)" if from_env else "--dsn"
    offered: list[tuple[str, str, Kind, str | None]] = [
        ("--db PATH (SQLite)", "--db", "sqlite", None if db is None else str(db)),
        (f"--dsn DSN or {DSN_ENV} (PostgreSQL)", dsn_name, "postgresql", dsn),
    ]
    if redis:
        offered.append(("--redis-url URL (Redis)", "--redis-url", "redis", redis_url))
    given = [(name, kind, value) for _, name, kind, value in offered if value]
    if len(given) == 1:
        _, kind, value = given[0]
        return Backend(kind, value)
    choices = ", ".join(option for option, *_ in offered[:-1]) + f" or {offered[-1][0]}"
    if not given:
        raise _usage(f"give the store: {choices}")
    names = " and ".join(name for name, _, _ in given)
    raise _usage(f"give only one store ({choices}); got {names}")


def only_with(backend: Backend, kind: Kind, **options: object) -> None:
    """Refuse an option given for another backend (``--table`` with ``--db``, ...)."""
    for option, value in options.items():
        if value is not None and backend.kind != kind:
            flag = "--" + option.replace("_", "-")
            raise _usage(f"{flag} applies to a {_NAMES[kind]} store only")


# -- opening -------------------------------------------------------------------------------


@contextmanager
def _opening(backend: Backend, what: str) -> Iterator[None]:
    """One clear line, with the redacted address, when a store cannot be opened."""
    failures: tuple[type[Exception], ...] = (ToubaError, OSError, ValueError)
    failures += _driver_errors(backend.kind)
    try:
        yield
    except ImportError as e:  # the backend's extra is not installed
        errors.print(f"[bold red]{escape(str(e))}[/]")
        raise typer.Exit(2) from e
    except failures as e:
        reason = scrub(str(e), (backend.address,)).strip()
        errors.print(
            f"[bold red]cannot open the {what} at {escape(backend.shown)}[/] "
            f"({backend.name}): {escape(reason)}"
        )
        raise typer.Exit(1) from e


def _parts(name: str) -> list[str]:
    """``name`` or ``schema.name`` (validated by the store's constructor) as parts."""
    return name.split(".")


@asynccontextmanager
async def postgres_connection(dsn: str) -> AsyncIterator[AsyncConnection[Any]]:
    """One short-lived connection (autocommit), failing fast when the server is away."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    options: dict[str, Any] = {}
    if "connect_timeout" not in conninfo_to_dict(dsn):
        options["connect_timeout"] = _OPEN_TIMEOUT
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, **options)
    try:
        yield conn
    finally:
        await conn.close()


async def _has_table(dsn: str, parts: list[str]) -> bool:
    from psycopg import sql

    async with postgres_connection(dsn) as conn:
        name = sql.Identifier(*parts).as_string(conn)
        cur = await conn.execute("SELECT to_regclass(%s)", (name,))
        row = await cur.fetchone()
    return row is not None and row[0] is not None


async def _has_meta_table(dsn: str, name: str) -> bool:
    """Whether the PostgreSQL store of table (or table prefix) ``name``, maybe
    ``schema.name``, exists: both stores keep a ``<name>_meta`` table."""
    *schema, last = _parts(name)
    return await _has_table(dsn, [*schema, f"{last}_meta"])


class _Openable(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...


_S = TypeVar("_S", bound=_Openable)


@asynccontextmanager
async def _opened(backend: Backend, what: str, store: _S) -> AsyncIterator[_S]:
    """``store``, opened (a failure reported by :func:`_opening`), closed on exit."""
    try:
        with _opening(backend, what):
            await store.open()
        yield store
    finally:
        await store.close()


def _missing(what: str, place: str, backend: Backend, option: str) -> typer.Exit:
    errors.print(
        f"[bold red]no {what} {escape(place)} at {escape(backend.shown)}[/]: nothing was "
        f"created; check --dsn and {option}"
    )
    return typer.Exit(1)


class Limits(TypedDict, total=False):
    """The limits an application gives its history store (the store's defaults if absent)."""

    max_sessions: int
    max_store_bytes: int


HistoryAdmin = AdminStore
"""What ``touba history`` needs of a built-in history store."""


@asynccontextmanager
async def open_history(
    backend: Backend,
    *,
    table: str | None = None,
    prefix: str | None = None,
    **limits: Unpack[Limits],
) -> AsyncIterator[HistoryAdmin]:
    """Open an existing history store (never create one by mistake), closed on exit.

    ``limits`` (``max_sessions``, ``max_store_bytes``) are the application's, for
    ``store.usage()``; the store's defaults otherwise.
    """
    if backend.kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        path = Path(backend.address)
        if not await asyncio.to_thread(path.is_file):
            errors.print(f"[bold red]no history database at {escape(str(path))}[/]")
            raise typer.Exit(1)
        async with SqliteHistoryStore(path, **limits) as sqlite_store:
            yield sqlite_store
    elif backend.kind == "postgresql":
        with _opening(backend, "history store"):
            from touba.history.postgres import PostgresHistoryStore

            name = table or "touba_history"
            store = PostgresHistoryStore(backend.address, table=name, **limits)
            found = await _has_meta_table(backend.address, name)
        if not found:
            raise _missing("touba history table", repr(name), backend, "--table")
        async with _opened(backend, "history store", store) as pg_store:
            yield pg_store
    else:
        async with _open_redis_history(backend, prefix or "touba:", limits) as redis_store:
            yield redis_store


@asynccontextmanager
async def _open_redis_history(
    backend: Backend, prefix: str, limits: Limits
) -> AsyncIterator[HistoryAdmin]:
    with _opening(backend, "history store"):
        # A client of our own, pinged first, so an unreachable server fails here.
        from redis.asyncio import Redis

        from touba.history.redis import RedisHistoryStore  # first: it names the extra

        client = Redis.from_url(backend.address)
    try:
        with _opening(backend, "history store"):
            store = RedisHistoryStore(client=client, prefix=prefix, **limits)
            await client.ping()
        try:
            yield store
        finally:
            await store.close()
    finally:
        await client.aclose()


@asynccontextmanager
async def open_memory(
    backend: Backend, *, prefix: str | None = None, create: bool = False
) -> AsyncIterator[MemoryStore]:
    """Open a memory store, closed on exit; an absent one is an error unless ``create``."""
    if backend.kind == "sqlite":
        path = Path(backend.address)
        if not create and not await asyncio.to_thread(path.is_file):
            errors.print(f"[bold red]no memory database at {escape(str(path))}[/]")
            raise typer.Exit(1)
        async with SqliteMemoryStore(path) as sqlite_store:
            yield sqlite_store
        return
    with _opening(backend, "memory store"):
        from touba.memory.postgres import PostgresMemoryStore

        name = prefix or "touba_memory"
        store = PostgresMemoryStore(backend.address, prefix=name)
        found = create or await _has_meta_table(backend.address, name)
    if not found:
        raise _missing("touba memory tables with prefix", repr(name), backend, "--prefix")
    async with _opened(backend, "memory store", store) as pg_store:
        yield pg_store


def memory_table(prefix: str | None, table: str) -> list[str]:
    """The identifier parts of one table of a PostgreSQL memory store (``events``, ...)."""
    *schema, last = _parts(prefix or "touba_memory")
    return [*schema, f"{last}_{table}"]
