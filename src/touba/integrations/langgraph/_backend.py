"""What :class:`~touba.integrations.langgraph.ToubaSaver` asks of a store: the ``SaverBackend``.

The saver (``_saver.py``) owns everything LangGraph-specific: the serializer, which channels
are logged, the decoded-channel cache, configs and metadata. A backend stores and returns
opaque typed blobs (``(type, bytes)`` pairs from ``serde.dumps_typed``) and plain
positions; it never decodes a value.

The data model, per ``(thread_id, checkpoint_ns)``:

- **Checkpoints**, keyed by ``checkpoint_id`` (LangGraph's ids sort by time), with their
  parent id, the serialized checkpoint *without* its channel values, the serialized
  metadata, the metadata as JSON for filtering (:attr:`CheckpointRecord.metadata_json`),
  ``run_id`` (for :meth:`SaverBackend.delete_for_runs`), the version of each channel stored
  as a blob (:attr:`CheckpointRecord.versions`) and, for each logged channel, its spans
  (:attr:`CheckpointRecord.logs`).
- **Channel blobs**, keyed by ``(channel, version)``, as LangGraph's own savers store them:
  a checkpoint writes only the channels in ``new_versions``; ``None`` is LangGraph's
  "empty" marker (a version without a value: the channel is left out of the values read).
- **Logs**, one per ``(thread_id, checkpoint_ns, channel)`` for the channels whose values
  only grow by appending (``messages``): entries at positions ``0, 1, 2, ...``, each one
  item's blob, never changed once written. A checkpoint's value for the channel is the
  concatenation of its :class:`Span` s (half-open position ranges): it stores offsets,
  never a copy. A fork from an earlier checkpoint shares that checkpoint's prefix: its
  spans are the prefix's, plus one span for what it appended at the log's end. Each log
  has a **token** that the store replaces whenever entries are removed or the log is
  created anew (delete, prune): positions below a log's length under one token always
  hold the same entries, which is what lets the saver keep decoded items between steps
  (:class:`HeldLog`).
- **Pending writes**, keyed by ``(checkpoint_id, task_id, idx)``, with ``task_path`` and
  the channel. A regular write (``idx >= 0``) is insert-or-ignore; a special one (the
  negative indexes of LangGraph's ``WRITES_IDX_MAP``: error, scheduled, interrupt, resume)
  replaces what is there.

Every method is a coroutine. A store failure (server down, disk full, file locked past
its timeout) raises :class:`~touba.errors.DecisionHistoryStoreUnavailable` with the
driver's error chained and leaves the store as it was (each write below is atomic);
something stored that the backend cannot parse raises
:class:`~touba.errors.DecisionHistoryRecordInvalid`. The saver validates its arguments
before calling: a backend may assume well-formed requests (non-empty ``thread_id``,
spans inside ``[0, length)``, sorted and non-overlapping), except where a method says it
checks.

Entries a span names that do not exist (deleted, pruned, never written) are simply not
returned: the saver, which knows the spans, raises
:class:`~touba.errors.DecisionHistoryRecordInvalid` for them rather than return a shorter
list. A backend never fills a gap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "ChannelBlob",
    "CheckpointPage",
    "CheckpointRecord",
    "CheckpointRow",
    "HeldLog",
    "ListQuery",
    "LogAppend",
    "LogKey",
    "LogRead",
    "LogState",
    "PruneStrategy",
    "PutCheckpoint",
    "PutResult",
    "SaverBackend",
    "Span",
    "TypedBlob",
    "WriteRecord",
    "merge_spans",
    "span_length",
    "unheld_spans",
]

TypedBlob = tuple[str, bytes]
"""A value as ``serde.dumps_typed`` gives it: the serializer's type tag and the bytes."""

PruneStrategy = Literal["keep_latest", "delete"]


@dataclass(frozen=True, slots=True)
class Span:
    """Positions ``start`` (inclusive) to ``end`` (exclusive) of one log; ``start < end``."""

    start: int
    end: int


def span_length(spans: Sequence[Span]) -> int:
    """How many items ``spans`` name."""
    return sum(s.end - s.start for s in spans)


def merge_spans(spans: Sequence[Span]) -> tuple[Span, ...]:
    """``spans`` in order with adjacent ones joined and empty ones dropped.

    ``[0, 10) + [10, 12)`` becomes ``[0, 12)``; order is kept (a value is the spans'
    concatenation in order, so they are never sorted).
    """
    out: list[Span] = []
    for s in spans:
        if s.end <= s.start:
            continue
        if out and out[-1].end == s.start:
            out[-1] = Span(out[-1].start, s.end)
        else:
            out.append(s)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class LogKey:
    """One log: a channel of one namespace of one thread."""

    thread_id: str
    checkpoint_ns: str
    channel: str


