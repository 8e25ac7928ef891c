"""What touba's SQLite stores share: one transaction, and what a failure means.

Used by the history store (:mod:`touba.history.sqlite`), the chat memory store
and the runtime's checkpoint and resource stores; it sits in ``history`` as
:mod:`touba.history._files` does, the lowest layer with a SQLite store.

- **Transactions.** :func:`transaction` begins, runs, commits; if anything
  fails, the commit included, it rolls back whatever is still open. A
  rollback that fails too is left for the next :func:`transaction` on that
  connection to finish, so that the error the caller sees is the first one
  and the connection never stays stuck inside a transaction.
- **Failures.** :func:`failure_kind` sorts a ``sqlite3`` error (or an
  ``OSError`` met while opening the files) into what a store must say about
  it: ``"locked"`` (another connection held the file longer than the busy
  timeout), ``"not_a_database"`` (the file is something else), ``"corrupt"``
  (SQLite read a malformed page: real damage, or a read that failed midway,
  which libfiu shows SQLite reporting this way, so it may pass), ``"misuse"``
  (a closed connection, a wrong thread: fix the call) or ``"io"`` (disk full,
  I/O error, read-only file system, the file could not be opened: retry once
  the disk is fixed). Each store turns these into its own typed errors in
  one place, chained with ``raise ... from``; SQLite rolls back a failed
  statement or commit, so the previous state is what remains.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = [
    "FailureKind",
    "describe",
    "failure_kind",
    "finish_leftover",
    "rollback_quietly",
    "transaction",
]

FailureKind = Literal["locked", "not_a_database", "corrupt", "misuse", "io"]

_LOCKED = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def finish_leftover(conn: sqlite3.Connection) -> None:
    """Roll back a transaction a failed rollback left open (see the module docstring)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back after a failure; a failing rollback must not hide that failure."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # finish_leftover retries it before the next transaction


@contextmanager
def transaction(conn: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[None]:
    """One transaction: committed when the block ends, rolled back if anything raises."""
    finish_leftover(conn)
    conn.execute(begin)
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise


def failure_kind(error: BaseException) -> FailureKind | None:
    """What ``error`` means for a store; None when it is neither sqlite3's nor the OS's."""
    if isinstance(error, sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return "misuse"
    if isinstance(error, sqlite3.Error):
        code = (getattr(error, "sqlite_errorcode", None) or 0) & 0xFF
        if code in _LOCKED:
            return "locked"
        if code == sqlite3.SQLITE_NOTADB:
            return "not_a_database"
        if code == sqlite3.SQLITE_CORRUPT:
            return "corrupt"
        return "io"
    if isinstance(error, OSError):
        return "io"
    return None


def describe(error: BaseException) -> str:
    """The error's class, SQLite's code name (or the errno name) and its text."""
    name = getattr(error, "sqlite_errorname", None)
    if name is None and isinstance(error, OSError) and error.errno is not None:
        name = errno.errorcode.get(error.errno)
    return f"{type(error).__name__}{f' {name}' if name else ''}: {error}"
