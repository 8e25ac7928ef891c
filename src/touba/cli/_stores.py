"""Which store a command works on: SQLite (``--db``), PostgreSQL (``--dsn``) or Redis.

- Exactly one backend per command: ``--db PATH``, ``--dsn DSN`` (default
  ``$TOUBA_DSN``) or, for ``touba history``, ``--redis-url URL``. None, or
  more than one, is a usage error (exit 2) naming the options; ``TOUBA_DSN``
  counts as ``--dsn``, so with it set a ``--db`` is refused, not guessed.
- ``--table`` (PostgreSQL history), ``--prefix`` (Redis history, PostgreSQL
  memory) name the store as the application's constructor does; they are
  refused with another backend rather than ignored.
- Administration commands never create a store: a missing SQLite file or
  missing touba tables in PostgreSQL, or a Redis prefix that holds no key of a
  history store, is an error (exit 1) and nothing is created; they open the
  store with ``create=False`` too. ``touba chat`` creates its memory store, as a
  session would, and says so on stderr ("created memory store at ...").
- Every command first checks, reading only (:mod:`touba.cli._kinds`), that its
  store is a touba store of the expected kind, and refuses (exit 1, one line
  saying what it found) another kind of touba store or another application's
  database, before anything opens it. A command that only reads
  (``read_only``) also refuses a store that opening would migrate or whose
  file mode it would reset, so it changes no byte and no mode.
- A store that cannot be opened (server unreachable, bad credentials, bad
  DSN) is one line naming it by its redacted address; no password is printed
  (:func:`touba.cli._common.redact`), whatever the driver's message quotes.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypedDict, TypeVar, Unpack

import typer
from rich.markup import escape

from touba.cli._common import errors, run, scrub
from touba.cli._common import redact as redact_address
from touba.cli._kinds import StoreKind, pg_contents, sqlite_contents
from touba.errors import ToubaError
from touba.history._deadline import STORE_DEADLINE_SECONDS, check_deadline
from touba.history._files import check_private_location
from touba.history._sqlite import describe, failure_kind
from touba.history._sqlite_schema import SCHEMA_VERSION as HISTORY_SQLITE_VERSION
from touba.history._store import AdminStore
from touba.memory import MemoryStore, SqliteMemoryStore
from touba.memory.sqlite import SCHEMA_VERSION as MEMORY_SQLITE_VERSION

if TYPE_CHECKING:
    from psycopg import AsyncConnection

    from touba._encryption import Encryption

__all__ = [
    "DSN_ENV",
    "Backend",
    "DsnOption",
    "HistoryAdmin",
    "Kind",
    "Limits",
    "RedisUrlOption",
    "check_store",
    "choose_backend",
    "memory_table",
    "only_with",
    "open_history",
    "open_memory",
    "pg_version",
    "postgres_connection",
    "store_deadline",
]

T = TypeVar("T")
Kind = Literal["sqlite", "postgresql", "redis"]
DSN_ENV = "TOUBA_DSN"
DEADLINE_ENV = "TOUBA_STORE_DEADLINE"
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
# The decision-history store of the commands that take a memory store too (panel, check).
HistoryDbOption = Annotated[
    Path | None, typer.Option("--history-db", help="Path of the SQLite history file.")
]
HistoryDsnOption = Annotated[
    str | None,
    typer.Option("--history-dsn", help="A PostgreSQL DSN of the decision-history store."),
]
HistoryTableOption = Annotated[
    str | None,
    typer.Option("--history-table", help="With --history-dsn: the table (touba_history)."),
]
HistoryPrefixOption = Annotated[
    str | None,
    typer.Option("--history-prefix", help="With --redis-url: the key prefix ('touba:')."),
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


def store_deadline() -> float:
    """``deadline_seconds`` of every PostgreSQL store a command opens: the seconds in
    ``$TOUBA_STORE_DEADLINE`` when set, else the stores' default (10); anything but a
    positive number is a ConfigurationError naming the variable."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return STORE_DEADLINE_SECONDS
    try:
        value: object = float(text)
    except ValueError:
        value = text
    return check_deadline(value, owner=DEADLINE_ENV, name="its value")


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
    address = "--redis-url" if backend.kind == "redis" else "--dsn"
    errors.print(
        f"[bold red]no {what} {escape(place)} at {escape(backend.shown)}[/]: nothing was "
        f"created; check {address} and {option}"
    )
    return typer.Exit(1)


def _refused(place: str, why: str) -> typer.Exit:
    errors.print(f"[bold red]{escape(place)}[/]: {escape(why)}")
    return typer.Exit(1)


_OTHER: dict[StoreKind, StoreKind] = {"history": "memory", "memory": "history"}
_HINTS: dict[StoreKind, str] = {
    "history": "did you mean `touba events --db`?",
    "memory": "did you mean `touba history --db`?",
}
_SQLITE_VERSIONS: dict[StoreKind, str] = {
    "history": str(HISTORY_SQLITE_VERSION),
    "memory": str(MEMORY_SQLITE_VERSION),
}
_PG_NAMES: dict[StoreKind, tuple[str, str]] = {
    "history": ("touba_history", "--table"),
    "memory": ("touba_memory", "--prefix"),
}
_MIGRATES = "opening it would migrate it, and a read-only command does not"


