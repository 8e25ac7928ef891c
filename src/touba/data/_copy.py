"""Copy a deployment's decision histories from one set of stores to another, and verify it.

Decisions this module makes:

- **Whole conversations, through the target's own contract.** Each conversation is
  read whole from its source store (``read(key, purge=False)``: the source changes
  nothing, not even an expiry) and written whole into the paired target store with
  ``transact``. The target's bounds apply: a conversation it refuses (full store,
  ``max_store_bytes``) is reported by key and error code, never cut. The target's
  TTL applies too: a copied conversation expires ``ttl_seconds`` after the copy, as
  if it had just been used.
- **Resumable, never doubled, never overwritten.** A key the target already holds
  with an equal record (compared as canonical JSON, keys sorted) is skipped and
  counted as already there; one holding a different record is a *conflict*,
  reported and left untouched (the operation raises inside the target's ``transact``,
  so not even its expiry changes). Rerunning an interrupted copy therefore copies
  what is missing and nothing else. A target store built with
  ``worker_id=copy_worker_id()`` marks the reservations a copy takes: a rerun on the
  same host recovers those of a copy process that is gone (killed midway), and only
  those; any other reservation in the target is reported as busy.
- **Active conversations.** A source conversation reserved by a worker is listed and
  skipped (its holder is about to save a newer state). With ``include_active=True``
  its last saved state is copied (``read_saved``), as an inactive conversation: the
  target holds no reservation. A key reserved before its first save holds nothing to
  copy and is listed only.
- **Expired conversations** are not copied (the source would purge them at its next
  access); they are counted.
- **Verify** reads both sides again and compares a digest per conversation
  (sha256 of the record's canonical JSON, keys sorted: the same on every store
  whatever its layout), and the counts. A source conversation that is active and
  absent from the target is listed, not a mismatch; conversations the target holds
  beyond the source's are counted (a copy may merge into a store in use).
- **Memory store and checkpoints** go after the histories, as the export format's
  records (:mod:`touba.data._export` builds them, :func:`touba.data.import_records`
  writes them): every session with its turns, every key-event owner's events with their
  update history, every extraction job, every checkpoint. The import checks the whole
  stream and looks every record up before writing, so a conflict (a record present with
  other content) or a bound is reported and nothing of that part is written; records
  already present and equal are skipped (a rerun). Memory settings (per agent) and
  resource values are not copied: no binding can list its values, and ``Stores`` naming
  a resource binding is refused with ``ConfigurationError`` rather than half copied.
  The listing pages through the source while it runs: copy a deployment that is
  stopped, or rerun the copy, for sessions started meanwhile.
- Nothing here logs content: reports carry keys, counts, sizes and error codes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

# export's own readers, one per kind (private to the package: export and copy share them)
from touba.data._export import PAGE, checkpoint_line
from touba.data._export import _event_records as event_records
from touba.data._export import _job_records as job_records
from touba.data._export import _session_and_turns as session_records
from touba.data._format import (
    ImportConflict,
    ImportLimitExceeded,
    dump_line,
    end_line,
    header_line,
)
from touba.data._import import import_records
from touba.data._stores import Stores
from touba.errors import ConfigurationError, DecisionHistoryBusy, ToubaError
from touba.history._store import AdminStore, StoredConversation

__all__ = [
    "CopyIssue",
    "CopyReport",
    "VerifyMismatch",
    "VerifyReport",
    "conversation_digest",
    "copy_stores",
    "copy_worker_id",
    "verify_copy",
]

Record = dict[str, Any]
Progress = Callable[[str, int, int], None]
"""``progress(kind, done, total)``, called after each conversation (kind
``"conversation"``)."""

CONVERSATION: Final = "conversation"
COPY_WORKER: Final = "touba-copy:"
_CONCURRENCY: Final = 8  # conversations in flight at once (reads and writes overlap)


def copy_worker_id() -> str:
    """A ``worker_id`` for the target stores of a copy (``touba-copy:HOST:PID``).

    A target built with it marks the reservations this process takes; a rerun of
    :func:`copy_stores` on the same host recovers those whose process is gone (a copy
    killed midway), and no other reservation."""
    return f"{COPY_WORKER}{socket.gethostname()}:{os.getpid()}"


def conversation_digest(record: Record) -> str:
    """sha256 (hex) of ``record``'s canonical JSON (keys sorted, compact, UTF-8).

    The same record gives the same digest on every store, whatever its layout.
    ``ValueError`` for a value JSON cannot hold (NaN)."""
    return hashlib.sha256(_canonical(record)).hexdigest()


def _canonical(record: Record) -> bytes:
    text = json.dumps(
        record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    )
    return text.encode("utf-8")


# -- reports -------------------------------------------------------------------------------

IssueReason = Literal["active", "conflict", "refused", "busy", "unreadable"]


@dataclass(frozen=True, slots=True)
class CopyIssue:
    """A conversation the copy did not write.

    ``store``: the index of its history store in ``Stores.histories`` (0 for the other
    kinds). ``kind``: ``conversation``, or the export format's kind of a memory or
    checkpoint record (``session``, ``key_event``, ...), whose id ``key`` then is. ``reason``:
    ``active`` (reserved in the source, skipped), ``conflict`` (the target holds a
    different record under that key, untouched), ``refused`` (the target refused it:
    ``code`` is the error's, e.g. ``DecisionHistoryLimitExceeded``), ``busy`` (the
    target key is reserved by someone else), ``unreadable`` (the source record could
    not be read: ``code`` says why). Never content. For memory and checkpoint records
    a conflict or a refusal means none of them was written (the import checks them all
    first).
    """

    store: int
    key: str
    reason: IssueReason
    code: str = ""
    kind: str = "conversation"


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What :func:`copy_stores` did, per kind of record.

    ``copied``/``already`` count, per kind, the records written and those the
    target already held equal (a rerun's). ``bytes``: the canonical JSON size of
    what was written. ``copied_active``: keys whose last saved state was copied
    from a reserved conversation (``include_active``). ``expired``: source
    conversations past their expiry, not copied. ``recovered``: target keys whose
    reservation by a dead copy process was freed first. ``issues``: every
    conversation not written, with why.
    """

    copied: dict[str, int] = field(default_factory=dict)
    already: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    copied_active: tuple[str, ...] = ()
    expired: int = 0
    recovered: tuple[str, ...] = ()
    issues: tuple[CopyIssue, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every live conversation of the source is now in the target
        (active ones skipped on purpose excepted): no conflict, refusal or busy key."""
        return all(issue.reason == "active" for issue in self.issues)

    def of(self, reason: IssueReason) -> tuple[CopyIssue, ...]:
        """The issues of one reason, in the order met."""
        return tuple(issue for issue in self.issues if issue.reason == reason)


@dataclass(frozen=True, slots=True)
class VerifyMismatch:
    """A source conversation the target does not hold equal.

    ``reason``: ``missing`` (absent from the target), ``different`` (digests differ),
    ``unreadable`` (either side could not be read; ``code`` says why). Digests are
    :func:`conversation_digest`'s (of the export record for the other kinds: ``kind``
    and ``key`` as in :class:`CopyIssue`), empty when that side has no record."""

    store: int
    key: str
    reason: Literal["missing", "different", "unreadable"]
    source_digest: str = ""
    target_digest: str = ""
    code: str = ""
    kind: str = "conversation"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify_copy` found.

    ``counts``: per kind, (records in the source, records in the target) — the
    target may hold more (a merge). ``matched``: source records whose digest the
    target has under the same key. ``active``: keys active in the source and absent
    from the target (skipped by the copy, not a mismatch). ``mismatches``: the rest.
    """

    counts: dict[str, tuple[int, int]]
    matched: int
    active: tuple[str, ...] = ()
    mismatches: tuple[VerifyMismatch, ...] = ()

    @property
    def clean(self) -> bool:
        """True when every source record is in the target, equal."""
        return not self.mismatches


