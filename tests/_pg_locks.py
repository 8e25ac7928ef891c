"""A lock sampler for PostgreSQL: which writer of a run waited on which, while it ran.

The writers of a run connect with ``application_name`` ``<run>:<writer>`` (one
name per conversation, user or invocation: :func:`writer_dsn`), so every
backend belongs to one writer. :class:`LockSampler` then reads, on a
connection of its own, in a thread of its own (the event loop of the writers
never delays it), every few milliseconds, in one statement:

- how many of the run's backends are running a statement (``state =
  'active'``), so a run whose writes never overlapped cannot pass for one
  without waits;
- every lock a backend of the run waits for (``pg_locks.granted = false``):
  its object (``locktype``, relation, page, tuple, transaction id, advisory
  key) and mode, and the backends of the run that block it
  (``pg_blocking_pids``: those holding a conflicting lock, and those queued
  ahead of it for one).

A wait is *crossing* when a writer other than the waiting one blocks it (one
conversation's write waiting on another's); a wait of a writer on itself (two
connections of one worker on one key) is not. A wait for a relation's *extension*
lock (``locktype = 'extend'``: PostgreSQL adding a page to a table's file, held
for the time of that one write to the file by whichever insert found no free
space) is storage, not a lock any write of touba's takes or holds: it is
counted apart (``extend_waits``), never as crossing. Every insert into one
table can meet it, whatever the schema; it lasts microseconds and queues
nothing behind a transaction. Backends of other clients of a
shared server are never counted: only the run's names are read.

Used by ``tests/history/test_pg_no_queue.py`` and ``bench/pg_writers.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg

__all__ = ["LockSampler", "Wait", "writer_dsn"]

INTERVAL: Final = 0.002  # seconds between samples

# One sample in one round trip: the run's active backends, then its waits.
_SAMPLE: Final = """
SELECT
  (SELECT count(*) FROM pg_stat_activity
    WHERE application_name LIKE %(pattern)s AND state = 'active'),
  (SELECT coalesce(json_agg(json_build_object(
     'waiter', a.application_name,
     'locktype', l.locktype,
     'mode', l.mode,
     'relation', l.relation::regclass::text,
     'page', l.page, 'tuple', l.tuple,
     'transactionid', l.transactionid::text,
     'objid', l.objid, 'classid', l.classid,
     'blockers', (SELECT coalesce(json_agg(b.application_name), '[]'::json)
                  FROM pg_stat_activity AS b
                  WHERE b.pid = ANY(pg_blocking_pids(l.pid))
                  AND b.application_name LIKE %(pattern)s))), '[]'::json)
   FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
   WHERE NOT l.granted AND a.application_name LIKE %(pattern)s)
"""


def writer_dsn(dsn: str, run: str, writer: str) -> str:
    """``dsn`` whose connections are named ``<run>:<writer>`` (a URL or key=value DSN)."""
    name = f"{run}:{writer}"
    if "://" not in dsn:
        return f"{dsn} application_name={name}"
    parts = urlsplit(dsn)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "application_name"]
    query.append(("application_name", name))
    return urlunsplit(parts._replace(query=urlencode(query)))


@dataclass(frozen=True, slots=True)
class Wait:
    """One lock a writer waited for in one sample, and the writers blocking it."""

    waiter: str
    blockers: tuple[str, ...]
    locktype: str
    mode: str
    target: str  # the object: relation (and page, tuple), transaction id or advisory key

    @property
    def crossing(self) -> bool:
        """Blocked by another writer of the run (not only by the waiter itself), on
        a lock a write takes (not a relation's extension: see the module docstring)."""
        if self.locktype == "extend":
            return False
        return any(blocker != self.waiter for blocker in self.blockers)


@dataclass
class LockSampler:
    """Samples the run's backends until stopped (``with``: from enter to exit)."""

    dsn: str
    run: str
    interval: float = INTERVAL
    samples: int = 0
    busy_samples: int = 0  # samples where two or more of the run's backends were active
    waits: list[Wait] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def __enter__(self) -> LockSampler:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)
        if self._error is not None:
            raise self._error

    @property
    def crossing(self) -> list[Wait]:
        """The waits of one writer on another."""
        return [wait for wait in self.waits if wait.crossing]

    def summary(self) -> dict[str, Any]:
        """Samples, busy samples, waits and crossing waits, with the crossing waits'
        objects counted (locktype and target)."""
        crossing = self.crossing
        return {
            "samples": self.samples,
            "busy_samples": self.busy_samples,
            "waits": len(self.waits),
            "crossing": len(crossing),
            "extend_waits": sum(1 for w in self.waits if w.locktype == "extend"),
            "crossing_on": dict(Counter(f"{w.locktype} {w.target}" for w in crossing)),
        }

    def _loop(self, ready: threading.Event) -> None:
        name = writer_dsn(self.dsn, f"{self.run}-sampler", "s")
        params = {"pattern": f"{self.run}:%"}
        try:
            with psycopg.connect(name, autocommit=True) as conn:
                ready.set()
                while not self._stop.is_set():
                    row = conn.execute(_SAMPLE, params).fetchone()
                    assert row is not None
                    active, waits = row
                    self.samples += 1
                    self.busy_samples += active >= 2
                    for found in waits if isinstance(waits, list) else json.loads(waits):
                        self.waits.append(_wait(found))
                    time.sleep(self.interval)
        except BaseException as e:  # reported by __enter__ or __exit__
            self._error = e
            ready.set()


def _wait(found: dict[str, Any]) -> Wait:
    locktype = str(found["locktype"])
    if locktype == "transactionid":
        target = f"xid {found['transactionid']}"
    elif locktype == "advisory":
        target = f"advisory {found['classid']}:{found['objid']}"
    else:
        where = [str(found["relation"])]
        where += [f"{k} {found[k]}" for k in ("page", "tuple") if found[k] is not None]
        target = " ".join(where)
    waiter = _writer(str(found["waiter"]))
    return Wait(
        waiter=waiter,
        blockers=tuple(_writer(str(b)) for b in found["blockers"]),
        locktype=locktype,
        mode=str(found["mode"]),
        target=target,
    )


def _writer(application_name: str) -> str:
    """The writer a backend's ``<run>:<writer>`` name gives."""
    return application_name.partition(":")[2]