async def _check_sqlite(
    path: Path, want: StoreKind, *, read_only: bool, create: bool, hint: str | None
) -> bool:
    """Refuse ``path`` unless it holds a touba store of kind ``want`` (or, with
    ``create``, nothing yet: then False); see the module docstring."""
    import sqlite3

    # The store's own rules first (links, owners, directories), as its opening says them.
    await asyncio.to_thread(check_private_location, path)
    try:
        found = await asyncio.to_thread(sqlite_contents, path)
    except (sqlite3.Error, OSError) as e:
        if failure_kind(e) == "not_a_database":
            reason = "this file is not a SQLite database; nothing was changed"
        else:
            reason = f"this SQLite file cannot be read ({describe(e)}); nothing was changed"
        raise _refused(str(path), reason) from e
    if want not in found.kinds:
        if create and not found.tables:
            return False
        other = [k for k in found.kinds if k != want]
        if not other:
            raise _refused(str(path), "this SQLite file has no touba tables; nothing was changed")
        names = " and ".join(other)
        hint = (hint or _HINTS[want]) if _OTHER[want] in other else None
        raise _refused(
            str(path),
            f"this file holds a touba {names} store, not a {want} store"
            + (f": {hint}" if hint else ""),
        )
    if not read_only:
        return True
    version = found.kinds[want]
    if version != _SQLITE_VERSIONS[want]:
        raise _refused(
            str(path),
            f"this file holds touba {want} schema version {version}; {_MIGRATES}: open it "
            "once with your application or a writing command first",
        )
    if found.mode & 0o077:
        raise _refused(
            str(path),
            f"this file is readable or writable by group or others (mode {found.mode:o}); "
            f"opening it would reset it to 0600, and a read-only command does not: "
            f"chmod 600 {path}",
        )
    return True


def pg_version(kind: StoreKind) -> str:
    """The PostgreSQL schema version this touba writes (imported here: psycopg's extra)."""
    if kind == "history":
        from touba.history._pg_sql import SCHEMA_VERSION as HISTORY_PG_VERSION

        return str(HISTORY_PG_VERSION)
    from touba.memory.postgres import SCHEMA_VERSION as MEMORY_PG_VERSION

    return str(MEMORY_PG_VERSION)


async def _check_postgres(
    backend: Backend,
    name: str,
    want: StoreKind,
    *,
    read_only: bool = False,
    create: bool = False,
    option: str,
) -> bool:
    """Refuse the PostgreSQL ``name`` unless it holds a touba store of kind ``want``
    (or, with ``create``, nothing yet: then False)."""
    async with postgres_connection(backend.address) as conn:
        found = await pg_contents(conn, name)
    if create and not found.main and found.version is None:
        return False
    place = f"{option} {name!r} at {backend.shown}"
    if want in found.kinds:
        if read_only and found.version != pg_version(want):
            raise _refused(place, f"touba {want} schema version {found.version}; {_MIGRATES}")
        return True
    if found.kinds:
        other = found.kinds[0]
        raise _refused(
            place,
            f"this holds a touba {other} store, not a {want} store; nothing was changed",
        )
    what = "touba history table" if want == "history" else "touba memory tables with prefix"
    if found.main:
        raise _refused(place, f"this table is not touba's: no {what} here; nothing was changed")
    raise _missing(what, repr(name), backend, option)


class Limits(TypedDict, total=False):
    """The limits an application gives its history store (the store's defaults if absent),
    and its ``encryption`` (``touba rekey``)."""

    max_sessions: int
    max_store_bytes: int
    encryption: Encryption


HistoryAdmin = AdminStore
"""What ``touba history`` needs of a built-in history store."""


async def check_store(
    backend: Backend,
    want: StoreKind,
    *,
    name: str | None = None,
    read_only: bool = False,
    create: bool = False,
    hint: str | None = None,
) -> bool:
    """Refuse (exit 1, one line) unless ``backend`` holds a touba store of kind ``want``;
    whether it does (False: ``create`` accepted its absence; True for Redis).

    ``name``: the PostgreSQL table (history) or prefix (memory), the default if None.
    ``create``: a missing store, or an empty file, is accepted (``touba chat``).
    ``read_only``: also refuse a store that opening would migrate or chmod.
    ``hint``: the advice for a store of the other kind (a default names the command).
    Reads only; a Redis prefix is not checked here (its keys mark no kind): opening
    it refuses one that holds nothing.
    """
    if backend.kind == "sqlite":
        path = Path(backend.address)
        exists = await asyncio.to_thread(path.is_file)
        if not exists and not create:
            errors.print(f"[bold red]no {want} database at {escape(str(path))}[/]")
            raise typer.Exit(1)
        if not exists:
            return False
        return await _check_sqlite(path, want, read_only=read_only, create=create, hint=hint)
    if backend.kind == "postgresql":
        default, option = _PG_NAMES[want]
        with _opening(backend, f"{want} store"):
            return await _check_postgres(
                backend, name or default, want, read_only=read_only, create=create, option=option
            )
    return True


