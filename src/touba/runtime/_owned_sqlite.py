"""One thread owns a SQLite connection and runs every call on it, in order.

Shared by the runtime's small SQLite stores (checkpoints, resources): the
file is opened with :func:`~touba.history._files.open_private_sqlite` (0600
files, symbolic links and unsafe directories refused), or a connection the
host gives is used as is and left open.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from touba.errors import ConfigurationError
from touba.history._files import open_private_sqlite

__all__ = ["OwnedSqlite"]

D = TypeVar("D")
R = TypeVar("R")


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
    ) -> None:
        if (filename is None) == (database is None):
            raise ConfigurationError(
                f"{owner} needs exactly one of filename=... (a path) or database=... (an "
                "open sqlite3.Connection)"
            )
        if database is not None and not isinstance(database, sqlite3.Connection):
            raise ConfigurationError("database must be a sqlite3.Connection")
        self._owner = owner
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
        if conn is None:
            assert filename is not None
            conn = open_private_sqlite(filename, timeout=timeout, check=check)
        try:
            return conn, build(conn)
        except BaseException:
            if self._owns_connection:
                conn.close()
            raise

    async def run(self, job: Callable[[], R]) -> R:
        """Run ``job`` on the owning thread; once started it finishes even if cancelled."""
        if self._closed:
            raise ConfigurationError(f"this {self._owner} is closed; create a new one")
        future = asyncio.get_running_loop().run_in_executor(self._executor, job)
        return await asyncio.shield(future)

    async def close(self) -> None:
        """Close the connection it opened (never the host's) and stop its thread."""
        if self._closed:
            return
        self._closed = True
        if self._owns_connection:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=True)
