"""Checkpoint stores: where invocations awaiting approval wait (SPEC section 7).

A store keeps JSON checkpoints (see :mod:`touba.runtime._state`) by id. The
contract (:class:`CheckpointStore`): ``save`` a new checkpoint, ``get`` a
detached copy, and ``take`` one atomically, so that of two resumes of the
same checkpoint, in one process or several, exactly one gets it. A taken
checkpoint is gone: if the resuming process dies afterwards, the approved
calls are not run twice (reconciling an uncertain effect is the
application's).

- :class:`MemoryCheckpointStore` (the default): this process only.
- :class:`SqliteCheckpointStore`: a SQLite file that processes may share,
  opened with the same file-safety rules as the history store (0600 files,
  no symbolic links, private directory). Not encrypted: checkpoints hold
  the invocation's input, arguments, results and trace.
- :class:`~touba.runtime.PostgresCheckpointStore`
  (:mod:`touba.runtime._checkpoint_postgres`): a PostgreSQL table that many
  workers share.

Every store keeps a checkpoint as its canonical JSON text, so what comes
back is exactly what was saved; something that is not JSON data (or not
valid Unicode) is refused with ``ConfigurationError`` before anything is
written. ``replace`` compares the stored checkpoint's ``revision`` field
(absent, or not an integer: 0) in the same atomic step that writes, so of
two replacers holding one revision, only the first can win if it moves the
revision on. ``list`` gives ``run_id``, ``invocation_id`` and ``agent_ref``
only when they are strings.

SQLite layout (schema version 1): one row per checkpoint, its body as JSON
text, ``run_id`` indexed for ``list``. ``updated_at`` was added after
version 1 first shipped: opening an older file adds the column (NULL, read
as ``created_at``) and the index, in one transaction. The file stays
version 1: an older touba keeps reading and writing it (its inserts leave
``updated_at`` NULL, which reads as their creation time).
"""

from __future__ import annotations

import builtins
import json
import sqlite3
from collections.abc import Callable, Collection
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal, Protocol, TypeVar, runtime_checkable

from touba.errors import CheckpointStoreUnavailable, ConfigurationError
from touba.history._model import JSON, STORED_JSON_DEPTH, canonical_json, json_problem, parse_json
from touba.runtime._owned_sqlite import OwnedSqliteStore, SchemaVersion, write

__all__ = [
    "CheckpointInfo",
    "CheckpointStatus",
    "CheckpointStore",
    "MemoryCheckpointStore",
    "SqliteCheckpointStore",
    "check_revision",
    "decode_checkpoint",
    "duplicate_checkpoint",
    "encode_checkpoint",
    "identity_of",
    "owned_checkpoint",
    "owned_ids",
    "revision_of",
    "status_of",
]

R = TypeVar("R")
SCHEMA_VERSION: Final = 1
_VERSION = SchemaVersion("checkpoint_schema_version", SCHEMA_VERSION, "checkpoint")
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS touba_checkpoints (
        id TEXT PRIMARY KEY, run_id TEXT, invocation_id TEXT, agent_ref TEXT,
        created_at TEXT NOT NULL, body TEXT NOT NULL, updated_at TEXT)""",
)
_INDEX = "CREATE INDEX IF NOT EXISTS touba_checkpoints_run ON touba_checkpoints (run_id)"


CheckpointStatus = Literal["awaiting_approval", "running", "failed"]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One row of ``store.list()``: what a checkpoint is, never its content.

    ``status`` and ``revision`` come from the checkpoint's own ``status``
    (absent: ``"awaiting_approval"``) and ``revision`` (absent: 0) fields.
    """

    checkpoint_id: str
    run_id: str | None
    invocation_id: str | None
    agent_ref: str | None
    status: str
    revision: int
    created_at: str
    updated_at: str


