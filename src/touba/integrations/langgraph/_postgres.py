"""The PostgreSQL backend of ToubaSaver: five tables shared by every worker using them.

- **Tables.** Every name is derived from ``table_prefix`` (``name`` or ``schema.name``,
  quoted with ``psycopg.sql.Identifier``): ``<prefix>_checkpoints`` (one row per
  checkpoint, its channel versions and its spans as JSON text), ``<prefix>_blobs``
  (channel values by version), ``<prefix>_writes`` (pending writes), ``<prefix>_logs``
  (each log's token and length) and ``<prefix>_entries`` (one row per logged item,
  keyed by position), plus ``<prefix>_meta`` (the schema version). Each key starts with
  ``thread_id``, so a thread's rows are one index range in each table.
- **Schema.** Created on first use in one transaction under an advisory lock
  (:class:`touba.history._pg.Schema`, shared with every touba PostgreSQL store), so
  workers opening a new table at once create it once. A table of that name that is not
  touba's, or of another schema version, is refused untouched (``ConfigurationError``).
- **Connections.** :class:`touba.history._pg.OwnedPool`: one direct connection first
  (failing fast with the server's message), then a pool of 1 to 4 in autocommit mode.
- **Writes.** A put is one statement, sent alone (autocommit: one round trip, one
  transaction): it upserts the logs it appends to (each row locked until it commits, so
  two puts of one thread append one after the other, and puts of different threads
  never share a row), inserts the new entries at each log's real end, the new blobs and
  the checkpoint row, whose spans it computes from the log's length; a base ending past
  that length is refused by the row's NOT NULL, rolling the statement back. O(what the
  step added), whatever the thread's length. ``put_writes`` and ``delete_for_runs`` are
  one statement each; ``delete_thread``, ``copy_thread`` and a thread's ``prune`` one
  transaction each, which first takes the thread's advisory lock that every put and
  ``put_writes`` of it holds shared: they wait for the puts in progress and the puts
  after them wait for them, so none removes or copies half of a put, nor leaves behind
  a pending write for a checkpoint it removes. A dropped connection or a killed
  worker leaves the server to finish or roll back the statement as a whole: a
  checkpoint is whole or absent.
- **Reads.** ``get`` is one statement (one snapshot, one round trip): the row by key
  (the latest: the last of its index range) with, as arrays, its blobs, its writes, its
  logs' states and the entries its spans name above what the caller holds. ``list``
  runs in one REPEATABLE READ, READ ONLY transaction (never a serialization failure):
  the rows streamed from a server-side cursor, a metadata filter applied to them until
  ``limit``, then their blobs, writes and log states (pipelined), then the entries their
  spans name, each once. Every read is an indexed range read.
- **Text.** PostgreSQL text cannot hold NUL (``\\x00``): a put or write naming a thread,
  namespace, checkpoint, channel, version, task or type with NUL is refused with
  ``ConfigurationError`` naming the field, nothing written; reads and deletes of such a
  name find nothing.
- **Errors.** A server that cannot be reached while opening: ``ConfigurationError``,
  chained. A lost server, a broken connection, a pool timeout, a lock or statement
  timeout or a deadlock during use: :class:`~touba.errors.DecisionHistoryStoreUnavailable`
  (retryable), chained; nothing was written, unless the connection broke once the
  server had the whole statement, which it then completes or rolls back as a whole.
  Stored rows that contradict each other (an entry already at a log's end, spans that
  do not parse): :class:`~touba.errors.DecisionHistoryRecordInvalid`.
- **Where it differs from LangGraph's AsyncPostgresSaver.** A put is one statement on a
  pooled connection (theirs: the blobs, then the checkpoint, pipelined on one connection
  that every call shares under a lock); logged channels are spans of a log, not a blob
  per version; metadata is kept as the serializer's bytes and as JSON text (not
  ``jsonb``, which cannot hold ``\\u0000``), and a ``list`` filter is applied to the rows
  of its range here, not with ``@>``; tables are created once under an advisory lock,
  not by ``setup()`` migrations.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

try:
    import psycopg
    from psycopg import sql
    from psycopg.rows import tuple_row
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'ToubaSaver.postgres needs psycopg 3 and psycopg-pool: pip install "touba[postgres]"'
    ) from e

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.history._pg import (
    Conn,
    OwnedPool,
    Row,
    Schema,
    has_nul,
    lock_key,
    table_parts,
)
from touba.integrations.langgraph._backend import (
    CheckpointPage,
    CheckpointRecord,
    CheckpointRow,
    HeldLog,
    ListQuery,
    LogAppend,
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
from touba.integrations.langgraph._postgres_sql import READ_ONLY, SCHEMA_VERSION, Statements

__all__ = ["SCHEMA_VERSION", "PostgresSaverBackend"]

LIST_BATCH: Final = 256  # rows a list fetches from its server-side cursor at a time
_OWNER: Final = "ToubaSaver.postgres"


Params = Sequence[Any] | Mapping[str, Any]
Query = sql.SQL | sql.Composed


async def _rows(conn: Conn, query: Query, params: Params = ()) -> list[Row]:
    """Every row ``query`` (one that returns rows) returns; in pipeline mode, this is
    where the statements sent so far are waited for."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchall()