# -- the stores as this module uses them ---------------------------------------------------


class _SavedReader(Protocol):
    async def read_saved(self, key: str) -> Record | None: ...


class _Writable(Protocol):
    async def transact(self, key: str, operation: Any) -> Any: ...


class _Keep(Exception):
    """Raised inside the target's transact to leave its record as it is."""

    def __init__(self, outcome: Literal["already", "conflict"]) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _pairs(source: Stores, target: Stores) -> list[tuple[AdminStore, AdminStore]]:
    if source.resources is not None or target.resources is not None:
        raise ConfigurationError(
            "resource values are not copied (no resource binding can list its values): "
            "give Stores without resources= and set them again in the new binding"
        )
    for name in ("memory", "checkpoints"):
        if (getattr(source, name) is None) != (getattr(target, name) is None):
            raise ConfigurationError(
                f"give a {name} store on both sides or on neither (source: "
                f"{getattr(source, name) is not None}, target: {getattr(target, name) is not None})"
            )
    if len(source.histories) != len(target.histories):
        raise ConfigurationError(
            f"the source has {len(source.histories)} history stores and the target "
            f"{len(target.histories)}: give one target per source store, in the same order"
        )
    return list(zip(source.histories, target.histories, strict=True))


async def _saved(store: AdminStore, key: str) -> Record | None:
    """The record as last saved; ``DecisionHistoryBusy`` when the store cannot read a
    reserved key's saved state (a store without ``read_saved``)."""
    if not _has_saved(store):
        return await store.read(key, purge=False)
    reader: _SavedReader = store  # type: ignore[assignment]  # checked just above
    return await reader.read_saved(key)


