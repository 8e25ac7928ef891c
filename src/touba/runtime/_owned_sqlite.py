"""One thread owns a SQLite connection and runs every call on it, in order.

Shared by the runtime's small SQLite stores (checkpoints, resources), which
are :class:`OwnedSqliteStore` subclasses: each brings only its SQL (made from
the connection, its schema installed), its schema version and its typed error. The
file is opened with :func:`~touba.history._files.open_private_sqlite` (0600
files, symbolic links and unsafe directories refused), or a connection the
host gives is used as is and left open.

Errors: :meth:`OwnedSqlite.run` (and opening) is the one place where a
``sqlite3`` error, or an OS error while opening, becomes the store's own
typed error (``unavailable``: ``CheckpointStoreUnavailable``,
``ResourceBindingUnavailable``), chained: a file locked past ``timeout``, a
full or failing disk, a read-only file system, a corrupt file. Each write is
one transaction that SQLite rolls back when it fails, so the previous state
is kept. A misused connection (closed by its owner, wrong thread) is a
``ConfigurationError``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from touba._closing import AsyncClosing
from touba.errors import ConfigurationError, ToubaError
from touba.history._files import open_private_sqlite
from touba.history._sqlite import describe, failure_kind, transaction

__all__ = ["OwnedSqlite", "OwnedSqliteStore", "SchemaVersion", "write"]

D = TypeVar("D")
R = TypeVar("R")


def write(conn: sqlite3.Connection, job: Callable[[], R]) -> R:
    """Run ``job`` in one ``BEGIN IMMEDIATE`` transaction, rolled back if anything fails."""
    with transaction(conn):
        return job()


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """A store's schema version, kept as one row of the shared ``touba_meta`` table."""

    name: str
    version: int
    what: str

    def check(self, conn: sqlite3.Connection) -> None:
        """Refuse a file holding another version of this schema, without touching it."""
        sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'touba_meta'"
        if not conn.execute(sql).fetchone():
            return
        row = conn.execute("SELECT value FROM touba_meta WHERE name = ?", (self.name,)).fetchone()
        if row is not None and row[0] != str(self.version):
            raise ConfigurationError(
                f"this SQLite file holds {self.what} schema version {row[0]!r}; this touba "
                f"reads version {self.version}. Upgrade touba or use another file; it was "
                "not modified"
            )

    def install(
        self,
        conn: sqlite3.Connection,
        statements: Sequence[str],
        *,
        migrate: Callable[[], None] | None = None,
    ) -> None:
        """Check, then create the tables, run ``migrate`` (additive changes that keep
        the version readable by older touba) and record the version, in one
        transaction."""

        def job() -> None:
            self.check(conn)
            for statement in statements:
                conn.execute(statement)
            if migrate is not None:
                migrate()
            conn.execute(
                "INSERT OR IGNORE INTO touba_meta (name, value) VALUES (?, ?)",
                (self.name, str(self.version)),
            )

        write(conn, job)


