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
  no symbolic links, private directory). Checkpoints hold the invocation's
  input, arguments, results and trace: give ``encryption=`` to seal each body
  at rest (:mod:`touba.runtime._sealing`).
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
import os
import sqlite3
from collections.abc import Callable, Collection
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Final, Literal, Protocol, TypeVar, runtime_checkable

from touba._encryption import Encryption
from touba.errors import (
    CheckpointStoreUnavailable,
    ConfigurationError,
    DecisionHistoryRecordInvalid,
)
from touba.history._model import JSON, STORED_JSON_DEPTH, canonical_json, json_problem, parse_json
from touba.runtime._owned_sqlite import OwnedSqliteStore, SchemaVersion, write
from touba.runtime._sealing import Cursor, RowSeal, check_batch, rotate

__all__ = [
    "CheckpointInfo",
    "CheckpointStatus",
    "CheckpointStore",
    "MemoryCheckpointStore",
    "PURGE_BATCH",
    "SqliteCheckpointStore",
    "check_revision",
    "decode_checkpoint",
    "duplicate_checkpoint",
    "encode_checkpoint",
    "identity_of",
    "owned_checkpoint",
    "owned_ids",
    "owned_sealed",
    "purge_cutoff",
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
# ``purge_before``'s: checkpoints by their last write (older rows: by their creation).
_UPDATED_INDEX = (
    "CREATE INDEX IF NOT EXISTS touba_checkpoints_updated "
    "ON touba_checkpoints (COALESCE(updated_at, created_at))"
)
# The checkpoints ``purge_before`` removes: last written before ``?`` (ISO 8601 UTC text,
# ordered as the times are), not running. A body that is not JSON is left alone.
_COUNT_OLD = (
    "SELECT COUNT(*) FROM touba_checkpoints WHERE COALESCE(updated_at, created_at) < ? "
    "AND json_valid(body) AND COALESCE(json_extract(body, '$.status'), '') IS NOT 'running'"
)
_DELETE_OLD = (
    "DELETE FROM touba_checkpoints WHERE id IN (SELECT id FROM touba_checkpoints "
    "WHERE COALESCE(updated_at, created_at) < ? AND json_valid(body) "
    "AND COALESCE(json_extract(body, '$.status'), '') IS NOT 'running' LIMIT ?)"
)


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


def owned_sealed(
    seal: RowSeal,
    checkpoint_id: str,
    run_id: str | None,
    stored: object,
    run_ids: Collection[str],
    user: str | None,
) -> bool:
    """:func:`owned_checkpoint` for a stored (maybe sealed) body: opened first, unless its
    ``run_id`` already matches. A body that does not open (damaged, moved, or sealed with
    a key the store was not given) cannot say whose it is, so rather than skip what may
    be the user's row, ``DecisionHistoryRecordInvalid`` names the checkpoint id (nothing
    was erased): open the store with its keys, or delete that checkpoint's row."""
    if run_id is not None and run_id in run_ids:
        return True
    try:
        body = seal.open(stored, checkpoint_id)
    except DecisionHistoryRecordInvalid as e:
        raise DecisionHistoryRecordInvalid(
            f"checkpoint {checkpoint_id!r} does not open with this store's encryption "
            "(damaged, moved, or sealed with a key not given), so whose it is cannot be "
            "told; nothing was erased. Open the store with every key, or delete that "
            "checkpoint's row, and run again"
        ) from e
    return owned_checkpoint(run_id, body, run_ids, user)


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


PURGE_BATCH: Final = 500
"""How many checkpoints one transaction of ``purge_before`` removes at most."""


def purge_cutoff(before: object, batch_size: object) -> tuple[datetime, int]:
    """``purge_before``'s arguments, checked: ``ConfigurationError`` (nothing removed) for
    a ``before`` that is not a timezone-aware datetime or a ``batch_size`` that is not a
    positive int.

    Every store's ``purge_before`` removes the checkpoints last written (their
    ``updated_at``) before ``before`` whose status is not ``running``: one awaiting
    approval that long, or failed that long, is abandoned; a ``running`` one is a
    worker's (alive, or crashed: ``resume(worker_stopped=True)`` decides), and stays.
    A completed invocation leaves no checkpoint, so none is "finished". A checkpoint's
    trace goes with it.
    """
    if not isinstance(before, datetime) or before.tzinfo is None:
        raise ConfigurationError(
            f"before must be a timezone-aware datetime, got {before!r}; nothing was removed"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
    return before, batch_size


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

    async def purge_before(
        self, before: datetime, *, dry_run: bool = False, batch_size: int = PURGE_BATCH
    ) -> int:
        """Remove the checkpoints last written before ``before`` that no worker runs
        (status ``awaiting_approval`` or ``failed``; a ``running`` one stays); how many
        (with ``dry_run``: how many would go, none removed). See :func:`purge_cutoff`
        for what it raises."""
        cutoff, _ = purge_cutoff(before, batch_size)
        gone = [
            checkpoint_id
            for checkpoint_id, body in self._items.items()
            if datetime.fromisoformat(self._times[checkpoint_id][1]) < cutoff
            and status_of(json.loads(body)) != "running"
        ]
        if not dry_run:  # no await in between: atomic
            for checkpoint_id in gone:
                del self._items[checkpoint_id]
                del self._times[checkpoint_id]
        return len(gone)

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

    def __init__(self, conn: sqlite3.Connection, seal: RowSeal) -> None:
        self.conn = conn
        self.seal = seal
        _VERSION.install(self.conn, _SCHEMA, migrate=self._migrate)

    def _write(self, job: Callable[[], R]) -> R:
        return write(self.conn, job)

    def _migrate(self) -> None:
        """Bring a version 1 file written before ``updated_at`` up to date (see above)."""
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(touba_checkpoints)")}
        if "updated_at" not in columns:
            self.conn.execute("ALTER TABLE touba_checkpoints ADD COLUMN updated_at TEXT")
        self.conn.execute(_INDEX)
        self.conn.execute(_UPDATED_INDEX)

    def save(self, checkpoint_id: str, checkpoint: dict[str, JSON], body: str) -> None:
        def job() -> None:
            now = datetime.now(UTC).isoformat()
            try:
                self.conn.execute(
                    "INSERT INTO touba_checkpoints (id, run_id, invocation_id, agent_ref, "
                    "created_at, updated_at, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        checkpoint_id,
                        *identity_of(checkpoint),
                        now,
                        now,
                        self.seal.seal(body, checkpoint_id),
                    ),
                )
            except sqlite3.IntegrityError as e:
                raise duplicate_checkpoint(checkpoint_id) from e

        self._write(job)

    def get(self, checkpoint_id: str) -> str | None:
        sql = "SELECT body FROM touba_checkpoints WHERE id = ?"
        row = self.conn.execute(sql, (checkpoint_id,)).fetchone()
        return None if row is None else self.seal.open(row[0], checkpoint_id)

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
                    (
                        *identity_of(checkpoint),
                        datetime.now(UTC).isoformat(),
                        self.seal.seal(body, checkpoint_id),
                        checkpoint_id,
                    ),
                )
            return True

        return self._write(job)

    def owned(self, run_ids: frozenset[str], user: str | None) -> list[tuple[str, str, str, str]]:
        found = self.conn.execute(
            "SELECT id, run_id, body, created_at, COALESCE(updated_at, created_at) "
            "FROM touba_checkpoints ORDER BY rowid"
        ).fetchall()
        out = []
        for checkpoint_id, run_id, stored, created, updated in found:
            where = str(checkpoint_id)
            run = None if run_id is None else str(run_id)
            if owned_sealed(self.seal, where, run, stored, run_ids, user):
                try:  # opened again for the listing: a row matched by its run_id alone
                    body = self.seal.open(stored, where)
                except DecisionHistoryRecordInvalid:
                    body = ""
                out.append((where, body, str(created), str(updated)))
        return out

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
        return [
            (str(a), self.seal.open(b, str(a)), str(c), str(d)) for a, b, c, d in query.fetchall()
        ]

    def rekey(self, batch: int, after: Cursor) -> tuple[int, Cursor]:
        """Re-seal with the current key up to ``batch`` bodies sealed with another, past
        the id ``after`` (None: from the start) in id order; how many and the last id."""
        start = None if after is None else after[0]

        def job() -> tuple[int, Cursor]:
            found = self.conn.execute(
                "SELECT id, body FROM touba_checkpoints WHERE (? IS NULL OR id > ?) "
                "AND substr(body, 1, ?) <> ? ORDER BY id LIMIT ?",
                (start, start, *self.seal.stale(), batch),
            ).fetchall()
            for checkpoint_id, body in found:
                self.conn.execute(
                    "UPDATE touba_checkpoints SET body = ? WHERE id = ?",
                    (self.seal.again(body, checkpoint_id), checkpoint_id),
                )
            return len(found), ((found[-1][0],) if found else after)

        return self._write(job)

    def purge_before(self, before: str, dry_run: bool, size: int) -> int:
        """One batch (at most ``size``) of :func:`purge_cutoff`'s checkpoints, in its
        own transaction with ``secure_delete`` on (as an erase); with ``dry_run``, how
        many there are in all."""
        if dry_run:
            return int(self.conn.execute(_COUNT_OLD, (before,)).fetchone()[0])

        def job() -> int:
            return self.conn.execute(_DELETE_OLD, (before, size)).rowcount

        secure = int(self.conn.execute("PRAGMA secure_delete").fetchone()[0])
        self.conn.execute("PRAGMA secure_delete=ON")  # the deleted bytes overwritten
        try:
            removed = self._write(job)
        finally:
            self.conn.execute(f"PRAGMA secure_delete={secure}")
        if removed < size:  # the last batch: no copy left in the WAL either
            with suppress(sqlite3.Error):  # a reader holds the WAL: its next checkpoint
                self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return removed

    def purge_sealed(
        self, before: str, dry_run: bool, size: int, after: str | None
    ) -> tuple[int, int, str | None]:
        """:meth:`purge_before` for sealed bodies, whose status SQL cannot read: up to
        ``size`` checkpoints last written before ``before``, past the id ``after`` (None:
        the start) in id order, each opened; those not ``running`` deleted in one
        transaction (a body that does not open stays, as a damaged one does). How many
        went (with ``dry_run``: would go), how many were read, and the last id read."""

        def job() -> tuple[int, int, str | None]:
            found = self.conn.execute(
                "SELECT id, body FROM touba_checkpoints WHERE COALESCE(updated_at, created_at)"
                " < ? AND (? IS NULL OR id > ?) ORDER BY id LIMIT ?",
                (before, after, after, size),
            ).fetchall()
            gone = 0
            for checkpoint_id, stored in found:
                try:
                    status = status_of(
                        decode_checkpoint(self.seal.open(stored, checkpoint_id)) or {}
                    )
                except (ConfigurationError, DecisionHistoryRecordInvalid):
                    continue
                if status == "running":
                    continue
                if not dry_run:
                    self.conn.execute(
                        "DELETE FROM touba_checkpoints WHERE id = ?", (checkpoint_id,)
                    )
                gone += 1
            return gone, len(found), (str(found[-1][0]) if found else after)

        if dry_run:
            return job()
        secure = int(self.conn.execute("PRAGMA secure_delete").fetchone()[0])
        self.conn.execute("PRAGMA secure_delete=ON")  # the deleted bytes overwritten
        try:
            done = self._write(job)
        finally:
            self.conn.execute(f"PRAGMA secure_delete={secure}")
        if done[1] < size:  # the last batch: no copy left in the WAL either
            with suppress(sqlite3.Error):  # a reader holds the WAL: its next checkpoint
                self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return done


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

    ``encryption`` (a :class:`touba.Encryption`): each body is sealed at rest,
    bound to its checkpoint id; ``id``, ``run_id``, ``invocation_id``,
    ``agent_ref`` and the dates stay plaintext for ``list`` (which opens each
    body for its status and revision). A body that does not open raises
    ``DecisionHistoryRecordInvalid`` (:mod:`touba.runtime._sealing`); ``rekey()``
    rotates keys.
    """

    durable = True

    _owner = "SqliteCheckpointStore"
    _version = _VERSION
    _unavailable = CheckpointStoreUnavailable

    def __init__(
        self,
        filename: str | os.PathLike[str] | None = None,
        *,
        database: sqlite3.Connection | None = None,
        timeout: float = 5.0,
        encryption: Encryption | None = None,
    ) -> None:
        self._seal = RowSeal(encryption, "touba.checkpoints", "touba_checkpoints", "body")
        self._rekey_after: Cursor = None
        super().__init__(filename, database=database, timeout=timeout)

    def _build(self, conn: sqlite3.Connection) -> _Db:
        return _Db(conn, self._seal)

    async def rekey(self, *, batch: int = 100) -> int:
        """Re-seal with the current key up to ``batch`` checkpoints sealed with another,
        in one transaction; how many (0: rotation is done). Resumable: call it until it
        returns 0; older keys stay needed until then. ``ConfigurationError`` without
        ``encryption=`` or for a ``batch`` under 1; ``DecisionHistoryRecordInvalid``
        (nothing changed) for a body that does not open."""
        check_batch(batch)
        self._seal.stale()

        async def one_batch(after: Cursor) -> tuple[int, Cursor]:
            return await self._run(lambda: self._db.rekey(batch, after))

        done, self._rekey_after = await rotate(one_batch, self._rekey_after, batch)
        return done

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

    async def purge_before(
        self, before: datetime, *, dry_run: bool = False, batch_size: int = PURGE_BATCH
    ) -> int:
        """Remove the checkpoints last written before ``before`` that no worker runs
        (see :func:`purge_cutoff`), at most ``batch_size`` per transaction so that other
        processes wait little; how many (with ``dry_run``: how many would go, none
        removed). A damaged row stays. CheckpointStoreUnavailable when the file fails
        (the batches committed before stay done)."""
        cutoff, size = purge_cutoff(before, batch_size)
        text = cutoff.astimezone(UTC).isoformat()
        if self._seal.encryption is not None:  # the status is sealed: read in Python
            total, after = 0, None
            while True:
                gone, read, after = await self._run(
                    partial(self._db.purge_sealed, text, dry_run, size, after)
                )
                total += gone
                if read < size:
                    return total
        if dry_run:
            return await self._run(lambda: self._db.purge_before(text, True, size))
        total = 0
        while True:
            removed = await self._run(lambda: self._db.purge_before(text, False, size))
            total += removed
            if removed < size:
                return total

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    async def owned_checkpoints(
        self, *, run_ids: Collection[str] = (), user: str | None = None
    ) -> builtins.list[CheckpointInfo]:
        """The checkpoints of one of ``run_ids`` (their ``run_id``, or their body's
        ``session_id``) or of ``user`` (their body's ``user_id``), oldest first; a
        damaged row is found by its ``run_id`` alone. With ``encryption=`` each body is
        opened: one that does not open, unless its ``run_id`` matches, raises
        ``DecisionHistoryRecordInvalid`` naming its id (a row is never skipped
        unread). Reads every row (checkpoints are the paused invocations: few)."""
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