def _has_saved(store: object) -> bool:
    return callable(getattr(store, "read_saved", None))


def _code(error: BaseException) -> str:
    return getattr(error, "code", type(error).__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _stale_copy(row: StoredConversation) -> bool:
    """A reservation taken by a copy process of this host that is gone."""
    held = row.reservation or {}
    worker = str(held.get("worker_id") or "")
    if not row.active or not worker.startswith(COPY_WORKER):
        return False
    if held.get("host") != socket.gethostname():
        return False
    try:
        pid = int(held.get("pid") or 0)
    except (TypeError, ValueError):
        return False
    return pid > 0 and pid != os.getpid() and not _alive(pid)


# -- copy ---------------------------------------------------------------------------------


@dataclass
class _Tally:
    copied: dict[str, int] = field(default_factory=lambda: {CONVERSATION: 0})
    already: dict[str, int] = field(default_factory=lambda: {CONVERSATION: 0})
    bytes: int = 0
    expired: int = 0
    done: int = 0
    copied_active: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    issues: list[CopyIssue] = field(default_factory=list)


async def copy_stores(
    source: Stores,
    target: Stores,
    *,
    include_active: bool = False,
    progress: Progress | None = None,
) -> CopyReport:
    """Copy every conversation of ``source``'s history stores into ``target``'s, then
    every record of its memory store and checkpoint store (when given) into ``target``'s.

    ``source.histories[i]`` goes to ``target.histories[i]``. Resumable: rerun after
    an interruption, nothing is doubled and nothing in the target is overwritten
    (see the module docstring for equal, conflicting, active and expired
    conversations). ``include_active``: copy the last saved state of reserved
    conversations, as inactive ones (the store needs ``read_saved``; the built-in
    stores have it). ``progress(kind, done, total)`` is called after each
    conversation (kind ``"conversation"``) and each memory or checkpoint record read
    (kind ``"record"``, total 0: unknown).

    Returns a :class:`CopyReport`; per-conversation refusals, and a conflict or a bound
    of the memory and checkpoint part, are in it, not raised. Raises
    ``ConfigurationError`` when the stores do not pair (another number of history
    stores, a memory or checkpoint store on one side only) or name a resource binding
    (not copied); the stores' errors that concern a whole store
    (``DecisionHistoryStoreUnavailable`` while listing); and any exception that is not
    a touba error, as raised (what was written stays; a rerun completes it).
    """
    pairs = _pairs(source, target)
    tally = _Tally()
    listed = [await src.list(purge=False) for src, _ in pairs]
    total = sum(len(rows) for rows in listed)
    for index, ((src, dst), rows) in enumerate(zip(pairs, listed, strict=True)):
        await _recover_stale(dst, {row.key for row in rows}, tally)
        await _copy_pair(index, src, dst, rows, include_active, tally, progress, total)
    if source.memory is not None or source.checkpoints is not None:
        await _copy_records(source, target, tally, progress)
    return CopyReport(
        copied=dict(tally.copied),
        already=dict(tally.already),
        bytes=tally.bytes,
        copied_active=tuple(tally.copied_active),
        expired=tally.expired,
        recovered=tuple(tally.recovered),
        issues=tuple(tally.issues),
    )


async def _recover_stale(store: AdminStore, keys: set[str], tally: _Tally) -> None:
    for row in await store.list(purge=False):
        stale = row.key in keys and _stale_copy(row)
        if stale and await store.recover(row.key, worker_stopped=True):
            tally.recovered.append(row.key)


async def _copy_pair(
    index: int,
    src: AdminStore,
    dst: AdminStore,
    rows: Sequence[StoredConversation],
    include_active: bool,
    tally: _Tally,
    progress: Progress | None,
    total: int,
) -> None:
    queue = list(reversed(rows))

    async def worker() -> None:
        while queue:
            row = queue.pop()
            await _copy_one(index, src, dst, row, include_active, tally)
            tally.done += 1
            if progress is not None:
                progress(CONVERSATION, tally.done, total)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(_CONCURRENCY, len(rows))):
                group.create_task(worker())
    except BaseExceptionGroup as failed:  # the first failure, as one copy in a row raises it
        raise failed.exceptions[0] from None


