"""The RAM backend of ToubaSaver: the SaverBackend data model in dictionaries.

Each method runs without awaiting, so it is atomic with respect to every other call on
the event loop. Nothing survives the process. Checkpoint ids are kept sorted per
namespace (``bisect``), so the latest, ``before`` and ``limit`` cost O(log c + rows).
"""

from __future__ import annotations

import bisect
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from touba.errors import DecisionHistoryRecordInvalid
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
)

__all__ = ["MemorySaverBackend"]


@dataclass(slots=True)
class _Log:
    token: str
    length: int = 0
    entries: dict[int, TypedBlob] = field(default_factory=dict)


@dataclass(slots=True)
class _Namespace:
    ids: list[str] = field(default_factory=list)  # sorted
    records: dict[str, CheckpointRecord] = field(default_factory=dict)
    writes: dict[str, dict[tuple[str, int], WriteRecord]] = field(default_factory=dict)
    blobs: dict[tuple[str, str], TypedBlob | None] = field(default_factory=dict)
    logs: dict[str, _Log] = field(default_factory=dict)


def _token() -> str:
    return uuid.uuid4().hex


def matches(metadata_json: str, wanted: Mapping[str, object]) -> bool:
    """True when each key of ``wanted`` is in the JSON object with an equal JSON value."""
    if not wanted:
        return True
    try:
        metadata = json.loads(metadata_json)
    except ValueError as e:
        raise DecisionHistoryRecordInvalid("a checkpoint's metadata is not JSON") from e
    for key, value in wanted.items():
        if key not in metadata or not _json_equal(metadata[key], value):
            return False
    return True