@dataclass(frozen=True, slots=True)
class HeldLog:
    """What a caller already holds of a log: every entry below ``length`` under ``token``.

    A read given a matching token returns only the entries at positions ``>= length``;
    with another token (the log was pruned, deleted and recreated) it returns every entry
    the spans name.
    """

    token: str
    length: int


def unheld_spans(spans: Iterable[Span], held: HeldLog | None, token: str) -> list[Span]:
    """The positions ``spans`` name that a caller holding ``held`` of a log now under
    ``token`` lacks (all of them when ``held`` is None or of another token), as sorted
    disjoint spans: what a backend's ``get`` and ``list`` read of it. O(s log s)."""
    floor = held.length if held is not None and held.token == token else 0
    clipped = sorted((max(s.start, floor), s.end) for s in spans if s.end > max(s.start, floor))
    out: list[Span] = []
    for start, end in clipped:
        if out and start <= out[-1].end:
            if end > out[-1].end:
                out[-1] = Span(out[-1].start, end)
        else:
            out.append(Span(start, end))
    return out


@dataclass(frozen=True, slots=True)
class LogState:
    """A log's current token and length (one past its last position; 0: no log)."""

    token: str
    length: int


@dataclass(frozen=True, slots=True)
class LogAppend:
    """One logged channel of a checkpoint being put.

    The checkpoint's value for ``channel`` is the items ``base`` names (a prefix the
    parent's value shares, as spans of the log; ``()`` for a fresh start) followed by
    ``items``, which the store appends at the log's real end, whatever its length is by
    the time the put runs.
    """

    channel: str
    base: tuple[Span, ...]
    items: tuple[TypedBlob, ...]


@dataclass(frozen=True, slots=True)
class ChannelBlob:
    """One channel's value at one version; ``blob`` None is LangGraph's "empty" marker."""

    channel: str
    version: str
    blob: TypedBlob | None