async def _copy_one(
    index: int,
    src: AdminStore,
    dst: AdminStore,
    row: StoredConversation,
    include_active: bool,
    tally: _Tally,
) -> None:
    key = row.key
    if row.expired and not row.active:
        tally.expired += 1
        return
    held = row.active
    try:
        if held and not (include_active and _has_saved(src)):
            tally.issues.append(CopyIssue(index, key, "active"))
            return
        try:
            record = await (_saved(src, key) if held else src.read(key, purge=False))
        except DecisionHistoryBusy:  # reserved since it was listed
            if not (include_active and _has_saved(src)):
                tally.issues.append(CopyIssue(index, key, "active"))
                return
            held = True
            record = await _saved(src, key)
    except ToubaError as e:
        tally.issues.append(CopyIssue(index, key, "unreadable", _code(e)))
        return
    if record is None:
        if held:  # a reservation of a key with nothing saved yet
            tally.issues.append(CopyIssue(index, key, "active"))
        else:  # expired, or deleted, since it was listed
            tally.expired += 1
        return
    await _write(index, dst, key, record, held, tally)


async def _write(
    index: int, dst: AdminStore, key: str, record: Record, held: bool, tally: _Tally
) -> None:
    body = _canonical(record)

    async def put(existing: Record | None) -> tuple[Record | None, None]:
        if existing is None:
            return record, None
        raise _Keep("already" if _canonical(existing) == body else "conflict")

    writable: _Writable = dst  # type: ignore[assignment]  # every built-in AdminStore is one
    try:
        await writable.transact(key, put)
    except _Keep as kept:
        if kept.outcome == "already":
            tally.already[CONVERSATION] += 1
        else:
            tally.issues.append(CopyIssue(index, key, "conflict"))
        return
    except DecisionHistoryBusy as e:
        tally.issues.append(CopyIssue(index, key, "busy", _code(e)))
        return
    except ToubaError as e:
        tally.issues.append(CopyIssue(index, key, "refused", _code(e)))
        return
    tally.copied[CONVERSATION] += 1
    tally.bytes += len(body)
    if held:
        tally.copied_active.append(key)


# -- memory and checkpoints: the export format's records, written by import ----------------


async def _records(stores: Stores) -> AsyncIterator[dict[str, Any]]:
    """Every record of ``stores``' memory store and checkpoint store, as export writes them."""
    memory: Any = stores.memory
    if memory is not None:
        if not callable(getattr(memory, "list_event_owners", None)):
            raise ConfigurationError(
                "this memory store cannot list its key-event owners (list_event_owners); "
                "copy from a built-in store (SqliteMemoryStore, PostgresMemoryStore)"
            )
        offset = 0
        while page := await memory.list_sessions(limit=PAGE, offset=offset):
            for meta in page:
                async for line in session_records(memory, meta.session_id):
                    yield line
            offset += len(page)
        offset = 0
        while owners := await memory.list_event_owners(limit=PAGE, offset=offset):
            for owner in owners:
                async for line in event_records(memory, owner):
                    yield line
            offset += len(owners)
        async for line in job_records(memory, lambda job: True):
            yield line
    checkpoints: Any = stores.checkpoints
    if checkpoints is not None:
        for info in await checkpoints.list():
            body = await checkpoints.get(info.checkpoint_id)
            if body is not None:  # deleted meanwhile
                yield checkpoint_line(info.checkpoint_id, body)


def _record_name(line: dict[str, Any]) -> str:
    """The id naming a memory or checkpoint record (never content)."""
    kind = line["kind"]
    if kind == "session":
        return str(line["session_id"])
    if kind == "turn":
        return f"{line['session_id']}#{line['index']}"
    if kind == "key_event_change":
        return f"{line['event_id']}#{line['index']}"
    return str(line["id"])