def _json_equal(a: object, b: object) -> bool:
    # JSON's equality: true is not 1, 1 is 1.0
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class MemorySaverBackend:
    """A :class:`~touba.integrations.langgraph._backend.SaverBackend` in this process's RAM."""

    def __init__(self) -> None:
        self._threads: dict[str, dict[str, _Namespace]] = {}
        self._runs: dict[str, set[tuple[str, str, str]]] = {}

    def _ns(self, thread_id: str, checkpoint_ns: str) -> _Namespace:
        return self._threads.setdefault(thread_id, {}).setdefault(checkpoint_ns, _Namespace())

    def _find(self, thread_id: str, checkpoint_ns: str) -> _Namespace | None:
        return self._threads.get(thread_id, {}).get(checkpoint_ns)

    async def put(self, request: PutCheckpoint) -> PutResult:
        """Store a checkpoint, its blobs and log appends (atomic: no await). O(k + blobs)."""
        space = self._find(request.thread_id, request.checkpoint_ns)
        for append in request.logs:  # check everything before changing anything
            log = space.logs.get(append.channel) if space is not None else None
            length = log.length if log is not None else 0
            if any(s.end > length for s in append.base):
                raise DecisionHistoryRecordInvalid(
                    f"checkpoint {request.checkpoint_id}: channel {append.channel!r} starts "
                    f"with positions past its log's end ({length}); nothing was written"
                )
        space = self._ns(request.thread_id, request.checkpoint_ns)
        spans: dict[str, tuple[Span, ...]] = {}
        states: dict[str, LogState] = {}
        for append in request.logs:
            log = space.logs.get(append.channel)
            if log is None:
                log = space.logs[append.channel] = _Log(_token())
            start = log.length
            for offset, item in enumerate(append.items):
                log.entries[start + offset] = item
            log.length = start + len(append.items)
            spans[append.channel] = merge_spans((*append.base, Span(start, log.length)))
            states[append.channel] = LogState(log.token, log.length)
        for b in request.blobs:
            space.blobs.setdefault((b.channel, b.version), b.blob)
        record = CheckpointRecord(
            thread_id=request.thread_id,
            checkpoint_ns=request.checkpoint_ns,
            checkpoint_id=request.checkpoint_id,
            parent_id=request.parent_id,
            checkpoint=request.checkpoint,
            metadata=request.metadata,
            metadata_json=request.metadata_json,
            run_id=request.run_id,
            versions=dict(request.versions),
            logs=spans,
        )
        old = space.records.get(request.checkpoint_id)
        if old is None:
            bisect.insort(space.ids, request.checkpoint_id)
        elif old.run_id is not None:
            self._forget_run(old)
        space.records[request.checkpoint_id] = record
        if request.run_id is not None:
            key = (request.thread_id, request.checkpoint_ns, request.checkpoint_id)
            self._runs.setdefault(request.run_id, set()).add(key)
        return PutResult(spans=spans, logs=states)

    def _forget_run(self, record: CheckpointRecord) -> None:
        assert record.run_id is not None
        keys = self._runs.get(record.run_id)
        if keys is not None:
            keys.discard((record.thread_id, record.checkpoint_ns, record.checkpoint_id))
            if not keys:
                del self._runs[record.run_id]

    async def put_writes(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRecord],
    ) -> None:
        """Store pending writes (atomic: no await). O(len(writes))."""
        stored = self._ns(thread_id, checkpoint_ns).writes.setdefault(checkpoint_id, {})
        for w in writes:
            key = (w.task_id, w.idx)
            if w.idx >= 0 and key in stored:
                continue
            stored[key] = w

    def _row(self, space: _Namespace, record: CheckpointRecord) -> CheckpointRow:
        blobs: dict[str, TypedBlob | None] = {}
        for channel, version in record.versions.items():
            key = (channel, version)
            if key in space.blobs:
                blobs[channel] = space.blobs[key]
        stored = space.writes.get(record.checkpoint_id, {})
        writes = tuple(sorted(stored.values(), key=lambda w: (w.task_path, w.task_id, w.idx)))
        return CheckpointRow(record=record, blobs=blobs, writes=writes)

    def _page(self, rows: list[CheckpointRow], held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        wanted: dict[LogKey, list[Span]] = {}
        for row in rows:
            r = row.record
            for channel, spans in r.logs.items():
                wanted.setdefault(LogKey(r.thread_id, r.checkpoint_ns, channel), []).extend(spans)
        logs: dict[LogKey, LogRead] = {}
        for key, named in wanted.items():
            space = self._find(key.thread_id, key.checkpoint_ns)
            log = space.logs.get(key.channel) if space is not None else None
            if log is None:
                logs[key] = LogRead(None)
                continue
            h = held.get(key)
            floor = h.length if h is not None and h.token == log.token else 0
            entries: dict[int, TypedBlob] = {}
            for s in named:
                for p in range(max(s.start, floor), min(s.end, log.length)):
                    if p not in entries and p in log.entries:
                        entries[p] = log.entries[p]
            logs[key] = LogRead(LogState(log.token, log.length), entries)
        return CheckpointPage(rows=tuple(rows), logs=logs)

    async def get(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str | None,
        held: Mapping[str, HeldLog],
    ) -> CheckpointPage:
        """One checkpoint (or the latest) with its blobs, writes and new log entries."""
        space = self._find(thread_id, checkpoint_ns)
        rows: list[CheckpointRow] = []
        if space is not None and space.ids:
            wanted = checkpoint_id if checkpoint_id is not None else space.ids[-1]
            record = space.records.get(wanted)
            if record is not None:
                rows.append(self._row(space, record))
        keyed = {LogKey(thread_id, checkpoint_ns, c): h for c, h in held.items()}
        return self._page(rows, keyed)

    def _candidates(self, query: ListQuery) -> Iterable[tuple[_Namespace, CheckpointRecord]]:
        threads = (
            [query.thread_id]
            if query.thread_id is not None
            else sorted(self._threads, reverse=True)
        )
        found: list[tuple[_Namespace, CheckpointRecord]] = []
        for thread_id in threads:
            spaces = self._threads.get(thread_id, {})
            names = [query.checkpoint_ns] if query.checkpoint_ns is not None else list(spaces)
            for name in names:
                space = spaces.get(name)
                if space is None:
                    continue
                ids = space.ids
                if query.before is not None:
                    ids = ids[: bisect.bisect_left(ids, query.before)]
                if query.checkpoint_id is not None:
                    ids = [i for i in ids if i == query.checkpoint_id]
                found.extend((space, space.records[i]) for i in ids)
        found.sort(key=lambda pair: pair[1].checkpoint_id, reverse=True)
        return found

    async def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        """The selected checkpoints, newest first. O(rows scanned + entries returned)."""
        rows: list[CheckpointRow] = []
        for space, record in self._candidates(query):
            if query.limit is not None and len(rows) >= query.limit:
                break
            if matches(record.metadata_json, query.metadata):
                rows.append(self._row(space, record))
        return self._page(rows, held)

    async def delete_thread(self, thread_id: str) -> None:
        """Remove a thread (atomic). O(what it holds)."""
        spaces = self._threads.pop(thread_id, None)
        for space in (spaces or {}).values():
            for record in space.records.values():
                if record.run_id is not None:
                    self._forget_run(record)

    async def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Remove the runs' checkpoints and writes (atomic). O(checkpoints removed)."""
        for run_id in run_ids:
            for thread_id, checkpoint_ns, checkpoint_id in self._runs.pop(run_id, set()):
                space = self._find(thread_id, checkpoint_ns)
                if space is None or checkpoint_id not in space.records:
                    continue
                del space.records[checkpoint_id]
                space.ids.pop(bisect.bisect_left(space.ids, checkpoint_id))
                space.writes.pop(checkpoint_id, None)

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread onto another (atomic: no await). O(what the source holds)."""
        source = self._threads.get(source_thread_id)
        if not source or source_thread_id == target_thread_id:
            return
        for name, src in source.items():
            dst = self._ns(target_thread_id, name)
            offsets: dict[str, int] = {}
            for channel, log in src.logs.items():
                target = dst.logs.get(channel)
                if target is None:
                    target = dst.logs[channel] = _Log(_token())
                offset = offsets[channel] = target.length
                for position, item in log.entries.items():
                    target.entries[position + offset] = item
                target.length = offset + log.length
            for key, value in src.blobs.items():
                dst.blobs.setdefault(key, value)
            for checkpoint_id, record in src.records.items():
                if checkpoint_id in dst.records:
                    continue
                logs = {
                    channel: tuple(
                        Span(s.start + offsets.get(channel, 0), s.end + offsets.get(channel, 0))
                        for s in spans
                    )
                    for channel, spans in record.logs.items()
                }
                copied = CheckpointRecord(
                    thread_id=target_thread_id,
                    checkpoint_ns=name,
                    checkpoint_id=checkpoint_id,
                    parent_id=record.parent_id,
                    checkpoint=record.checkpoint,
                    metadata=record.metadata,
                    metadata_json=record.metadata_json,
                    run_id=record.run_id,
                    versions=record.versions,
                    logs=logs,
                )
                dst.records[checkpoint_id] = copied
                bisect.insort(dst.ids, checkpoint_id)
                if record.run_id is not None:
                    run_key = (target_thread_id, name, checkpoint_id)
                    self._runs.setdefault(record.run_id, set()).add(run_key)
            for checkpoint_id, writes in src.writes.items():
                into = dst.writes.setdefault(checkpoint_id, {})
                for write_key, w in writes.items():
                    into.setdefault(write_key, w)

    async def prune(self, thread_ids: Sequence[str], strategy: PruneStrategy) -> None:
        """Keep each namespace's latest checkpoint, or delete the threads. O(what they hold)."""
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.delete_thread(thread_id)
                continue
            for space in self._threads.get(thread_id, {}).values():
                if not space.ids:
                    continue
                keep = space.records[space.ids[-1]]
                for checkpoint_id in space.ids[:-1]:
                    record = space.records.pop(checkpoint_id)
                    if record.run_id is not None:
                        self._forget_run(record)
                    space.writes.pop(checkpoint_id, None)
                space.ids = [keep.checkpoint_id]
                space.writes = {k: v for k, v in space.writes.items() if k == keep.checkpoint_id}
                kept_blobs = {(c, v) for c, v in keep.versions.items()}
                space.blobs = {k: v for k, v in space.blobs.items() if k in kept_blobs}
                for channel, log in list(space.logs.items()):
                    spans = keep.logs.get(channel, ())
                    kept = {
                        p: log.entries[p]
                        for s in spans
                        for p in range(s.start, s.end)
                        if p in log.entries
                    }
                    if len(kept) != len(log.entries):
                        log.entries = kept
                        log.token = _token()

    async def close(self) -> None:
        """Nothing to release (idempotent)."""
