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
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Final, Literal, Protocol, Self, TypeVar, runtime_checkable

from touba.errors import ConfigurationError
from touba.history._model import JSON, canonical_json
from touba.runtime._owned_sqlite import OwnedSqlite, SchemaVersion, write

__all__ = [
    "CheckpointInfo",
    "CheckpointStatus",
    "CheckpointStore",
    "MemoryCheckpointStore",
    "SqliteCheckpointStore",
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
        created_at TEXT NOT NULL, body TEXT NOT NULL)""",
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

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None: ...

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None: ...

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None: ...


def revision_of(checkpoint: dict[str, JSON]) -> int:
    value = checkpoint.get("revision", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def status_of(checkpoint: dict[str, JSON]) -> str:
    value = checkpoint.get("status", "awaiting_approval")
    return value if isinstance(value, str) else "awaiting_approval"


def _encode(checkpoint: dict[str, JSON]) -> str:
    try:
        return canonical_json(checkpoint)
    except (TypeError, ValueError) as e:
        raise ConfigurationError(
            f"a checkpoint must be JSON-serialisable ({e}); capabilities must return JSON data"
        ) from e


def _duplicate(checkpoint_id: str) -> ConfigurationError:
    return ConfigurationError(f"checkpoint {checkpoint_id!r} already exists; ids must be new")


class MemoryCheckpointStore:
    """Checkpoints in this process's memory, lost when it exits. Unbounded."""

    durable = False

    def __init__(self) -> None:
        self._items: dict[str, str] = {}
        self._times: dict[str, tuple[str, str]] = {}

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        if checkpoint_id in self._items:
            raise _duplicate(checkpoint_id)
        self._items[checkpoint_id] = _encode(checkpoint)
        now = datetime.now(UTC).isoformat()
        self._times[checkpoint_id] = (now, now)

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        body = self._items.get(checkpoint_id)
        return None if body is None else dict(json.loads(body))

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        body = self._items.pop(checkpoint_id, None)  # no await in between: atomic
        self._times.pop(checkpoint_id, None)
        return None if body is None else dict(json.loads(body))

    async def replace(
        self, checkpoint_id: str, checkpoint: dict[str, JSON] | None, *, revision: int
    ) -> bool:
        body = None if checkpoint is None else _encode(checkpoint)
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
        rows = []
        for checkpoint_id, body in self._items.items():
            info = _info(checkpoint_id, json.loads(body), *self._times[checkpoint_id])
            if run_id is None or info.run_id == run_id:
                rows.append(info)
        return sorted(rows, key=lambda r: r.created_at)

    def __len__(self) -> int:
        return len(self._items)


def _info(
    checkpoint_id: str, checkpoint: dict[str, JSON], created_at: str, updated_at: str
) -> CheckpointInfo:
    def text(name: str) -> str | None:
        value = checkpoint.get(name)
        return value if isinstance(value, str) else None

    return CheckpointInfo(
        checkpoint_id=checkpoint_id,
        run_id=text("run_id"),
        invocation_id=text("invocation_id"),
        agent_ref=text("agent_ref"),
        status=status_of(checkpoint),
        revision=revision_of(checkpoint),
        created_at=created_at,
        updated_at=updated_at,
    )


class _Db:
    """The store's SQL; runs only on the store's thread, one transaction per call."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def _write(self, job: Callable[[], R]) -> R:
        return write(self.conn, job)

    def init(self) -> None:
        _VERSION.install(self.conn, _SCHEMA)

    def save(self, checkpoint_id: str, checkpoint: dict[str, JSON], body: str) -> None:
        def job() -> None:
            try:
                self.conn.execute(
                    "INSERT INTO touba_checkpoints (id, run_id, invocation_id, agent_ref, "
                    "created_at, body) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        checkpoint_id,
                        checkpoint.get("run_id"),
                        checkpoint.get("invocation_id"),
                        checkpoint.get("agent_ref"),
                        datetime.now(UTC).isoformat(),
                        body,
                    ),
                )
            except sqlite3.IntegrityError as e:
                raise _duplicate(checkpoint_id) from e

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


def _decode(body: str | None) -> dict[str, JSON] | None:
    if body is None:
        return None
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ConfigurationError("a stored checkpoint is not a JSON object; it cannot be resumed")
    return value


def _build(conn: sqlite3.Connection) -> _Db:
    db = _Db(conn)
    db.init()
    return db


class SqliteCheckpointStore:
    """Checkpoints in a SQLite file, durable and shared by processes.

    Give exactly one of ``filename`` (checked and opened like
    :class:`~touba.history.sqlite.SqliteHistoryStore`'s: files created or
    reset to 0600 before opening, symbolic links and group- or
    other-writable directories refused with ``DecisionHistoryStorageUnsafe``;
    create the directory yourself, mode 0700) or ``database`` (an open
    ``sqlite3.Connection`` made with ``check_same_thread=False``, whose
    closing and file protection stay yours). The file may be the history
    store's. One thread owns the connection; close with ``close()`` or
    ``async with``.
    """

    def __init__(
        self,
        filename: str | os.PathLike[str] | None = None,
        *,
        database: sqlite3.Connection | None = None,
        timeout: float = 5.0,
    ) -> None:
        self._sqlite = OwnedSqlite(
            "SqliteCheckpointStore",
            filename=filename,
            database=database,
            timeout=timeout,
            check=_VERSION.check,
            build=_build,
        )
        self._db = self._sqlite.db

    async def _run(self, job: Callable[[], R]) -> R:
        return await self._sqlite.run(job)

    async def save(self, checkpoint_id: str, checkpoint: dict[str, JSON]) -> None:
        body = _encode(checkpoint)
        await self._run(lambda: self._db.save(checkpoint_id, checkpoint, body))

    async def get(self, checkpoint_id: str) -> dict[str, JSON] | None:
        return _decode(await self._run(lambda: self._db.get(checkpoint_id)))

    async def take(self, checkpoint_id: str) -> dict[str, JSON] | None:
        return _decode(await self._run(lambda: self._db.take(checkpoint_id)))

    async def close(self) -> None:
        """Close the connection it opened and stop its thread."""
        await self._sqlite.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
