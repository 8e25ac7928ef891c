"""Private SQLite files: refuse unsafe locations, create the files 0600 (POSIX).

Every touba store that opens a SQLite file by name (decision history, runtime
checkpoints, chat memory) goes through :func:`open_private_sqlite`. The rules
(SPEC section 6): the database and its ``-wal``, ``-shm`` and ``-journal``
files must be regular files owned by this user, never symbolic links, with
no other hard link, and are created or reset to 0600 *before* SQLite opens
them; the directory holding them must belong to this user (or root) and not
be writable by group or others; an ancestor above it may be, only if it has
the sticky bit and belongs to root (as ``/tmp`` does). Anything unsafe
raises :class:`DecisionHistoryStorageUnsafe` before a file is created.

Directories are never created: make a private one first, for example
``os.makedirs(".touba", mode=0o700, exist_ok=True)``. Nothing is encrypted.
On Windows only the link and regular-file rules apply; set the directory's
ACLs yourself.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from touba.errors import ConfigurationError, DecisionHistoryStorageUnsafe

__all__ = [
    "SQLITE_SUFFIXES",
    "check_private_location",
    "ensure_private_file",
    "open_private_sqlite",
    "verify_private_files",
]

logger = logging.getLogger("touba.history")

SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")
_POSIX = os.name == "posix"
_OPEN_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO swapped in must not block the open
)
_FIX = "Point filename at a regular file in a private directory (mode 0700) of your own"


def _unsafe(what: str) -> DecisionHistoryStorageUnsafe:
    return DecisionHistoryStorageUnsafe(f"{what}; nothing was opened. {_FIX}")


def _check_file(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _unsafe(f"{path} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _unsafe(f"{path} exists and is not a regular file")
    if _POSIX and st.st_uid != os.geteuid():
        raise _unsafe(f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_nlink > 1:
        raise _unsafe(f"{path} has other hard links, which would expose its content")


def _chain(directory: str) -> list[str]:
    path = Path(directory)
    return [str(p) for p in reversed(path.parents)] + [str(path)]


def _check_directories(parent: str) -> None:
    try:
        parent_st = os.stat(parent)
    except FileNotFoundError:
        raise ConfigurationError(
            f"directory {parent} does not exist; create it private first, e.g. "
            f"os.makedirs({parent!r}, mode=0o700)"
        ) from None
    if not stat.S_ISDIR(parent_st.st_mode):
        raise ConfigurationError(f"{parent} is not a directory; fix filename")
    if not _POSIX:
        return
    euid = os.geteuid()
    # The directories the given path goes through, and the real ones behind
    # its symbolic links: whoever can rename an entry in any of them can
    # redirect the files.
    for directory in dict.fromkeys(_chain(parent) + _chain(os.path.realpath(parent))):
        link = os.lstat(directory)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, euid):
            raise _unsafe(f"{directory} is a symbolic link owned by another user")
        st = os.stat(directory)
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if os.path.samestat(st, parent_st):
            if st.st_uid not in (0, euid):
                raise _unsafe(f"directory {directory} belongs to another user (uid {st.st_uid})")
            if shared:
                raise _unsafe(
                    f"directory {directory} is writable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}); chmod it 0700"
                )
        elif shared and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
            raise _unsafe(
                f"ancestor directory {directory} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}) without being a sticky directory of root"
            )


def check_private_location(filename: str | os.PathLike[str]) -> str:
    """Check the database path and its directories; return the absolute path.

    Creates nothing. Raises :class:`DecisionHistoryStorageUnsafe` (or
    :class:`ConfigurationError` when the directory is missing).
    """
    path = os.path.abspath(os.fspath(filename))
    _check_directories(os.path.dirname(path))
    _check_files(path)
    return path


def _check_files(path: str, *, private: bool = False) -> None:
    """Check each of the database's files (``path`` and SQLite's side files) that exists:
    with ``private``, also that neither group nor others may read or write it."""
    for candidate in (path + suffix for suffix in SQLITE_SUFFIXES):
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            continue
        _check_file(candidate, st)
        if private and _POSIX and stat.S_IMODE(st.st_mode) & 0o077:
            raise _unsafe(f"{candidate} is readable or writable by group or others")


def ensure_private_file(path: str) -> None:
    """Create ``path`` empty with mode 0600, or reset it to 0600, without following links."""
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _unsafe(f"{path} is a symbolic link") from e
        if e.errno == errno.EISDIR:
            raise _unsafe(f"{path} exists and is not a regular file") from e
        raise
    try:
        st = os.fstat(fd)
        _check_file(path, st)
        if _POSIX and stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def verify_private_files(path: str) -> None:
    """Check, once SQLite has opened ``path``, that its files are still private."""
    _check_files(path, private=True)


def open_private_sqlite(
    filename: str | os.PathLike[str],
    *,
    timeout: float = 5.0,
    check: Callable[[sqlite3.Connection], None] | None = None,
    page_size: int | None = None,
) -> sqlite3.Connection:
    """Open a SQLite file safely, in WAL mode with ``synchronous=FULL``.

    ``check`` runs on the new connection before anything is written (to
    refuse an unknown schema version without touching the file).
    ``page_size`` applies to a file that holds nothing yet (SQLite keeps an
    existing file's page size). The
    connection is in autocommit mode (``isolation_level=None``): begin and
    commit explicitly. ``timeout`` is SQLite's busy timeout, in seconds.
    Call it from the thread that will own the connection.
    """
    path = check_private_location(filename)
    for suffix in SQLITE_SUFFIXES:
        ensure_private_file(path + suffix)
    # nofollow: SQLite itself refuses a symbolic link swapped in since the check.
    uri = "file:" + urllib.parse.quote(path) + "?nofollow=1"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None)
    try:
        if check is not None:
            check(conn)
        if page_size is not None:
            conn.execute(f"PRAGMA page_size={int(page_size)}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigurationError(
                f"SQLite could not put {path} in WAL mode (got {mode!r}); keep it on a local "
                "file system"
            )
        # FULL: a commit (a saved decision, a checkpoint) survives a power
        # loss too. A store may lift it for one transaction that need not
        # (the history store's reservations: see _sqlite.transaction).
        conn.execute("PRAGMA synchronous=FULL")
        verify_private_files(path)
    except BaseException:
        conn.close()
        raise
    logger.info("opened SQLite file %s (0600, WAL, synchronous=FULL)", path)
    return conn