async def _run(conn: Conn, query: Query, params: Params = ()) -> None:
    """Execute ``query`` (positional or named parameters)."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(query, params)


async def _results(conn: Conn, *queries: tuple[Query, Params | None]) -> list[list[Row]]:
    """The rows of each query (none for a query given None), all sent before any result
    is read: one round trip in pipeline mode."""
    cursors: list[psycopg.AsyncCursor[Row] | None] = []
    try:
        for query, params in queries:
            if params is None:
                cursors.append(None)
                continue
            opened = conn.cursor(row_factory=tuple_row)
            cursors.append(opened)
            await opened.execute(query, params)
        return [[] if c is None else await c.fetchall() for c in cursors]
    finally:
        for c in cursors:
            if c is not None:
                await c.close()


@contextmanager
def _contradictions() -> Iterator[None]:
    """An IntegrityError (stored rows contradicting each other) as RecordInvalid."""
    try:
        yield
    except psycopg.IntegrityError as e:
        raise DecisionHistoryRecordInvalid(
            f"ToubaSaver's PostgreSQL rows contradict each other ({type(e).__name__}: "
            f"{e}); nothing was written"
        ) from e


def _unavailable(e: Exception) -> DecisionHistoryStoreUnavailable:
    return DecisionHistoryStoreUnavailable(
        f"ToubaSaver's PostgreSQL store failed ({type(e).__name__}: {e}). Check the server "
        "and retry; the operation was rolled back unless the connection broke while it "
        "committed"
    )


def _refuse_nul(**fields: object) -> None:
    """ConfigurationError naming the first field whose text holds NUL."""
    for name, value in fields.items():
        values = value if isinstance(value, list | tuple) else (value,)
        if has_nul(*values):
            raise ConfigurationError(
                f"PostgreSQL text cannot hold NUL (\\x00), found in {name}; nothing was "
                "written. Use names without NUL characters"
            )


def _spans_json(logs: Mapping[str, Sequence[Span]]) -> str:
    return json.dumps({c: [[s.start, s.end] for s in spans] for c, spans in logs.items()})


def _spans(checkpoint_id: str, text: str) -> dict[str, tuple[Span, ...]]:
    try:
        return {
            str(channel): tuple(Span(int(a), int(b)) for a, b in spans)
            for channel, spans in json.loads(text).items()
        }
    except (ValueError, TypeError, AttributeError) as e:
        raise DecisionHistoryRecordInvalid(
            f"checkpoint {checkpoint_id!r}: its stored spans cannot be read"
        ) from e


def _versions(checkpoint_id: str, text: str) -> dict[str, str]:
    try:
        return {str(k): str(v) for k, v in json.loads(text).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise DecisionHistoryRecordInvalid(
            f"checkpoint {checkpoint_id!r}: its stored channel versions cannot be read"
        ) from e


def _record(found: Row) -> CheckpointRecord:
    checkpoint_id = found[2]
    return CheckpointRecord(
        thread_id=found[0],
        checkpoint_ns=found[1],
        checkpoint_id=checkpoint_id,
        parent_id=found[3],
        checkpoint=(found[4], bytes(found[5])),
        metadata=(found[6], bytes(found[7])),
        metadata_json=found[8],
        run_id=found[9],
        versions=_versions(checkpoint_id, found[10]),
        logs=_spans(checkpoint_id, found[11]),
    )


def _appends(r: PutCheckpoint) -> list[tuple[LogAppend, tuple[Span, ...]]]:
    """The put's log appends in channel order (the order their rows are locked in), each
    with its base merged."""
    return [(a, merge_spans(a.base)) for a in sorted(r.logs, key=lambda a: a.channel)]


def _put_params(
    r: PutCheckpoint, appends: Sequence[tuple[LogAppend, tuple[Span, ...]]], lock: int
) -> dict[str, Any]:
    """The parameters of :data:`Statements.put` for ``r``, whose thread's lock is
    ``lock``."""
    return {
        "lock": lock,
        "thread": r.thread_id,
        "ns": r.checkpoint_ns,
        "channels": [a.channel for a, _ in appends],
        "counts": [len(a.items) for a, _ in appends],
        "tokens": [_token() for _ in appends],
        "bases": [json.dumps([[s.start, s.end] for s in base]) for _, base in appends],
        "base_ends": [max((s.end for s in base), default=0) for _, base in appends],
        "e_channels": [a.channel for a, _ in appends for _ in a.items],
        "e_idx": [i for a, _ in appends for i in range(len(a.items))],
        "e_types": [t for a, _ in appends for t, _ in a.items],
        "e_data": [d for a, _ in appends for _, d in a.items],
        "b_channels": [b.channel for b in r.blobs],
        "b_versions": [b.version for b in r.blobs],
        "b_types": [None if b.blob is None else b.blob[0] for b in r.blobs],
        "b_data": [None if b.blob is None else b.blob[1] for b in r.blobs],
        "id": r.checkpoint_id,
        "parent": r.parent_id,
        "type": r.checkpoint[0],
        "checkpoint": r.checkpoint[1],
        "metadata_type": r.metadata[0],
        "metadata": r.metadata[1],
        "metadata_json": r.metadata_json,
        "run_id": r.run_id,
        "versions": json.dumps(dict(r.versions)),
    }


def _get_params(
    thread_id: str, checkpoint_ns: str, checkpoint_id: str | None, held: Mapping[str, HeldLog]
) -> dict[str, Any]:
    """The parameters of :data:`Statements.get_latest` (and ``get_one``)."""
    return {
        "t": thread_id,
        "ns": checkpoint_ns,
        "id": checkpoint_id,
        "h_channels": list(held),
        "h_tokens": [h.token for h in held.values()],
        "h_lengths": [h.length for h in held.values()],
    }


def _got(found: Row) -> CheckpointPage:
    """The page of :data:`Statements.get_latest`'s row: the record, then arrays (None
    for none) of blobs, writes, log states and entries."""
    record = _record(found[:12])
    b_channels, b_types, b_data = found[12:15]
    w_tasks, w_idx, w_channels, w_types, w_data, w_paths = found[15:21]
    l_channels, l_tokens, l_lengths, e_channels, e_positions, e_types, e_data = found[21:28]
    blobs: dict[str, TypedBlob | None] = {
        channel: None if kind is None else (kind, bytes(data))
        for channel, kind, data in zip(b_channels or (), b_types or (), b_data or (), strict=True)
    }
    writes = tuple(
        WriteRecord(task, idx, channel, (kind, bytes(data)), path)
        for task, idx, channel, kind, data, path in zip(
            w_tasks or (),
            w_idx or (),
            w_channels or (),
            w_types or (),
            w_data or (),
            w_paths or (),
            strict=True,
        )
    )
    states = {
        channel: LogState(token, int(length))
        for channel, token, length in zip(
            l_channels or (), l_tokens or (), l_lengths or (), strict=True
        )
    }
    entries: dict[str, dict[int, TypedBlob]] = {}
    for channel, position, kind, data in zip(
        e_channels or (), e_positions or (), e_types or (), e_data or (), strict=True
    ):
        entries.setdefault(channel, {})[int(position)] = (kind, bytes(data))
    logs = {
        LogKey(record.thread_id, record.checkpoint_ns, channel): (
            LogRead(None)
            if channel not in states
            else LogRead(states[channel], entries.get(channel, {}))
        )
        for channel in record.logs
    }
    return CheckpointPage(rows=(CheckpointRow(record, blobs, writes),), logs=logs)


def _log_keys(records: Sequence[CheckpointRecord]) -> list[LogKey]:
    """Each log the records' spans reference, once, in order."""
    keys = {
        LogKey(r.thread_id, r.checkpoint_ns, channel): None for r in records for channel in r.logs
    }
    return list(keys)