@runtime_checkable
class CheckpointStore(Protocol):
    """Where checkpoints wait. ``save``, ``get`` and ``take`` are required.

    - ``save(id, checkpoint)``: store a new checkpoint; an existing id raises
      ConfigurationError.
    - ``get(id)``: a detached copy, or None.
    - ``take(id)``: remove and return it atomically (of two takers, one wins).
    - ``replace(id, checkpoint, *, revision)`` (optional): atomically, if a
      checkpoint ``id`` exists and its ``revision`` field (absent: 0) equals
      ``revision``, store ``checkpoint`` in its place (None removes it) and
      return True; otherwise change nothing and return False. It never
      creates a checkpoint. The runtime uses it as a compare-and-swap: a
      resume claims a checkpoint by replacing it, and a worker whose
      checkpoint was claimed by another learns it at its next write.
    - ``list(*, run_id=None)`` (optional): :class:`CheckpointInfo` rows,
      oldest first, those of ``run_id`` only when it is given.

    ``durable`` (optional attribute, default True): False for a store that a
    process exit empties; the runtime then skips the writes that only serve
    a resume after a crash.
    """

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        """Store a new checkpoint; ConfigurationError when ``checkpoint_id`` exists."""
        ...

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """A detached copy of the checkpoint, or None."""
        ...

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """Remove and return the checkpoint atomically: of two takers, one gets it."""
        ...