@dataclass(frozen=True, slots=True)
class PutCheckpoint:
    """Everything one ``aput`` stores, in one atomic step (see :meth:`SaverBackend.put`)."""

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_id: str | None
    checkpoint: TypedBlob
    """The serialized checkpoint without ``channel_values``."""
    metadata: TypedBlob
    metadata_json: str
    """The metadata as a JSON object (values JSON cannot hold left out), for filters."""
    run_id: str | None
    versions: Mapping[str, str]
    """Channel -> version for every channel of this checkpoint stored as a blob."""
    blobs: tuple[ChannelBlob, ...]
    """The blobs this checkpoint writes (its ``new_versions`` among ``versions``)."""
    logs: tuple[LogAppend, ...]


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put stored for each logged channel: the spans and the log's new state."""

    spans: Mapping[str, tuple[Span, ...]]
    logs: Mapping[str, LogState]


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """One pending write: ``idx`` as LangGraph's ``WRITES_IDX_MAP`` gives it."""

    task_id: str
    idx: int
    channel: str
    value: TypedBlob
    task_path: str = ""


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A stored checkpoint, as :meth:`SaverBackend.put` received it (spans computed)."""

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_id: str | None
    checkpoint: TypedBlob
    metadata: TypedBlob
    metadata_json: str
    run_id: str | None
    versions: Mapping[str, str]
    logs: Mapping[str, tuple[Span, ...]]


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """A checkpoint with what a reader needs beside its logs.

    ``blobs`` maps each channel of ``record.versions`` to its blob at that version (a
    missing blob is left out: the saver decides); ``writes`` are the checkpoint's pending
    writes in LangGraph's ``writes_sort_key`` order: ``(task_path, task_id, idx)``.
    """

    record: CheckpointRecord
    blobs: Mapping[str, TypedBlob | None]
    writes: tuple[WriteRecord, ...]


@dataclass(frozen=True, slots=True)
class LogRead:
    """Entries of one log that a read returns, with the log's current state.

    ``state`` None: the log does not exist (no entry is returned). ``entries`` maps a
    position to its blob: each position once, only positions some returned row's spans
    name, above the caller's :class:`HeldLog` length when its token matched.
    """

    state: LogState | None
    entries: Mapping[int, TypedBlob] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CheckpointPage:
    """Rows newest first, and the log entries they reference (each log once)."""

    rows: tuple[CheckpointRow, ...]
    logs: Mapping[LogKey, LogRead]


@dataclass(frozen=True, slots=True)
class ListQuery:
    """What :meth:`SaverBackend.list` selects.

    ``thread_id`` None: every thread. ``checkpoint_ns`` None: every namespace.
    ``checkpoint_id``: only that checkpoint. ``before``: only ids strictly smaller.
    ``metadata``: each key's value in the record's ``metadata_json`` equals the given
    JSON value (a missing key never matches; ``1`` and ``True`` differ, as in JSON).
    ``limit`` None: no limit.
    """

    thread_id: str | None = None
    checkpoint_ns: str | None = None
    checkpoint_id: str | None = None
    before: str | None = None
    metadata: Mapping[str, object] = field(default_factory=dict)
    limit: int | None = None


class SaverBackend(Protocol):
    """A store for :class:`~touba.integrations.langgraph.ToubaSaver` (see the module docstring).

    Costs use N for a log's length, k for the entries a call adds or returns, c for the
    checkpoints (with their writes and blobs) a call touches. Every method may raise
    :class:`~touba.errors.DecisionHistoryStoreUnavailable` (store failure, nothing
    changed) and :class:`~touba.errors.DecisionHistoryRecordInvalid` (unreadable stored
    data); others are listed per method.
    """

    async def put(self, request: PutCheckpoint) -> PutResult:
        """Store one checkpoint, its new blobs and its log appends, atomically.

        In one transaction (one Lua script, ...): for each :class:`LogAppend`, read the
        log's length L (0 when it does not exist: then create it with a fresh token),
        write ``items`` at positions ``L .. L+len(items)-1``, and compute the spans
        ``merge_spans(base + (Span(L, L+len(items)),))``; write each :class:`ChannelBlob`
        (insert-or-ignore: a version's value never changes); store the
        :class:`CheckpointRecord` with those spans (replacing a record with the same
        ``(thread_id, checkpoint_ns, checkpoint_id)``, as LangGraph's savers do). Either
        all of it is stored or nothing is, a ``kill -9`` included.

        Checks: a ``base`` span ending past ``L`` raises
        :class:`~touba.errors.DecisionHistoryRecordInvalid` and stores nothing. Appends
        keep the log's token. Returns each logged channel's spans and the log's new state.
        Cost: O(k + blobs + spans), independent of N.
        """
        ...

    async def put_writes(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRecord],
    ) -> None:
        """Store pending writes of one checkpoint, atomically (all or none).

        ``idx >= 0``: insert-or-ignore on ``(checkpoint, task_id, idx)``; ``idx < 0``:
        insert-or-replace. The checkpoint need not exist (LangGraph's savers do not
        check either). Cost: O(len(writes)).
        """
        ...

    async def get(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str | None,
        held: Mapping[str, HeldLog],
    ) -> CheckpointPage:
        """One checkpoint (``checkpoint_id`` None: the latest, the greatest id), or none.

        Returns a page of zero or one row, with its blobs and writes, and for each of its
        logged channels a :class:`LogRead` keyed by :class:`LogKey`: the entries its
        spans name, only those at or above ``held[channel].length`` when the log's token
        equals ``held[channel].token``. A consistent snapshot (one read transaction, a
        Lua script, or reads validated against the log's token). Cost: O(blobs + writes +
        spans + k) for k entries returned: O(what the step added) for a warm caller.
        """
        ...

    async def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        """The checkpoints ``query`` selects, newest first (by ``checkpoint_id``
        descending; ties across threads or namespaces in any stable order).

        Rows as :meth:`get` gives them, and for every log their spans reference one
        :class:`LogRead` with the entries of the union of those spans (above the held
        length when the token matches). Cost: O(rows scanned + entries returned); with a
        ``thread_id`` an indexed range read of that thread's checkpoints, a metadata
        filter applied to the rows of that range.
        """
        ...

    async def delete_thread(self, thread_id: str) -> None:
        """Remove a thread: its checkpoints, writes, blobs and logs, in every namespace.

        Atomic. A missing thread is a no-op. Cost: O(what the thread holds).
        """
        ...

    async def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Remove the checkpoints whose ``run_id`` is in ``run_ids``, and their writes.

        Atomic. Blobs and log entries stay (later checkpoints may reference them); the
        logs' tokens are kept. Empty or unknown ``run_ids``: no-op. Cost: O(checkpoints
        removed) through an index on ``run_id``.
        """
        ...

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, write, blob and log entry of a thread to another.

        Atomic. Each source log's entries are appended to the target's log of the same
        ``(namespace, channel)`` at its end (offset = its length, 0 when new), and the
        copied spans shifted by that offset; rows whose keys exist on the target are
        kept as they are (insert-or-ignore). A missing source is a no-op. Cost:
        O(what the source holds).
        """
        ...

    async def prune(self, thread_ids: Sequence[str], strategy: PruneStrategy) -> None:
        """Prune threads, atomically per thread.

        ``"delete"``: as :meth:`delete_thread` for each. ``"keep_latest"``: in each
        namespace keep only the latest checkpoint (greatest id) with its writes, its
        blobs (the versions it names) and the log entries its spans name; remove every
        other checkpoint, write, blob and log entry of the thread, and give a log that
        lost entries a new token. Missing threads: no-op. Cost: O(what the threads hold).
        """
        ...

    async def close(self) -> None:
        """Release connections and threads; idempotent. Calls after it fail."""
        ...