@contextmanager
def no_new_journal(path: str) -> Iterator[None]:
    """Take away the empty ``-journal`` file a SQLite store's opening left beside ``path``
    (it creates each side file 0600 before SQLite opens it, SPEC section 6; in WAL mode
    SQLite removes the ``-wal`` and ``-shm`` files on close but never uses the journal),
    so that a command that only reads leaves the directory as it found it."""
    journal = Path(path + "-journal")
    there = journal.exists()
    try:
        yield
    finally:
        if not there:
            with suppress(OSError):
                if journal.lstat().st_size == 0:
                    journal.unlink()


@contextmanager
def _no_new_journal(backend: Backend, read_only: bool) -> Iterator[None]:
    """:func:`no_new_journal` for a read-only command on a SQLite store; nothing else."""
    if backend.kind != "sqlite" or not read_only:
        yield
        return
    with no_new_journal(backend.address):
        yield


@asynccontextmanager
async def open_history(
    backend: Backend,
    *,
    table: str | None = None,
    prefix: str | None = None,
    read_only: bool = False,
    hint: str | None = None,
    **limits: Unpack[Limits],
) -> AsyncIterator[HistoryAdmin]:
    """Open an existing history store (never create one by mistake), closed on exit.

    ``limits`` (``max_sessions``, ``max_store_bytes``) are the application's, for
    ``store.usage()``; the store's defaults otherwise. ``read_only`` and ``hint``: as
    for :func:`check_store`, which runs first.
    """
    check = functools.partial(
        check_store, backend, "history", name=table, read_only=read_only, hint=hint
    )
    if backend.kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        await check()
        with _no_new_journal(backend, read_only):
            async with SqliteHistoryStore(backend.address, create=False, **limits) as sqlite_store:
                yield sqlite_store
    elif backend.kind == "postgresql":
        with _opening(backend, "history store"):
            from touba.history.postgres import PostgresHistoryStore

            store = PostgresHistoryStore(
                backend.address,
                table=table or "touba_history",
                create=False,
                deadline_seconds=store_deadline(),
                **limits,
            )
        await check()  # after the constructor, which names a bad table best
        async with _opened(backend, "history store", store) as pg_store:
            yield pg_store
    else:
        await check()
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
            with _opening(backend, "history store"):
                empty = await store.is_empty()
            if empty:  # a wrong prefix or database, most likely: as a missing table
                raise _missing("touba history keys under prefix", repr(prefix), backend, "--prefix")
            yield store
        finally:
            await store.close()
    finally:
        await client.aclose()


@asynccontextmanager
async def open_memory(
    backend: Backend,
    *,
    prefix: str | None = None,
    create: bool = False,
    read_only: bool = False,
    hint: str | None = None,
    encryption: Encryption | None = None,
) -> AsyncIterator[MemoryStore]:
    """Open a memory store, closed on exit; an absent one is an error unless ``create``
    (then it is created, and stderr says so: "created memory store at ...").

    ``read_only`` and ``hint``: as for :func:`check_store`, which runs first.
    ``encryption``: the store's :class:`~touba.Encryption` (``--keys-file``), if sealed.
    """
    check = functools.partial(
        check_store, backend, "memory", name=prefix, read_only=read_only, create=create, hint=hint
    )
    if backend.kind == "sqlite":
        existed = await check()
        with _no_new_journal(backend, read_only):
            async with SqliteMemoryStore(
                backend.address, create=create, encryption=encryption
            ) as sqlite_store:
                _say_created(backend, existed, "")
                yield sqlite_store
        return
    with _opening(backend, "memory store"):
        from touba.memory.postgres import PostgresMemoryStore

        name = prefix or "touba_memory"
        store = PostgresMemoryStore(
            backend.address,
            prefix=name,
            create=create,
            encryption=encryption,
            deadline_seconds=store_deadline(),
        )
    existed = await check()  # after the constructor, which names a bad prefix best
    async with _opened(backend, "memory store", store) as pg_store:
        _say_created(backend, existed, f" (tables {name}_*)")
        yield pg_store


def _say_created(backend: Backend, existed: bool, detail: str) -> None:
    """The one line a writing command prints on stderr when it made its store."""
    if not existed:
        errors.print(f"created memory store at {escape(backend.shown)}{escape(detail)}")


def memory_table(prefix: str | None, table: str) -> list[str]:
    """The identifier parts of one table of a PostgreSQL memory store (``events``, ...)."""
    *schema, last = _parts(prefix or "touba_memory")
    return [*schema, f"{last}_{table}"]