def revision_of(checkpoint: dict[str, JSON]) -> int:
    """The checkpoint's ``revision`` field; 0 when absent or not an integer."""
    value = checkpoint.get("revision", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def status_of(checkpoint: dict[str, JSON]) -> str:
    """The checkpoint's ``status`` field; ``"awaiting_approval"`` when absent or not a str."""
    value = checkpoint.get("status", "awaiting_approval")
    return value if isinstance(value, str) else "awaiting_approval"


def identity_of(checkpoint: dict[str, JSON]) -> tuple[str | None, str | None, str | None]:
    """``run_id``, ``invocation_id`` and ``agent_ref``, each None unless it is a str."""

    def text(name: str) -> str | None:
        value = checkpoint.get(name)
        return value if isinstance(value, str) else None

    return text("run_id"), text("invocation_id"), text("agent_ref")


def check_revision(revision: object) -> int:
    """``replace``'s ``revision`` argument, refused unless it is an int."""
    if isinstance(revision, bool) or not isinstance(revision, int):
        raise ConfigurationError(f"revision must be an int, got {revision!r}")
    return revision


def encode_checkpoint(checkpoint: dict[str, JSON]) -> str:
    """The canonical JSON text every store keeps; ConfigurationError when it is not JSON
    data (naming the path of the bad value: a set, NaN, a lone surrogate...)."""
    problem = json_problem(checkpoint, "checkpoint", max_depth=STORED_JSON_DEPTH)
    if problem is not None:
        raise ConfigurationError(
            f"a checkpoint must be JSON data ({problem}); capabilities must return JSON data. "
            "Nothing was written"
        )
    return canonical_json(checkpoint)


def decode_checkpoint(body: str | None) -> dict[str, JSON] | None:
    """A stored checkpoint's JSON text back as a fresh dict; a damaged one raises
    ConfigurationError (it cannot be resumed) and is left as it is."""
    if body is None:
        return None
    try:
        value = parse_json(body)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigurationError("a stored checkpoint is not a JSON object; it cannot be resumed")
    return value


def owned_checkpoint(
    run_id: str | None, body: str, run_ids: Collection[str], user: str | None
) -> bool:
    """Whether a stored checkpoint is of one of ``run_ids`` (its ``run_id``, or its body's
    ``session_id``) or of ``user`` (its body's ``user_id``): what erasing a user removes.
    A damaged body is matched by its ``run_id`` alone."""
    if run_id is not None and run_id in run_ids:
        return True
    try:
        checkpoint = decode_checkpoint(body)
    except ConfigurationError:
        return False
    if checkpoint is None:
        return False
    found_user, session = checkpoint.get("user_id"), checkpoint.get("session_id")
    if user is not None and isinstance(found_user, str) and found_user == user:
        return True
    return isinstance(session, str) and session in run_ids


def owned_ids(run_ids: object, user: object) -> tuple[frozenset[str], str | None]:
    """The arguments of ``owned_checkpoints`` / ``erase_owned``, checked."""
    if isinstance(run_ids, str | bytes) or not isinstance(run_ids, Collection):
        raise ConfigurationError("run_ids must be a collection of run ids, not one str")
    if not all(isinstance(r, str) for r in run_ids):
        raise ConfigurationError("run_ids must hold str run ids only")
    if user is not None and not isinstance(user, str):
        raise ConfigurationError("user must be a str user id, or None")
    return frozenset(run_ids), user


def duplicate_checkpoint(checkpoint_id: str) -> ConfigurationError:
    return ConfigurationError(f"checkpoint {checkpoint_id!r} already exists; ids must be new")


class MemoryCheckpointStore:
    """Checkpoints in this process's memory, lost when it exits. Unbounded.

    Every method is atomic because none awaits between its read and its
    write; copies in and out are detached (kept as JSON text).
    """

    durable = False

    def __init__(self) -> None:
        self._items: dict[str, str] = {}
        self._times: dict[str, tuple[str, str]] = {}

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        """Store a new checkpoint. ConfigurationError: the id exists, or it is not JSON."""
        if checkpoint_id in self._items:
            raise duplicate_checkpoint(checkpoint_id)
        self._items[checkpoint_id] = encode_checkpoint(checkpoint)
        now = datetime.now(UTC).isoformat()
        self._times[checkpoint_id] = (now, now)

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """A detached copy, or None."""
        return decode_checkpoint(self._items.get(checkpoint_id))

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """Remove and return it; of concurrent takers exactly one gets it, the others None."""
        body = self._items.pop(checkpoint_id, None)  # no await in between: atomic
        self._times.pop(checkpoint_id, None)
        return decode_checkpoint(body)

    async def replace(
        self, checkpoint_id: str, checkpoint: dict[str, JSON] | None, *, revision: int
    ) -> bool:
        """Compare-and-swap on the stored ``revision`` (see :class:`CheckpointStore`).

        True when it replaced (or, with None, removed) the checkpoint; False,
        changing nothing, when it is absent or at another revision.
        ConfigurationError when ``checkpoint`` is not JSON (nothing changed).
        """
        check_revision(revision)
        body = None if checkpoint is None else encode_checkpoint(checkpoint)
        current = self._items.get(checkpoint_id)  # no await until the swap: atomic
        if current is None or revision_of(json.loads(current)) != revision:
            return False
        if body is None:
            del self._items[checkpoint_id]
            del self._times[checkpoint_id]
        else:
            self._items[checkpoint_id] = body
            created, _ = self._times[checkpoint_id]
            self._times[checkpoint_id] = (created, datetime.now(UTC).isoformat())
        return True

    async def list(self, *, run_id: str | None = None) -> list[CheckpointInfo]:
        """What each checkpoint is (never its content), oldest first; ``run_id``'s only
        when given."""
        rows = []
        for checkpoint_id, body in self._items.items():
            info = _info(checkpoint_id, json.loads(body), *self._times[checkpoint_id])
            if run_id is None or info.run_id == run_id:
                rows.append(info)
        return sorted(rows, key=lambda r: r.created_at)

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def owned_checkpoints(
        self, *, run_ids: Collection[str] = (), user: str | None = None
    ) -> builtins.list[CheckpointInfo]:
        """The checkpoints of one of ``run_ids`` (their ``run_id``, or their body's
        ``session_id``) or of ``user`` (their body's ``user_id``), oldest first."""
        runs, who = owned_ids(run_ids, user)
        return [
            info
            for info in await self.list()
            if owned_checkpoint(info.run_id, self._items[info.checkpoint_id], runs, who)
        ]

    async def erase_owned(self, *, run_ids: Collection[str] = (), user: str | None = None) -> int:
        """Remove the checkpoints :meth:`owned_checkpoints` finds (running ones too);
        return how many."""
        found = await self.owned_checkpoints(run_ids=run_ids, user=user)
        for info in found:  # no await from the listing to here: atomic
            self._items.pop(info.checkpoint_id, None)
            self._times.pop(info.checkpoint_id, None)
        return len(found)

    def __len__(self) -> int:
        return len(self._items)


def _info(
    checkpoint_id: str, checkpoint: dict[str, JSON], created_at: str, updated_at: str
) -> CheckpointInfo:
    run_id, invocation_id, agent_ref = identity_of(checkpoint)
    return CheckpointInfo(
        checkpoint_id=checkpoint_id,
        run_id=run_id,
        invocation_id=invocation_id,
        agent_ref=agent_ref,
        status=status_of(checkpoint),
        revision=revision_of(checkpoint),
        created_at=created_at,
        updated_at=updated_at,
    )


class _Db:
    """The store's SQL (its schema installed when made); runs only on the store's thread,
    one transaction per call."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        _VERSION.install(self.conn, _SCHEMA, migrate=self._migrate)

    def _write(self, job: Callable[[], R]) -> R:
        return write(self.conn, job)

    def _migrate(self) -> None:
        """Bring a version 1 file written before ``updated_at`` up to date (see above)."""
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(touba_checkpoints)")}
        if "updated_at" not in columns:
            self.conn.execute("ALTER TABLE touba_checkpoints ADD COLUMN updated_at TEXT")
        self.conn.execute(_INDEX)

    def save(self, checkpoint_id: str, checkpoint: dict[str, JSON], body: str) -> None:
        def job() -> None:
            now = datetime.now(UTC).isoformat()
            try:
                self.conn.execute(
                    "INSERT INTO touba_checkpoints (id, run_id, invocation_id, agent_ref, "
                    "created_at, updated_at, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (checkpoint_id, *identity_of(checkpoint), now, now, body),
                )
            except sqlite3.IntegrityError as e:
                raise duplicate_checkpoint(checkpoint_id) from e

        self._write(job)

    def get(self, checkpoint_id: str) -> str | None:
        sql = "SELECT body FROM touba_checkpoints WHERE id = ?"
        row = self.conn.execute(sql, (checkpoint_id,)).fetchone()
        return None if row is None else str(row[0])

    def take(self, checkpoint_id: str) -> str | None:
        def job() -> str | None:
            body = self.get(checkpoint_id)
            if body is not None:
                self.conn.execute("DELETE FROM touba_checkpoints WHERE id = ?", (checkpoint_id,))
            return body

        return self._write(job)

    def replace(
        self,
        checkpoint_id: str,
        checkpoint: dict[str, JSON] | None,
        body: str | None,
        revision: int,
    ) -> bool:
        # BEGIN IMMEDIATE holds the file's write lock from the read to the write, so no
        # other connection (or process) can change the row in between; comparing in
        # Python applies revision_of exactly as the other stores do.
        def job() -> bool:
            current = decode_checkpoint(self.get(checkpoint_id))
            if current is None or revision_of(current) != revision:
                return False
            if checkpoint is None or body is None:
                self.conn.execute("DELETE FROM touba_checkpoints WHERE id = ?", (checkpoint_id,))
            else:
                self.conn.execute(
                    "UPDATE touba_checkpoints SET run_id = ?, invocation_id = ?, agent_ref = ?, "
                    "updated_at = ?, body = ? WHERE id = ?",
                    (*identity_of(checkpoint), datetime.now(UTC).isoformat(), body, checkpoint_id),
                )
            return True

        return self._write(job)

    def owned(self, run_ids: frozenset[str], user: str | None) -> list[tuple[str, str, str, str]]:
        return [
            row
            for row in self.list(None)
            if owned_checkpoint(_run_column(self.conn, row[0]), row[1], run_ids, user)
        ]

    def erase_owned(self, run_ids: frozenset[str], user: str | None) -> int:
        before = int(self.conn.execute("PRAGMA secure_delete").fetchone()[0])
        self.conn.execute("PRAGMA secure_delete=ON")
        try:

            def job() -> int:
                found = self.owned(run_ids, user)
                for row in found:
                    self.conn.execute("DELETE FROM touba_checkpoints WHERE id = ?", (row[0],))
                return len(found)

            erased = self._write(job)
        finally:
            self.conn.execute(f"PRAGMA secure_delete={before}")
        with suppress(sqlite3.Error):  # a reader holds the WAL: the next checkpoint will do
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return erased

    def list(self, run_id: str | None) -> list[tuple[str, str, str, str]]:
        columns = "SELECT id, body, created_at, COALESCE(updated_at, created_at)"
        if run_id is None:
            query = self.conn.execute(f"{columns} FROM touba_checkpoints ORDER BY rowid")
        else:
            query = self.conn.execute(
                f"{columns} FROM touba_checkpoints WHERE run_id = ? ORDER BY rowid", (run_id,)
            )
        return [(str(a), str(b), str(c), str(d)) for a, b, c, d in query.fetchall()]


def _run_column(conn: sqlite3.Connection, checkpoint_id: str) -> str | None:
    row = conn.execute("SELECT run_id FROM touba_checkpoints WHERE id = ?", (checkpoint_id,))
    found = row.fetchone()
    return None if found is None or found[0] is None else str(found[0])


class SqliteCheckpointStore(OwnedSqliteStore[_Db]):
    """Checkpoints in a SQLite file, durable and shared by processes.

    Give exactly one of ``filename`` (checked and opened like
    :class:`~touba.history.sqlite.SqliteHistoryStore`'s: files created or
    reset to 0600 before opening, symbolic links and group- or
    other-writable directories refused with ``DecisionHistoryStorageUnsafe``;
    create the directory yourself, mode 0700) or ``database`` (an open
    ``sqlite3.Connection`` made with ``check_same_thread=False``, whose
    closing and file protection stay yours). The file may be the history
    store's. One thread owns the connection; close with ``close()`` or
    ``async with``. A file of another checkpoint schema version raises
    ConfigurationError at construction, untouched.

    Every write is one ``BEGIN IMMEDIATE`` transaction, so ``take`` and
    ``replace`` are atomic across connections and processes. Every SQLite
    failure raises ``CheckpointStoreUnavailable`` (retryable), chained, having
    changed nothing: the file stayed locked by another connection for longer
    than ``timeout`` seconds, the disk is full or failing, the file system is
    read-only, the file is corrupt.
    """

    durable = True

    _owner = "SqliteCheckpointStore"
    _version = _VERSION
    _unavailable = CheckpointStoreUnavailable

    def _build(self, conn: sqlite3.Connection) -> _Db:
        return _Db(conn)

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        """Store a new checkpoint, committed when this returns.

        ConfigurationError: the id exists (in any process's save), or the
        checkpoint is not JSON data; CheckpointStoreUnavailable: the file failed
        or stayed locked. Nothing is written then.
        """
        body = encode_checkpoint(checkpoint)
        await self._run(lambda: self._db.save(checkpoint_id, checkpoint, body))

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """A detached copy, or None. ConfigurationError for a damaged row."""
        return decode_checkpoint(await self._run(lambda: self._db.get(checkpoint_id)))

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        """Remove and return it in one transaction: of concurrent takers, in this
        process or others, exactly one gets it and the others None."""
        return decode_checkpoint(await self._run(lambda: self._db.take(checkpoint_id)))

    async def replace(
        self, checkpoint_id: str, checkpoint: dict[str, JSON] | None, *, revision: int
    ) -> bool:
        """Compare-and-swap on the stored ``revision`` (see :class:`CheckpointStore`),
        atomic across processes.

        True when it replaced (or, with None, removed) the checkpoint; False,
        changing nothing, when it is absent or at another revision. Never
        creates one. ConfigurationError when ``checkpoint`` is not JSON or the
        stored row is damaged (nothing changed).
        """
        check_revision(revision)
        body = None if checkpoint is None else encode_checkpoint(checkpoint)
        return await self._run(lambda: self._db.replace(checkpoint_id, checkpoint, body, revision))

    async def list(self, *, run_id: str | None = None) -> list[CheckpointInfo]:
        """What each checkpoint is (never its content), oldest first; ``run_id``'s only
        when given. ConfigurationError when a row is damaged."""
        rows = await self._run(lambda: self._db.list(run_id))
        out = []
        for checkpoint_id, body, created_at, updated_at in rows:
            checkpoint = decode_checkpoint(body)
            assert checkpoint is not None
            info = _info(checkpoint_id, checkpoint, created_at, updated_at)
            if run_id is None or info.run_id == run_id:  # rows of older files kept raw ids
                out.append(info)
        return out

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def owned_checkpoints(
        self, *, run_ids: Collection[str] = (), user: str | None = None
    ) -> builtins.list[CheckpointInfo]:
        """The checkpoints of one of ``run_ids`` (their ``run_id``, or their body's
        ``session_id``) or of ``user`` (their body's ``user_id``), oldest first; a
        damaged row is found by its ``run_id`` alone. Reads every row (checkpoints are
        the paused invocations: few)."""
        runs, who = owned_ids(run_ids, user)
        rows = await self._run(lambda: self._db.owned(runs, who))
        out = []
        for checkpoint_id, body, created_at, updated_at in rows:
            try:
                checkpoint = decode_checkpoint(body) or {}
            except ConfigurationError:
                checkpoint = {}
            out.append(_info(checkpoint_id, checkpoint, created_at, updated_at))
        return out

    async def erase_owned(self, *, run_ids: Collection[str] = (), user: str | None = None) -> int:
        """Delete the checkpoints :meth:`owned_checkpoints` finds (running ones too) in one
        transaction whose deleted bytes SQLite overwrites (``PRAGMA secure_delete``),
        then checkpoint the WAL; return how many. ``CheckpointStoreUnavailable``
        (nothing deleted) when the file fails."""
        runs, who = owned_ids(run_ids, user)
        return await self._run(lambda: self._db.erase_owned(runs, who))
