"""The SQLite backend of ToubaSaver: one private file, WAL, one owned thread.

- **File.** Opened by :func:`touba.history._files.open_private_sqlite`: 0600 in a private
  directory, symbolic links refused, WAL, ``synchronous=FULL``. The schema's version is
  ``PRAGMA user_version``; a file holding other tables, or another version, is refused
  with :class:`~touba.errors.DecisionHistoryRecordInvalid` before anything is written.
- **Thread.** Every statement runs on one :class:`~touba.history._sqlite.OwnedThread`
  (the connection's owner), in order; a call handed over finishes even if its caller is
  cancelled. Each write is one ``BEGIN IMMEDIATE`` transaction, so a ``kill -9`` leaves
  it whole or absent; reads run in one deferred transaction (one WAL snapshot).
- **Tables.** ``lg_checkpoints`` (one row per checkpoint, its spans as JSON),
  ``lg_blobs`` (channel values by version), ``lg_writes``, ``lg_logs`` (each log's token
  and length) and ``lg_entries`` (one row per logged item, keyed by position). A step
  inserts its new entries, one checkpoint row, its new blobs and writes: O(what it
  added), whatever the thread's length. Pages of 1 KiB (for a new file): a step dirties
  a handful of pages in as many B-trees, and smaller pages cut what SQLite writes per
  step about threefold against 4 KiB (bench/langgraph_saver.py).
- **Errors.** A locked file (past the busy timeout), a full or failing disk:
  :class:`~touba.errors.DecisionHistoryStoreUnavailable`, the ``sqlite3`` error chained;
  the transaction was rolled back.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._files import open_private_sqlite
from touba.history._sqlite import OwnedThread, describe, failure_kind, transaction
from touba.integrations.langgraph._backend import (
    CheckpointPage,
    CheckpointRecord,
    CheckpointRow,
    HeldLog,
    ListQuery,
    LogKey,
    LogRead,
    LogState,
    PruneStrategy,
    PutCheckpoint,
    PutResult,
    Span,
    TypedBlob,
    WriteRecord,
    merge_spans,
    unheld_spans,
)
from touba.integrations.langgraph._memory import matches

__all__ = ["SqliteSaverBackend"]

R = TypeVar("R")

SCHEMA_VERSION = 1
BUSY_TIMEOUT_SECONDS = 5.0
_TABLES = ("lg_checkpoints", "lg_blobs", "lg_writes", "lg_logs", "lg_entries")
_SCHEMA = """
CREATE TABLE lg_checkpoints (
    thread_id TEXT NOT NULL,
    ns TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    parent_id TEXT,
    type TEXT NOT NULL,
    checkpoint BLOB NOT NULL,
    metadata_type TEXT NOT NULL,
    metadata BLOB NOT NULL,
    metadata_json TEXT NOT NULL,
    run_id TEXT,
    versions TEXT NOT NULL,
    logs TEXT NOT NULL,
    PRIMARY KEY (thread_id, ns, checkpoint_id)
);
CREATE INDEX lg_checkpoints_run ON lg_checkpoints (run_id) WHERE run_id IS NOT NULL;
CREATE TABLE lg_blobs (
    thread_id TEXT NOT NULL,
    ns TEXT NOT NULL,
    channel TEXT NOT NULL,
    version TEXT NOT NULL,
    type TEXT,
    data BLOB,
    PRIMARY KEY (thread_id, ns, channel, version)
);
CREATE TABLE lg_writes (
    thread_id TEXT NOT NULL,
    ns TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    channel TEXT NOT NULL,
    type TEXT NOT NULL,
    data BLOB NOT NULL,
    task_path TEXT NOT NULL,
    PRIMARY KEY (thread_id, ns, checkpoint_id, task_id, idx)
);
CREATE TABLE lg_logs (
    thread_id TEXT NOT NULL,
    ns TEXT NOT NULL,
    channel TEXT NOT NULL,
    token TEXT NOT NULL,
    length INTEGER NOT NULL,
    PRIMARY KEY (thread_id, ns, channel)
) WITHOUT ROWID;
CREATE TABLE lg_entries (
    thread_id TEXT NOT NULL,
    ns TEXT NOT NULL,
    channel TEXT NOT NULL,
    position INTEGER NOT NULL,
    type TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (thread_id, ns, channel, position)
);
"""

_RECORD = (
    "SELECT thread_id, ns, checkpoint_id, parent_id, type, checkpoint, metadata_type, "
    "metadata, metadata_json, run_id, versions, logs FROM lg_checkpoints"
)


def _check_schema(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if version == 0 and not names:
        return
    if version != SCHEMA_VERSION or not set(_TABLES) <= names:
        raise DecisionHistoryRecordInvalid(
            f"this SQLite file is not a ToubaSaver store of schema {SCHEMA_VERSION} (user_version "
            f"{version}, tables {sorted(names)}); it was not modified. Give ToubaSaver a file "
            "of its own"
        )


def _init_schema(conn: sqlite3.Connection) -> None:
    if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
        return
    with transaction(conn):
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _translate(error: Exception) -> Exception:
    kind = failure_kind(error)
    if kind is None:
        return error
    if kind == "not_a_database":
        return DecisionHistoryRecordInvalid(
            f"the ToubaSaver SQLite file is not a database ({describe(error)}); it was not "
            "modified. Check the path, or restore the file from a backup"
        )
    if kind == "misuse":
        return ConfigurationError(f"the ToubaSaver SQLite store is closed ({describe(error)})")
    what = "stayed locked by another connection" if kind == "locked" else "failed"
    return DecisionHistoryStoreUnavailable(
        f"the ToubaSaver SQLite store {what} ({describe(error)}); nothing was written and the "
        "previous state is kept. Retry once the disk (or the other writer) is done"
    )


def _spans_json(logs: Mapping[str, Sequence[Span]]) -> str:
    return json.dumps({c: [[s.start, s.end] for s in spans] for c, spans in logs.items()})


def _record(row: Sequence[Any]) -> CheckpointRecord:
    try:
        logs = {
            channel: tuple(Span(int(a), int(b)) for a, b in spans)
            for channel, spans in json.loads(row[11]).items()
        }
        versions = {str(k): str(v) for k, v in json.loads(row[10]).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise DecisionHistoryRecordInvalid(
            f"checkpoint {row[2]!r}: its stored versions or spans cannot be read"
        ) from e
    return CheckpointRecord(
        thread_id=row[0],
        checkpoint_ns=row[1],
        checkpoint_id=row[2],
        parent_id=row[3],
        checkpoint=(row[4], bytes(row[5])),
        metadata=(row[6], bytes(row[7])),
        metadata_json=row[8],
        run_id=row[9],
        versions=versions,
        logs=logs,
    )


class _Db:
    """The backend's SQL, run only on its owned thread."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    # -- writes --------------------------------------------------------------------------

    def put(self, r: PutCheckpoint) -> PutResult:
        c = self.conn
        spans: dict[str, tuple[Span, ...]] = {}
        states: dict[str, LogState] = {}
        with transaction(c):
            for append in r.logs:
                key = (r.thread_id, r.checkpoint_ns, append.channel)
                found = c.execute(
                    "SELECT token, length FROM lg_logs WHERE thread_id = ? AND ns = ? "
                    "AND channel = ?",
                    key,
                ).fetchone()
                token, length = (found[0], found[1]) if found else (uuid.uuid4().hex, 0)
                if any(s.end > length for s in append.base):
                    raise DecisionHistoryRecordInvalid(
                        f"checkpoint {r.checkpoint_id}: channel {append.channel!r} starts with "
                        f"positions past its log's end ({length}); nothing was written"
                    )
                c.executemany(
                    "INSERT INTO lg_entries (thread_id, ns, channel, position, type, data) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [(*key, length + i, t, d) for i, (t, d) in enumerate(append.items)],
                )
                end = length + len(append.items)
                c.execute(
                    "INSERT INTO lg_logs (thread_id, ns, channel, token, length) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (thread_id, ns, channel) "
                    "DO UPDATE SET length = excluded.length",
                    (*key, token, end),
                )
                spans[append.channel] = merge_spans((*append.base, Span(length, end)))
                states[append.channel] = LogState(token, end)
            c.executemany(
                "INSERT OR IGNORE INTO lg_blobs (thread_id, ns, channel, version, type, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        r.thread_id,
                        r.checkpoint_ns,
                        b.channel,
                        b.version,
                        None if b.blob is None else b.blob[0],
                        None if b.blob is None else b.blob[1],
                    )
                    for b in r.blobs
                ],
            )
            c.execute(
                "INSERT OR REPLACE INTO lg_checkpoints (thread_id, ns, checkpoint_id, parent_id, "
                "type, checkpoint, metadata_type, metadata, metadata_json, run_id, versions, "
                "logs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r.thread_id,
                    r.checkpoint_ns,
                    r.checkpoint_id,
                    r.parent_id,
                    r.checkpoint[0],
                    r.checkpoint[1],
                    r.metadata[0],
                    r.metadata[1],
                    r.metadata_json,
                    r.run_id,
                    json.dumps(dict(r.versions)),
                    _spans_json(spans),
                ),
            )
        return PutResult(spans=spans, logs=states)

    def put_writes(
        self, thread_id: str, ns: str, checkpoint_id: str, writes: Sequence[WriteRecord]
    ) -> None:
        rows = [
            (thread_id, ns, checkpoint_id, w.task_id, w.idx, w.channel, *w.value, w.task_path)
            for w in writes
        ]
        sql = (
            " INTO lg_writes (thread_id, ns, checkpoint_id, task_id, idx, channel, type, data, "
            "task_path) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        with transaction(self.conn):
            self.conn.executemany("INSERT OR IGNORE" + sql, [r for r in rows if r[4] >= 0])
            self.conn.executemany("INSERT OR REPLACE" + sql, [r for r in rows if r[4] < 0])

    def delete_thread(self, thread_id: str) -> None:
        with transaction(self.conn):
            for table in _TABLES:
                self.conn.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread_id,))  # noqa: S608

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        c = self.conn
        with transaction(c):
            for run_id in run_ids:
                found = c.execute(
                    "SELECT thread_id, ns, checkpoint_id FROM lg_checkpoints WHERE run_id = ?",
                    (run_id,),
                ).fetchall()
                c.executemany(
                    "DELETE FROM lg_writes WHERE thread_id = ? AND ns = ? AND checkpoint_id = ?",
                    found,
                )
                c.execute("DELETE FROM lg_checkpoints WHERE run_id = ?", (run_id,))

    def copy_thread(self, source: str, target: str) -> None:
        c = self.conn
        if source == target:
            return
        with transaction(c):
            offsets: dict[tuple[str, str], int] = {}
            for ns, channel, length in c.execute(
                "SELECT ns, channel, length FROM lg_logs WHERE thread_id = ?", (source,)
            ).fetchall():
                found = c.execute(
                    "SELECT length FROM lg_logs WHERE thread_id = ? AND ns = ? AND channel = ?",
                    (target, ns, channel),
                ).fetchone()
                offset = offsets[(ns, channel)] = found[0] if found else 0
                c.execute(
                    "INSERT INTO lg_entries (thread_id, ns, channel, position, type, data) "
                    "SELECT ?, ns, channel, position + ?, type, data FROM lg_entries "
                    "WHERE thread_id = ? AND ns = ? AND channel = ?",
                    (target, offset, source, ns, channel),
                )
                c.execute(
                    "INSERT INTO lg_logs (thread_id, ns, channel, token, length) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (thread_id, ns, channel) "
                    "DO UPDATE SET length = excluded.length",
                    (target, ns, channel, uuid.uuid4().hex, offset + length),
                )
            c.execute(
                "INSERT OR IGNORE INTO lg_blobs (thread_id, ns, channel, version, type, data) "
                "SELECT ?, ns, channel, version, type, data FROM lg_blobs WHERE thread_id = ?",
                (target, source),
            )
            c.execute(
                "INSERT OR IGNORE INTO lg_writes (thread_id, ns, checkpoint_id, task_id, idx, "
                "channel, type, data, task_path) SELECT ?, ns, checkpoint_id, task_id, idx, "
                "channel, type, data, task_path FROM lg_writes WHERE thread_id = ?",
                (target, source),
            )
            rows = c.execute(_RECORD + " WHERE thread_id = ?", (source,)).fetchall()
            copied = []
            for row in rows:
                record = _record(row)
                logs = {
                    channel: tuple(
                        Span(
                            s.start + offsets.get((record.checkpoint_ns, channel), 0),
                            s.end + offsets.get((record.checkpoint_ns, channel), 0),
                        )
                        for s in spans
                    )
                    for channel, spans in record.logs.items()
                }
                copied.append((target, *row[1:11], _spans_json(logs)))
            c.executemany(
                "INSERT OR IGNORE INTO lg_checkpoints (thread_id, ns, checkpoint_id, parent_id, "
                "type, checkpoint, metadata_type, metadata, metadata_json, run_id, versions, "
                "logs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                copied,
            )

    def prune_keep_latest(self, thread_id: str) -> None:
        c = self.conn
        with transaction(c):
            names = [
                r[0]
                for r in c.execute(
                    "SELECT DISTINCT ns FROM lg_checkpoints WHERE thread_id = ?", (thread_id,)
                )
            ]
            for ns in names:
                row = c.execute(
                    _RECORD + " WHERE thread_id = ? AND ns = ? ORDER BY checkpoint_id DESC LIMIT 1",
                    (thread_id, ns),
                ).fetchone()
                keep = _record(row)
                where = "thread_id = ? AND ns = ?"
                key = (thread_id, ns)
                c.execute(
                    f"DELETE FROM lg_checkpoints WHERE {where} AND checkpoint_id != ?",  # noqa: S608
                    (*key, keep.checkpoint_id),
                )
                c.execute(
                    f"DELETE FROM lg_writes WHERE {where} AND checkpoint_id != ?",  # noqa: S608
                    (*key, keep.checkpoint_id),
                )
                blobs = c.execute(
                    "SELECT channel, version FROM lg_blobs WHERE thread_id = ? AND ns = ?", key
                ).fetchall()
                kept = set(keep.versions.items())
                c.executemany(
                    "DELETE FROM lg_blobs WHERE thread_id = ? AND ns = ? AND channel = ? "
                    "AND version = ?",
                    [(*key, ch, v) for ch, v in blobs if (ch, v) not in kept],
                )
                for (channel,) in c.execute(
                    "SELECT channel FROM lg_logs WHERE thread_id = ? AND ns = ?", key
                ).fetchall():
                    self._keep_entries(thread_id, ns, channel, keep.logs.get(channel, ()))
            # writes of namespaces without a checkpoint left
            c.execute(
                "DELETE FROM lg_writes WHERE thread_id = ? AND NOT EXISTS (SELECT 1 FROM "
                "lg_checkpoints k WHERE k.thread_id = lg_writes.thread_id AND k.ns = "
                "lg_writes.ns AND k.checkpoint_id = lg_writes.checkpoint_id)",
                (thread_id,),
            )

    def _keep_entries(self, thread_id: str, ns: str, channel: str, spans: Sequence[Span]) -> None:
        c = self.conn
        key = (thread_id, ns, channel)
        removed = 0
        cursor = 0
        for s in sorted(spans, key=lambda s: s.start):
            removed += c.execute(
                "DELETE FROM lg_entries WHERE thread_id = ? AND ns = ? AND channel = ? "
                "AND position >= ? AND position < ?",
                (*key, cursor, s.start),
            ).rowcount
            cursor = max(cursor, s.end)
        removed += c.execute(
            "DELETE FROM lg_entries WHERE thread_id = ? AND ns = ? AND channel = ? "
            "AND position >= ?",
            (*key, cursor),
        ).rowcount
        if removed:
            c.execute(
                "UPDATE lg_logs SET token = ? WHERE thread_id = ? AND ns = ? AND channel = ?",
                (uuid.uuid4().hex, *key),
            )

    # -- reads ---------------------------------------------------------------------------

    def _row(self, record: CheckpointRecord) -> CheckpointRow:
        c = self.conn
        blobs: dict[str, TypedBlob | None] = {}
        for channel, version in record.versions.items():
            found = c.execute(
                "SELECT type, data FROM lg_blobs WHERE thread_id = ? AND ns = ? AND channel = ? "
                "AND version = ?",
                (record.thread_id, record.checkpoint_ns, channel, version),
            ).fetchone()
            if found is not None:
                blobs[channel] = None if found[0] is None else (found[0], bytes(found[1]))
        writes = tuple(
            WriteRecord(
                task_id=w[0], idx=w[1], channel=w[2], value=(w[3], bytes(w[4])), task_path=w[5]
            )
            for w in c.execute(
                "SELECT task_id, idx, channel, type, data, task_path FROM lg_writes "
                "WHERE thread_id = ? AND ns = ? AND checkpoint_id = ? "
                "ORDER BY task_path, task_id, idx",
                (record.thread_id, record.checkpoint_ns, record.checkpoint_id),
            )
        )
        return CheckpointRow(record=record, blobs=blobs, writes=writes)

    def _page(self, rows: list[CheckpointRow], held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        c = self.conn
        wanted: dict[LogKey, list[Span]] = {}
        for row in rows:
            r = row.record
            for channel, spans in r.logs.items():
                wanted.setdefault(LogKey(r.thread_id, r.checkpoint_ns, channel), []).extend(spans)
        logs: dict[LogKey, LogRead] = {}
        for key, named in wanted.items():
            triple = (key.thread_id, key.checkpoint_ns, key.channel)
            found = c.execute(
                "SELECT token, length FROM lg_logs WHERE thread_id = ? AND ns = ? AND channel = ?",
                triple,
            ).fetchone()
            if found is None:
                logs[key] = LogRead(None)
                continue
            state = LogState(found[0], found[1])
            entries: dict[int, TypedBlob] = {}
            for s in unheld_spans(named, held.get(key), state.token):
                for position, t, d in c.execute(
                    "SELECT position, type, data FROM lg_entries WHERE thread_id = ? AND ns = ? "
                    "AND channel = ? AND position >= ? AND position < ?",
                    (*triple, s.start, s.end),
                ):
                    entries[position] = (t, bytes(d))
            logs[key] = LogRead(state, entries)
        return CheckpointPage(rows=tuple(rows), logs=logs)

    def get(
        self, thread_id: str, ns: str, checkpoint_id: str | None, held: Mapping[str, HeldLog]
    ) -> CheckpointPage:
        c = self.conn
        with transaction(c, "BEGIN"):
            if checkpoint_id is None:
                row = c.execute(
                    _RECORD + " WHERE thread_id = ? AND ns = ? ORDER BY checkpoint_id DESC LIMIT 1",
                    (thread_id, ns),
                ).fetchone()
            else:
                row = c.execute(
                    _RECORD + " WHERE thread_id = ? AND ns = ? AND checkpoint_id = ?",
                    (thread_id, ns, checkpoint_id),
                ).fetchone()
            rows = [] if row is None else [self._row(_record(row))]
            keyed = {LogKey(thread_id, ns, ch): h for ch, h in held.items()}
            return self._page(rows, keyed)

    def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        c = self.conn
        where: list[str] = []
        args: list[Any] = []
        for column, value in (
            ("thread_id", query.thread_id),
            ("ns", query.checkpoint_ns),
            ("checkpoint_id", query.checkpoint_id),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if query.before is not None:
            where.append("checkpoint_id < ?")
            args.append(query.before)
        sql = _RECORD + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY checkpoint_id DESC, thread_id DESC, ns DESC"
        if not query.metadata and query.limit is not None:
            sql += f" LIMIT {int(query.limit)}"
        rows: list[CheckpointRow] = []
        with transaction(c, "BEGIN"):
            if query.limit is None or query.limit > 0:
                for found in c.execute(sql, args).fetchall():
                    if not matches(found[8], query.metadata):
                        continue
                    rows.append(self._row(_record(found)))
                    if query.limit is not None and len(rows) >= query.limit:
                        break
            return self._page(rows, held)


def _prune(db: _Db, *, thread_id: str, strategy: PruneStrategy) -> None:
    if strategy == "delete":
        db.delete_thread(thread_id)
    else:
        db.prune_keep_latest(thread_id)


class SqliteSaverBackend:
    """A :class:`~touba.integrations.langgraph._backend.SaverBackend` in a private SQLite file.

    The file is opened on first use (its directory must exist and be private); see the
    module docstring for the rules.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._lock = threading.Lock()
        self._thread: OwnedThread | None = None
        self._db: _Db | None = None
        self._closed = False

    def _open(self) -> _Db:
        try:
            conn = open_private_sqlite(
                self._path, timeout=BUSY_TIMEOUT_SECONDS, check=_check_schema, page_size=1024
            )
        except sqlite3.Error as e:
            raise _translate(e) from e
        try:
            _init_schema(conn)
        except BaseException as e:
            conn.close()
            if isinstance(e, sqlite3.Error):
                raise _translate(e) from e
            raise
        return _Db(conn)

    def _start(self) -> OwnedThread:
        with self._lock:
            if self._closed:
                raise ConfigurationError("this ToubaSaver SQLite store is closed")
            if self._thread is None:
                self._thread = OwnedThread("touba-langgraph-sqlite")
            return self._thread

    async def _run(self, job: Callable[[_Db], R]) -> R:
        thread = self._start()

        def call() -> R:
            if self._db is None:
                self._db = self._open()
            try:
                return job(self._db)
            except sqlite3.Error as e:
                raise _translate(e) from e

        return await thread.run(call)

    async def put(self, request: PutCheckpoint) -> PutResult:
        """One transaction: log appends, blobs, the checkpoint row. O(what it adds)."""
        return await self._run(lambda db: db.put(request))

    async def put_writes(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRecord],
    ) -> None:
        """One transaction. O(len(writes))."""
        await self._run(lambda db: db.put_writes(thread_id, checkpoint_ns, checkpoint_id, writes))

    async def get(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str | None,
        held: Mapping[str, HeldLog],
    ) -> CheckpointPage:
        """One read transaction (one snapshot). O(blobs + writes + entries returned)."""
        return await self._run(lambda db: db.get(thread_id, checkpoint_ns, checkpoint_id, held))

    async def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        """One read transaction, newest first. O(rows scanned + entries returned)."""
        return await self._run(lambda db: db.list(query, held))

    async def delete_thread(self, thread_id: str) -> None:
        """One transaction. O(what the thread holds)."""
        await self._run(lambda db: db.delete_thread(thread_id))

    async def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """One transaction, through the run_id index. O(checkpoints removed)."""
        ids = list(run_ids)
        if ids:
            await self._run(lambda db: db.delete_for_runs(ids))

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """One transaction. O(what the source holds)."""
        await self._run(lambda db: db.copy_thread(source_thread_id, target_thread_id))

    async def prune(self, thread_ids: Sequence[str], strategy: PruneStrategy) -> None:
        """One transaction per thread. O(what the threads hold)."""
        for thread_id in thread_ids:
            await self._run(partial(_prune, thread_id=thread_id, strategy=strategy))

    async def close(self) -> None:
        """Close the file and stop the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return

        def shut() -> None:
            if self._db is not None:
                self._db.conn.close()
                self._db = None

        await thread.run(shut)
        thread.shutdown()