def _token() -> str:
    return uuid.uuid4().hex


class PostgresSaverBackend:
    """A :class:`~touba.integrations.langgraph._backend.SaverBackend` in PostgreSQL.

    ``dsn`` is a PostgreSQL connection string; the backend opens its own pool of 1 to 4
    connections on first use and closes it in :meth:`close`. ``table_prefix`` names the
    tables (``"touba_lg"`` -> ``touba_lg_checkpoints``, ...; ``"app.lg"`` ->
    ``app.lg_checkpoints``, ...), a plain identifier optionally schema-qualified;
    anything else raises ``ConfigurationError`` at construction.
    ``deadline_seconds`` bounds each call, waiting for a connection included: a
    network that goes silent fails it with ``DecisionHistoryStoreUnavailable``
    (retryable) within that time. See the module docstring for the rules.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table_prefix: str = "touba_lg",
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        parts = table_parts(table_prefix, example="touba_lg", argument="table_prefix", longest=47)
        self._sql = Statements(parts)
        self._pg = OwnedPool(
            _OWNER,
            dsn=dsn,
            pool=None,
            schema=Schema(
                table=table_prefix,
                main=self._sql.checkpoints,
                meta=self._sql.meta,
                create=self._sql.create,
                version=SCHEMA_VERSION,
                what="LangGraph checkpoint",
                lock=lock_key(f"touba.langgraph.postgres:schema:{table_prefix}"),
            ),
            unavailable=_unavailable,
            deadline=deadline_seconds,
        )
        self.table_prefix = table_prefix

    def _lock(self, thread_id: str) -> int:
        """The advisory lock key of a thread of these tables (see ``Statements.put``)."""
        return lock_key(f"touba.langgraph.postgres:{self.table_prefix}:{thread_id}")

    # -- connections -------------------------------------------------------------------

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[Conn]:
        """One READ COMMITTED transaction; conflicting stored rows are RecordInvalid."""
        with _contradictions():
            async with self._pg.call() as conn:
                yield conn

    @asynccontextmanager
    async def _statement(self) -> AsyncIterator[Conn]:
        """One statement that is a transaction of its own (one round trip)."""
        with _contradictions():
            async with self._pg.using(), self._pg.statement() as conn:
                yield conn

    @asynccontextmanager
    async def _snapshot(self) -> AsyncIterator[Conn]:
        """One REPEATABLE READ, READ ONLY transaction: every statement sees one snapshot
        (read-only, so it never fails to serialize)."""
        async with self._pg.using(), self._pg.statement() as conn, conn.transaction():
            await _run(conn, READ_ONLY)
            yield conn

    # -- writes ------------------------------------------------------------------------

    async def put(self, request: PutCheckpoint) -> PutResult:
        """One statement (one transaction, one round trip): the logs' new entries, the
        blobs and the checkpoint row. DecisionHistoryRecordInvalid, nothing written, for
        a base past its log's end.

        O(what the step added): the logs it appends to are read and updated by key, its
        entries inserted at their end; nothing of the thread's earlier entries is read.
        """
        r = request
        _refuse_nul(
            thread_id=r.thread_id,
            checkpoint_ns=r.checkpoint_ns,
            checkpoint_id=r.checkpoint_id,
            parent_id=r.parent_id,
            run_id=r.run_id,
            checkpoint_type=r.checkpoint[0],
            metadata_type=r.metadata[0],
            channels=[*r.versions, *(a.channel for a in r.logs), *(b.channel for b in r.blobs)],
            versions=[*r.versions.values(), *(b.version for b in r.blobs)],
            blob_types=[b.blob[0] for b in r.blobs if b.blob is not None],
            item_types=[t for a in r.logs for t, _ in a.items],
        )
        appends = _appends(r)
        params = _put_params(r, appends, self._lock(r.thread_id))
        try:
            async with self._statement() as conn:
                found = await _rows(conn, self._sql.put, params)
        except DecisionHistoryRecordInvalid as e:
            cause = e.__cause__
            if isinstance(cause, psycopg.errors.NotNullViolation) and (
                cause.diag.column_name == "logs"
            ):
                raise DecisionHistoryRecordInvalid(
                    f"checkpoint {r.checkpoint_id}: a logged channel starts with positions "
                    "past its log's end; nothing was written"
                ) from cause
            raise
        starts = {channel: (token, int(start)) for channel, token, start in found}
        spans: dict[str, tuple[Span, ...]] = {}
        states: dict[str, LogState] = {}
        for a, base in appends:
            token, start = starts[a.channel]
            end = start + len(a.items)
            spans[a.channel] = merge_spans((*base, Span(start, end)))
            states[a.channel] = LogState(token, end)
        return PutResult(spans=spans, logs=states)

    async def put_writes(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRecord],
    ) -> None:
        """One statement, holding the thread's lock shared (as a put does): regular
        writes inserted if new, special ones (negative ``idx``) replacing. Within one
        call the first regular write of a key and the last special one win.
        O(len(writes))."""
        _refuse_nul(
            thread_id=thread_id,
            checkpoint_ns=checkpoint_ns,
            checkpoint_id=checkpoint_id,
            task_id=[w.task_id for w in writes],
            task_path=[w.task_path for w in writes],
            channel=[w.channel for w in writes],
            value_type=[w.value[0] for w in writes],
        )
        unique: dict[tuple[str, int], WriteRecord] = {}
        for w in writes:
            if w.idx < 0 or (w.task_id, w.idx) not in unique:
                unique[(w.task_id, w.idx)] = w
        if not unique:
            return
        chosen = list(unique.values())
        params = {
            "thread": thread_id,
            "ns": checkpoint_ns,
            "id": checkpoint_id,
            "tasks": [w.task_id for w in chosen],
            "idx": [w.idx for w in chosen],
            "channels": [w.channel for w in chosen],
            "types": [w.value[0] for w in chosen],
            "data": [w.value[1] for w in chosen],
            "paths": [w.task_path for w in chosen],
            "lock": self._lock(thread_id),
        }
        async with self._statement() as conn:
            await _run(conn, self._sql.put_writes, params)

    async def delete_thread(self, thread_id: str) -> None:
        """One transaction: the thread's lock (waiting for the puts in progress), then
        one statement removing its rows from every table (each an index range).
        O(what the thread holds)."""
        if has_nul(thread_id):
            return
        async with self._write() as conn:
            await _run(conn, self._sql.lock_thread, (self._lock(thread_id),))
            await _run(conn, self._sql.delete_thread, {"t": thread_id})

    async def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """One statement, through the ``run_id`` index. O(checkpoints removed)."""
        ids = [i for i in run_ids if not has_nul(i)]
        if not ids:
            return
        async with self._statement() as conn:
            await _run(conn, self._sql.delete_for_runs, (ids,))

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """One transaction. The source's lock is held, so no put of it runs meanwhile; the
        target's logs are extended at their end. O(what the source holds)."""
        if has_nul(source_thread_id) or source_thread_id == target_thread_id:
            return
        _refuse_nul(target_thread_id=target_thread_id)
        ids = {"source": source_thread_id, "target": target_thread_id}
        async with self._write() as conn:
            await _run(conn, self._sql.lock_thread, (self._lock(source_thread_id),))
            logs = await _rows(conn, self._sql.logs_of_thread, (source_thread_id,))
            shifts: dict[tuple[str, str], int] = {}
            if logs:
                extended = await _rows(
                    conn,
                    self._sql.extend_logs,
                    {
                        "target": target_thread_id,
                        "ns": [ns for ns, _, _ in logs],
                        "channels": [channel for _, channel, _ in logs],
                        "counts": [length for _, _, length in logs],
                        "tokens": [_token() for _ in logs],
                    },
                )
                shifts = {(ns, channel): int(shift) for ns, channel, shift in extended}
                await _run(
                    conn,
                    self._sql.copy_entries,
                    {
                        **ids,
                        "ns": [ns for ns, _, _ in logs],
                        "channels": [channel for _, channel, _ in logs],
                        "lengths": [length for _, _, length in logs],
                        "shifts": [shifts[(ns, channel)] for ns, channel, _ in logs],
                    },
                )
            await _run(conn, self._sql.copy_blobs, ids)
            await _run(conn, self._sql.copy_writes, ids)
            found = await _rows(conn, self._sql.spans_of_thread, (source_thread_id,))
            if not found:
                return
            shifted = []
            for ns, checkpoint_id, text in found:
                logs_of = {
                    channel: tuple(
                        Span(
                            s.start + shifts.get((ns, channel), 0),
                            s.end + shifts.get((ns, channel), 0),
                        )
                        for s in spans
                    )
                    for channel, spans in _spans(checkpoint_id, text).items()
                }
                shifted.append(_spans_json(logs_of))
            await _run(
                conn,
                self._sql.copy_checkpoints,
                {
                    **ids,
                    "ns": [f[0] for f in found],
                    "ids": [f[1] for f in found],
                    "logs": shifted,
                },
            )

    async def prune(self, thread_ids: Sequence[str], strategy: PruneStrategy) -> None:
        """One transaction per thread. O(what the threads hold)."""
        for thread_id in thread_ids:
            if has_nul(thread_id):
                continue
            if strategy == "delete":
                await self.delete_thread(thread_id)
            else:
                await self._keep_latest(thread_id)

    async def _keep_latest(self, thread_id: str) -> None:
        """Keep each namespace's latest checkpoint, with the writes, blobs and entries it
        names; a log that loses entries gets a new token. The thread's lock is held
        first, so no put of it runs meanwhile."""
        async with self._write() as conn:
            await _run(conn, self._sql.lock_thread, (self._lock(thread_id),))
            latest = await _rows(conn, self._sql.latest_per_ns, (thread_id,))
            kept_ids = {"t": thread_id, "ns": [f[0] for f in latest], "ids": [f[1] for f in latest]}
            await _run(conn, self._sql.prune_checkpoints, kept_ids)
            await _run(conn, self._sql.prune_writes, kept_ids)
            blob_keys = [
                (ns, channel, version)
                for ns, checkpoint_id, versions, _ in latest
                for channel, version in _versions(checkpoint_id, versions).items()
            ]
            await _run(
                conn,
                self._sql.prune_blobs,
                {
                    "t": thread_id,
                    "ns": [k[0] for k in blob_keys],
                    "channels": [k[1] for k in blob_keys],
                    "versions": [k[2] for k in blob_keys],
                },
            )
            spans = [
                (ns, channel, s)
                for ns, checkpoint_id, _, text in latest
                for channel, named in _spans(checkpoint_id, text).items()
                for s in named
            ]
            await _run(
                conn,
                self._sql.prune_entries,
                {
                    "t": thread_id,
                    "ns": [k[0] for k in spans],
                    "channels": [k[1] for k in spans],
                    "starts": [k[2].start for k in spans],
                    "ends": [k[2].end for k in spans],
                    "token": _token(),  # new for every log that lost entries
                },
            )

    # -- reads -------------------------------------------------------------------------

    async def get(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str | None,
        held: Mapping[str, HeldLog],
    ) -> CheckpointPage:
        """One snapshot: the row by key (the latest: the last of its index range), its
        blobs, writes and log states, then the entries its spans name above what is held.
        O(blobs + writes + spans + entries returned)."""
        if has_nul(thread_id, checkpoint_ns, checkpoint_id):
            return CheckpointPage(rows=(), logs={})
        params = _get_params(thread_id, checkpoint_ns, checkpoint_id, held)
        query = self._sql.get_latest if checkpoint_id is None else self._sql.get_one
        async with self._statement() as conn, conn.cursor(binary=True) as cur:
            await cur.execute(query, params)
            found = await cur.fetchone()
        return CheckpointPage(rows=(), logs={}) if found is None else _got(found)

    async def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        """One snapshot, newest first: the rows streamed from a server-side cursor in
        batches, filtered by metadata here, until ``limit``; then as :meth:`get`. With a
        ``thread_id``: a range read of that thread's index. O(rows scanned + entries
        returned)."""
        if query.limit is not None and query.limit <= 0:
            return CheckpointPage(rows=(), logs={})
        if has_nul(query.thread_id, query.checkpoint_ns, query.checkpoint_id, query.before):
            return CheckpointPage(rows=(), logs={})
        where: list[sql.Composable] = []
        args: list[Any] = []
        for column, value in (
            ("thread_id", query.thread_id),
            ("ns", query.checkpoint_ns),
            ("checkpoint_id", query.checkpoint_id),
        ):
            if value is not None:
                where.append(sql.SQL("{} = %s").format(sql.Identifier(column)))
                args.append(value)
        if query.before is not None:
            where.append(sql.SQL("checkpoint_id < %s"))
            args.append(query.before)
        statement: sql.Composed = self._sql.list_head
        if where:
            statement = sql.SQL(" WHERE ").join([statement, sql.SQL(" AND ").join(where)])
        order = sql.SQL(" ORDER BY checkpoint_id DESC, thread_id DESC, ns DESC")
        statement = sql.Composed([statement, order])
        if not query.metadata and query.limit is not None:
            statement = sql.Composed([statement, sql.SQL(" LIMIT {}").format(query.limit)])
        records: list[CheckpointRecord] = []
        async with self._snapshot() as conn:
            async with conn.cursor(name=f"touba_lg_list_{_token()}") as cursor:
                cursor.itersize = LIST_BATCH
                await cursor.execute(statement, args)
                async for found in cursor:
                    if not matches(found[8], query.metadata):
                        continue
                    records.append(_record(found))
                    if query.limit is not None and len(records) >= query.limit:
                        break
            async with conn.pipeline():  # the rows' blobs, writes and logs: one round trip
                return await self._page(conn, records, held)

    async def _page(
        self, conn: Conn, records: Sequence[CheckpointRecord], held: Mapping[LogKey, HeldLog]
    ) -> CheckpointPage:
        """The rows of ``records`` with their blobs, writes, and the entries they name."""
        if not records:
            return CheckpointPage(rows=(), logs={})
        blob_keys = [
            (r.thread_id, r.checkpoint_ns, channel, version)
            for r in records
            for channel, version in r.versions.items()
        ]
        keys = _log_keys(records)
        columns = [list(c) for c in zip(*blob_keys, strict=True)] if blob_keys else None
        blob_rows, write_rows, log_rows = await _results(
            conn,
            (self._sql.blobs_of, columns),
            (
                self._sql.writes_of,
                (
                    [r.thread_id for r in records],
                    [r.checkpoint_ns for r in records],
                    [r.checkpoint_id for r in records],
                ),
            ),
            (
                self._sql.logs_of,
                (
                    [k.thread_id for k in keys],
                    [k.checkpoint_ns for k in keys],
                    [k.channel for k in keys],
                )
                if keys
                else None,
            ),
        )
        # the blobs at the versions asked for, by (thread, namespace, channel, version)
        by_key: dict[tuple[str, str, str, str], TypedBlob | None] = {
            (t, ns, channel, version): None if kind is None else (kind, bytes(data))
            for t, ns, channel, version, kind, data in blob_rows
        }
        writes: dict[tuple[str, str, str], list[WriteRecord]] = {}
        for t, ns, checkpoint_id, task_id, idx, channel, kind, data, path in write_rows:
            writes.setdefault((t, ns, checkpoint_id), []).append(
                WriteRecord(task_id, idx, channel, (kind, bytes(data)), path)
            )
        states = {LogKey(t, ns, ch): LogState(token, int(n)) for t, ns, ch, token, n in log_rows}
        page_rows = tuple(
            CheckpointRow(
                record=r,
                blobs=self._blobs_of(r, by_key),
                writes=tuple(writes.get((r.thread_id, r.checkpoint_ns, r.checkpoint_id), ())),
            )
            for r in records
        )
        logs = await self._entries(conn, records, keys, states, held)
        return CheckpointPage(rows=page_rows, logs=logs)

    @staticmethod
    def _blobs_of(
        record: CheckpointRecord, found: Mapping[tuple[str, str, str, str], TypedBlob | None]
    ) -> dict[str, TypedBlob | None]:
        """The record's blob of each channel at its version (a missing one left out)."""
        where = (record.thread_id, record.checkpoint_ns)
        return {
            channel: found[(*where, channel, version)]
            for channel, version in record.versions.items()
            if (*where, channel, version) in found
        }

    async def _entries(
        self,
        conn: Conn,
        records: Sequence[CheckpointRecord],
        keys: Sequence[LogKey],
        states: Mapping[LogKey, LogState],
        held: Mapping[LogKey, HeldLog],
    ) -> dict[LogKey, LogRead]:
        """Each log the records' spans reference, once: its state and the entries named
        (at or above the held length when the held token is the log's)."""
        wanted: dict[LogKey, list[Span]] = {key: [] for key in keys}
        for r in records:
            for channel, spans in r.logs.items():
                wanted[LogKey(r.thread_id, r.checkpoint_ns, channel)].extend(spans)
        logs: dict[LogKey, LogRead] = {}
        ranges: list[tuple[int, LogKey, Span]] = []
        for i, key in enumerate(keys):
            state = states.get(key)
            if state is None:
                logs[key] = LogRead(None)
                continue
            unheld = unheld_spans(wanted[key], held.get(key), state.token)
            ranges.extend((i, key, s) for s in unheld)
        entries: dict[LogKey, dict[int, TypedBlob]] = {}
        if ranges:
            async with conn.cursor(binary=True) as cur:
                await cur.execute(
                    self._sql.entries_of,
                    (
                        [i for i, _, _ in ranges],
                        [k.thread_id for _, k, _ in ranges],
                        [k.checkpoint_ns for _, k, _ in ranges],
                        [k.channel for _, k, _ in ranges],
                        [s.start for _, _, s in ranges],
                        [s.end for _, _, s in ranges],
                    ),
                )
                for i, position, kind, data in await cur.fetchall():
                    entries.setdefault(keys[i], {})[int(position)] = (kind, bytes(data))
        for key in keys:
            state = states.get(key)
            if state is not None:
                logs[key] = LogRead(state, entries.get(key, {}))
        return logs

    async def close(self) -> None:
        """Refuse new calls, let running ones finish, close the pool; idempotent."""
        await self._pg.close()