class OwnedSqlite(Generic[D]):
    """A connection, the thread that owns it, and ``db``: what ``build`` made of it."""

    def __init__(
        self,
        owner: str,
        *,
        filename: str | os.PathLike[str] | None,
        database: sqlite3.Connection | None,
        timeout: float,
        check: Callable[[sqlite3.Connection], None],
        build: Callable[[sqlite3.Connection], D],
        unavailable: type[ToubaError],
    ) -> None:
        if (filename is None) == (database is None):
            raise ConfigurationError(
                f"{owner} needs exactly one of filename=... (a path) or database=... (an "
                "open sqlite3.Connection)"
            )
        if database is not None and not isinstance(database, sqlite3.Connection):
            raise ConfigurationError("database must be a sqlite3.Connection")
        self._owner = owner
        self._timeout = timeout
        self._unavailable = unavailable
        self._owns_connection = database is None
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"touba-{owner}")
        try:
            self._conn, self.db = self._executor.submit(
                self._open, filename, database, timeout, check, build
            ).result()
        except BaseException:
            self._executor.shutdown(wait=True)
            raise

    def _open(
        self,
        filename: str | os.PathLike[str] | None,
        conn: sqlite3.Connection | None,
        timeout: float,
        check: Callable[[sqlite3.Connection], None],
        build: Callable[[sqlite3.Connection], D],
    ) -> tuple[sqlite3.Connection, D]:
        try:
            if conn is None:
                assert filename is not None
                conn = open_private_sqlite(filename, timeout=timeout, check=check)
            try:
                return conn, build(conn)
            except BaseException:
                if self._owns_connection:
                    conn.close()
                raise
        except Exception as e:
            translated = self._translate(e)
            if translated is e:
                raise
            raise translated from e

    def _translate(self, error: Exception) -> Exception:
        """The store's typed error for a ``sqlite3`` or OS error; other errors as they are."""
        kind = failure_kind(error)
        if kind is None:
            return error
        if kind == "misuse":
            return ConfigurationError(
                f"the {self._owner}'s SQLite connection cannot be used ({describe(error)}); "
                "with database=, keep it open (made with check_same_thread=False) until the "
                "store is closed"
            )
        cause = {
            "locked": f"the file stayed locked by another connection for over {self._timeout:g}s",
            "not_a_database": "the file is not a database",
            "corrupt": "a page read back damaged (a failing disk, or real damage: then restore "
            "a backup)",
            "io": "the disk may be full, failing or read-only",
        }[kind]
        return self._unavailable(
            f"the {self._owner} failed ({describe(error)}): {cause}. Nothing was written and "
            "the previous state is kept; retry once that is fixed"
        )

    def _call(self, job: Callable[[], R]) -> R:
        try:
            return job()
        except Exception as e:
            translated = self._translate(e)
            if translated is e:
                raise
            raise translated from e

    async def run(self, job: Callable[[], R]) -> R:
        """Run ``job`` on the owning thread; once started it finishes even if cancelled.

        ``sqlite3`` errors become the store's typed error (see the module docstring).
        """
        if self._closed:
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._call, job)
        return await asyncio.shield(future)

    async def close(self) -> None:
        """Close the connection it opened (never the host's) and stop its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._owns_connection:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, self._call, self._conn.close)
        finally:
            self._executor.shutdown(wait=True)


class OwnedSqliteStore(Generic[D], AsyncClosing):
    """The shell of a runtime SQLite store: its SQL ``_db`` on an :class:`OwnedSqlite`,
    ``_run`` to call it on the owning thread, ``close()`` and ``async with``.

    A store names itself (``_owner``), its schema version (``_version``: a file holding
    another is refused with ConfigurationError, untouched) and its typed error
    (``_unavailable``), and makes its SQL object from the connection in ``_build``
    (installing the schema). ``filename``, ``database`` and ``timeout`` are
    :class:`OwnedSqlite`'s.
    """

    _owner: ClassVar[str]
    _version: ClassVar[SchemaVersion]
    _unavailable: ClassVar[type[ToubaError]]

    def __init__(
        self,
        filename: str | os.PathLike[str] | None = None,
        *,
        database: sqlite3.Connection | None = None,
        timeout: float = 5.0,
    ) -> None:
        self._sqlite = OwnedSqlite(
            self._owner,
            filename=filename,
            database=database,
            timeout=timeout,
            check=self._version.check,
            build=self._build,
            unavailable=self._unavailable,
        )
        self._db = self._sqlite.db

    def _build(self, conn: sqlite3.Connection) -> D:
        raise NotImplementedError

    async def _run(self, job: Callable[[], R]) -> R:
        return await self._sqlite.run(job)

    async def close(self) -> None:
        """Close the connection it opened (never one given as ``database``) and stop its
        thread. Idempotent; later calls raise ConfigurationError."""
        await self._sqlite.close()