async def _copy_records(
    source: Stores, target: Stores, tally: _Tally, progress: Progress | None
) -> None:
    read = 0

    async def lines() -> AsyncIterator[bytes]:
        nonlocal read
        yield dump_line(header_line({"copy": "memory and checkpoints"}))
        async for line in _records(source):
            read += 1
            if progress is not None:
                progress("record", read, 0)
            yield dump_line(line)
        yield dump_line(end_line(read))

    into = Stores(memory=target.memory, checkpoints=target.checkpoints)
    try:
        imported = await import_records(into, lines())
    except ImportConflict as e:
        tally.issues.append(CopyIssue(0, e.record, "conflict", kind=e.kind))
        return
    except ImportLimitExceeded as e:
        tally.issues.append(CopyIssue(0, "", "refused", f"{_code(e)}: {e.limit}", kind="record"))
        return
    for kind, count in imported.added.items():
        tally.copied[kind] = tally.copied.get(kind, 0) + count
    for kind, count in imported.present.items():
        tally.already[kind] = tally.already.get(kind, 0) + count


async def _record_digests(stores: Stores) -> dict[tuple[str, str], str]:
    return {
        (line["kind"], _record_name(line)): conversation_digest(line)
        async for line in _records(stores)
    }


# -- verify -------------------------------------------------------------------------------


async def verify_copy(source: Stores, target: Stores) -> VerifyReport:
    """Compare ``source``'s history stores with ``target``'s, conversation by conversation,
    and the records of their memory and checkpoint stores, when given.

    Reads only (``purge=False``; the saved state of reserved conversations where the
    store has ``read_saved``). Returns a :class:`VerifyReport`: counts per kind, the
    conversations that match, those active and not copied, and every mismatch with
    both digests (:func:`conversation_digest`). Raises ``ConfigurationError`` when
    the stores do not pair, as :func:`copy_stores` does.
    """
    pairs = _pairs(source, target)
    counts = [0, 0]
    matched = 0
    active: list[str] = []
    mismatches: list[VerifyMismatch] = []
    for index, (src, dst) in enumerate(pairs):
        src_rows = [r for r in await src.list(purge=False) if not r.expired or r.active]
        dst_rows = [r for r in await dst.list(purge=False) if not r.expired or r.active]
        counts[1] += sum(1 for r in dst_rows if r.messages or not r.active)
        for row in src_rows:
            outcome = await _compare(index, src, dst, row)
            if outcome is None:
                continue  # a bare reservation: nothing saved, nothing to hold
            counts[0] += 1
            if outcome == "matched":
                matched += 1
            elif outcome == "active":
                active.append(row.key)
            else:
                mismatches.append(outcome)
    kinds: dict[str, tuple[int, int]] = {CONVERSATION: (counts[0], counts[1])}
    if source.memory is not None or source.checkpoints is not None:
        mine = await _record_digests(source)
        theirs = await _record_digests(Stores(memory=target.memory, checkpoints=target.checkpoints))
        for kind in sorted({kind for kind, _ in mine} | {kind for kind, _ in theirs}):
            kinds[kind] = (
                sum(1 for k, _ in mine if k == kind),
                sum(1 for k, _ in theirs if k == kind),
            )
        for (kind, name), digest in mine.items():
            found = theirs.get((kind, name), "")
            if found == digest:
                matched += 1
            else:
                reason: Literal["missing", "different"] = "different" if found else "missing"
                mismatches.append(VerifyMismatch(0, name, reason, digest, found, kind=kind))
    return VerifyReport(
        counts=kinds,
        matched=matched,
        active=tuple(active),
        mismatches=tuple(mismatches),
    )


async def _compare(
    index: int, src: AdminStore, dst: AdminStore, row: StoredConversation
) -> VerifyMismatch | Literal["matched", "active"] | None:
    key = row.key
    try:
        mine = await _saved(src, key)
    except DecisionHistoryBusy:
        return "active"  # reserved, and this store cannot read its saved state
    except ToubaError as e:
        return VerifyMismatch(index, key, "unreadable", code=_code(e))
    if mine is None:
        return None
    expected = conversation_digest(mine)
    try:
        theirs = await _saved(dst, key)
    except ToubaError as e:
        return VerifyMismatch(index, key, "unreadable", expected, code=_code(e))
    if theirs is None:
        if row.active:
            return "active"
        return VerifyMismatch(index, key, "missing", expected)
    found = conversation_digest(theirs)
    if found != expected:
        return VerifyMismatch(index, key, "different", expected, found)
    return "matched"
