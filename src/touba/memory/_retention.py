"""Retention: how long each kind of record is kept, and its application over stores.

:class:`Retention` names a bound per kind, in days; None (the default of each) keeps
that kind for as long as before: nothing expires that did not expire already.
:func:`purge_stores` applies one over a memory store, a checkpoint store and
decision-history stores, through each store's own ``purge_before`` (``purge_expired``
for histories), and returns a :class:`RetentionReport` of counts, never content.
``touba.data.apply_retention`` (over a deployment's ``Stores``), ``touba purge`` and
the extraction worker (``ExtractionWorker(retention=...)``) are built on it.

Decisions (each kind's age is measured from one stored time):

- **turns_days**: a chat turn goes once it was created that long ago, with its trace and
  context. An ended session whose turns have all gone, and that ended that long ago,
  goes too; an open session stays, even empty (a live chat may go on). Extraction
  jobs ``done`` or ``failed`` last changed that long ago go with the turns they were
  extracted from (their ops quote them); pending and running jobs stay.
- **events_closed_days**: a key event ``closed`` (the one closed status; ``open`` and
  ``in_progress`` stay however old) goes, with its update history, once its last
  change (the closing, or a later edit) is that old.
- **checkpoints_days**: a checkpoint awaiting approval, or failed, goes once its last
  write is that old (its approval was never given; its retry never came). A
  ``running`` checkpoint stays: a worker holds it, or crashed holding it, and
  ``Runtime.resume(..., worker_stopped=True)`` decides its fate. A completed
  invocation leaves no checkpoint, so no "finished" one waits. A checkpoint's trace
  goes with it.
- **traces_days**: the tool trace (calls, arguments, results) and the context record
  of each turn created that long ago are dropped; the user message and the replies
  stay (until ``turns_days``). Traces inside checkpoints stay with their checkpoint
  (a resume continues them).
- **Decision histories** keep their own ``ttl_seconds``: every application purges the
  conversations already expired (as ``touba history purge`` does), nothing more.

Deletes run in batches of short transactions (each store's ``PURGE_BATCH``), so a large
first purge never holds a store's lock for long; one interrupted midway is finished by
the next. ``dry_run`` counts what would go and deletes nothing. Backups, WAL files and
copies made elsewhere are out of reach.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from touba.errors import ConfigurationError
from touba.history._store import AdminStore

__all__ = ["Retention", "RetentionReport", "purge_stores"]

_KINDS = ("turns_days", "events_closed_days", "checkpoints_days", "traces_days")


@runtime_checkable
class _PurgesMemory(Protocol):
    async def purge_before(
        self,
        *,
        turns: datetime | None = None,
        events_closed: datetime | None = None,
        traces: datetime | None = None,
        dry_run: bool = False,
    ) -> dict[str, int]: ...


@runtime_checkable
class _PurgesCheckpoints(Protocol):
    async def purge_before(self, before: datetime, *, dry_run: bool = False) -> int: ...


@dataclass(frozen=True, slots=True)
class Retention:
    """How many days each kind of record is kept; None keeps it (the default of each).

    ``turns_days``: chat turns (and ended sessions left empty, finished extraction
    jobs); ``events_closed_days``: closed key events and their update history, counted
    from their last change; ``checkpoints_days``: checkpoints awaiting approval or
    failed (never a running one); ``traces_days``: the tool trace and context record
    of turns, their text kept. Each is a positive number of days (a float is fine:
    ``0.5`` is twelve hours) or None; anything else raises ``ConfigurationError``.
    ``Retention()`` changes nothing that does not already expire (decision histories
    keep their own ``ttl_seconds``). The rules, precisely: :mod:`touba.memory._retention`.
    """

    turns_days: float | None = None
    events_closed_days: float | None = None
    checkpoints_days: float | None = None
    traces_days: float | None = None

    def __post_init__(self) -> None:
        for name in _KINDS:
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigurationError(
                    f"{name} must be a positive number of days or None (keep forever), "
                    f"got {value!r}"
                )
            if value > 1_000_000:
                raise ConfigurationError(
                    f"{name} must be at most 1000000 days, got {value!r}; use None to keep forever"
                )

    @property
    def configured(self) -> bool:
        """Whether any bound is set (``Retention()`` is not)."""
        return any(getattr(self, name) is not None for name in _KINDS)

    def cutoff(self, name: str, now: datetime) -> datetime | None:
        """The moment before which records of kind ``name`` (a field's name) go, or None."""
        if name not in _KINDS:
            raise ConfigurationError(f"no retention kind {name!r}; one of {', '.join(_KINDS)}")
        days = getattr(self, name)
        return None if days is None else now - timedelta(days=days)


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """What one application of a :class:`Retention` removed (with ``dry_run``: would
    remove): counts per store and kind, never content, ids or user names.

    ``counts``: store (``"memory"``, ``"checkpoints"``, ``"history"``, or ``"history:0"``,
    ``"history:1"``... when there are several: the labels of
    :class:`~touba.data.ErasureReceipt`) -> kind -> count; a kind whose bound is not set
    is absent, one whose bound is set counts even 0. Memory kinds: ``turns``,
    ``sessions``, ``extraction_jobs``, ``key_events``, ``key_event_updates``, ``traces``
    (turns whose trace and context were dropped); checkpoints: ``checkpoints``;
    histories: ``conversations`` (the expired ones purged). ``at``: the moment the ages
    were measured from.
    """

    at: datetime
    dry_run: bool
    retention: Retention
    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every count added up."""
        return sum(n for kinds in self.counts.values() for n in kinds.values())

    def as_json(self) -> dict[str, Any]:
        """The report as JSON data (for an event, a log line or ``--json``): ``at``
        (ISO 8601), ``dry_run``, ``retention`` (the bounds), ``counts`` and ``total``."""
        return {
            "at": self.at.isoformat(),
            "dry_run": self.dry_run,
            "retention": {name: getattr(self.retention, name) for name in _KINDS},
            "counts": {store: dict(kinds) for store, kinds in self.counts.items()},
            "total": self.total,
        }


def _check_now(now: object) -> datetime:
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigurationError(f"now must be a timezone-aware datetime, got {now!r}")
    return now


def _labels(count: int) -> list[str]:
    """As ``touba.data.ErasureReceipt`` names them: ``history``, or ``history:0``..."""
    return ["history"] if count == 1 else [f"history:{i}" for i in range(count)]


async def _expired(store: AdminStore, dry_run: bool) -> int:
    """The conversations already expired (and not held), purged unless ``dry_run``."""
    purge = getattr(store, "purge_expired", None)
    if not dry_run and callable(purge):
        return int(await purge())
    expired = sum(c.expired and not c.active for c in await store.list(purge=False))
    if not dry_run:  # a store without purge_expired (RAM) purges on every access
        await store.list()
    return expired


async def purge_stores(
    retention: Retention,
    *,
    memory: object | None = None,
    checkpoints: object | None = None,
    histories: Sequence[AdminStore] = (),
    now: datetime | None = None,
    dry_run: bool = False,
) -> RetentionReport:
    """Apply ``retention`` to the stores given (see the module notes for each kind).

    ``now`` (aware) is the moment ages are measured from: by default the memory
    store's clock, else the system's. Every store a set bound applies to is checked
    before anything is deleted: one without ``purge_before`` (a store of your own)
    raises ``ConfigurationError``. A store failure raises its store's error
    (``MemoryStoreUnavailable``, ``CheckpointStoreUnavailable``, ...); the batches
    committed before it stay done, and running again finishes.
    """
    if not isinstance(retention, Retention):
        raise ConfigurationError(
            f"retention must be a touba.data.Retention, got {type(retention).__name__}"
        )
    if not isinstance(dry_run, bool):
        raise ConfigurationError(f"dry_run must be True or False, got {dry_run!r}")
    memory_bounds = (retention.turns_days, retention.events_closed_days, retention.traces_days)
    wants_memory = memory is not None and any(d is not None for d in memory_bounds)
    if wants_memory and not isinstance(memory, _PurgesMemory):
        raise ConfigurationError(
            "this memory store has no purge_before (only the built-in SQLite and PostgreSQL "
            "ones have it); nothing was deleted"
        )
    wants_checkpoints = checkpoints is not None and retention.checkpoints_days is not None
    if wants_checkpoints and not isinstance(checkpoints, _PurgesCheckpoints):
        raise ConfigurationError(
            "this checkpoint store has no purge_before (the built-in ones have it); nothing "
            "was deleted"
        )
    if now is None:
        clock = getattr(memory, "now", None)
        now = clock() if callable(clock) else datetime.now(UTC)
    now = _check_now(now)
    counts: dict[str, Mapping[str, int]] = {}
    if wants_memory:
        assert isinstance(memory, _PurgesMemory)
        found = await memory.purge_before(
            turns=retention.cutoff("turns_days", now),
            events_closed=retention.cutoff("events_closed_days", now),
            traces=retention.cutoff("traces_days", now),
            dry_run=dry_run,
        )
        counts["memory"] = MappingProxyType(dict(found))
    if wants_checkpoints:
        assert isinstance(checkpoints, _PurgesCheckpoints)
        cutoff = retention.cutoff("checkpoints_days", now)
        assert cutoff is not None
        removed = await checkpoints.purge_before(cutoff, dry_run=dry_run)
        counts["checkpoints"] = MappingProxyType({"checkpoints": removed})
    for label, store in zip(_labels(len(histories)), histories, strict=True):
        counts[label] = MappingProxyType({"conversations": await _expired(store, dry_run)})
    return RetentionReport(now, dry_run, retention, MappingProxyType(counts))
