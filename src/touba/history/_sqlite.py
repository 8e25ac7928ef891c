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
- **The owned thread.** :class:`OwnedThread` runs a store's SQLite calls, in
  order, on one thread of its own (the connection's owner). An event loop
  awaits a call through one future that the thread settles directly: a call
  costs one wake-up each way, and once handed over it runs to its end even
  if the caller is cancelled (its result is then dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

__all__ = [
    "FailureKind",
    "OwnedThread",
    "describe",
    "failure_kind",
    "finish_leftover",
    "rollback_quietly",
    "transaction",
]

FailureKind = Literal["locked", "not_a_database", "corrupt", "misuse", "io"]
R = TypeVar("R")

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
def transaction(
    conn: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE", *, power_safe: bool = True
) -> Iterator[None]:
    """One transaction: committed when the block ends, rolled back if anything raises.

    ``power_safe=False`` commits without waiting for the disk
    (``synchronous=NORMAL`` for this transaction only; the connection's
    ``FULL`` is restored after it): the commit survives the process, a
    ``kill -9`` included, but a power loss or an OS crash may undo it. In WAL
    mode, SQLite keeps the log in order: a later ``FULL`` commit, by any
    connection, makes it durable too, and an undone commit leaves the state
    before it. Only for writes that need no one once their machine is down (a
    reservation: see :mod:`touba.history.sqlite`).
    """
    finish_leftover(conn)
    if not power_safe:
        conn.execute("PRAGMA synchronous=NORMAL")
    try:
        conn.execute(begin)
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            rollback_quietly(conn)
            raise
    finally:
        if not power_safe:
            conn.execute("PRAGMA synchronous=FULL")


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


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled: the result is dropped
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class OwnedThread:
    """One thread running jobs in the order they are handed over (see the module docstring).

    A daemon thread: a store that was never closed does not hold the
    interpreter at exit (SQLite recovers an interrupted transaction on the next
    open).
    """

    def __init__(self, name: str) -> None:
        Job = tuple[Callable[[Any, BaseException | None], None], Callable[[], Any]]
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            done, job = item
            try:
                result, error = job(), None
            except BaseException as e:  # handed to the caller, raised there
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: no one waits
                done(result, error)
            del item, done, job, result, error  # hold nothing while idle

    def call(self, job: Callable[[], R]) -> R:
        """Run ``job`` on the thread and wait for it, blocking (from another thread)."""
        future: Future[R] = Future()

        def done(result: Any, error: BaseException | None) -> None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        self._jobs.put((done, job))
        return future.result()

    async def run(self, job: Callable[[], R]) -> R:
        """Run ``job`` on the thread; once handed over it runs to its end, even if the
        caller is cancelled."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, result, error)

        self._jobs.put((done, job))
        return await future

    def submit(self, job: Callable[[], Any]) -> None:
        """Hand ``job`` over without waiting for it (its failure is dropped)."""
        self._jobs.put((_ignore, job))

    def shutdown(self) -> None:
        """Run what was handed over, then stop the thread (waits for it)."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _ignore(result: Any, error: BaseException | None) -> None:
    pass
