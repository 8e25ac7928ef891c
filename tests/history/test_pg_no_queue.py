"""No hidden queue on any PostgreSQL store: 8 writers of different keys never wait on each other.

For each PostgreSQL store with per-key writes (``PostgresHistoryStore``: 8
conversations, whose keys all hash to one usage shard, the worst case;
``PostgresMemoryStore``: 8 users writing chat turns and key-event updates;
``PostgresCheckpointStore``: 8 invocations; ``PostgresResourceBinding``: 8 runs'
resources), 8 writers write at once for a few seconds while
:class:`tests._pg_locks.LockSampler` reads ``pg_stat_activity`` and ``pg_locks``
every few milliseconds on a connection of its own. The assertion: no wait of
one writer's statement on a lock held (or queued for) by another writer's,
whatever the object (a row, a tuple, a transaction id, an advisory key, a
table); a writer waiting on itself would be allowed. So that it cannot pass
vacuously, the sampler must have taken enough samples, enough of them while two
or more of the writers' statements ran at once, and every writer must have made
progress; and
``test_the_sampler_sees_a_crossing_wait`` shows a wait of one writer on another
is found. For the history store, no writer may take the exact path (the
exclusive advisory lock every writer of the counters then waits for) either: the
store has a GiB free, so every growth fits a shard's room. Before schema 6 one
write in a few hundred did (the shard it locked had changed since its
statement's snapshot, see ``TAKE`` in ``touba.history._pg_sql``), and the others
then queued behind it.

The 8 writers are 8 asyncio tasks in this process, each a worker with its own
store object, its own pool and its own ``application_name`` (so each backend
belongs to one writer and a wait is attributed exactly): on this 2-core machine
8 processes would spend the test's time importing and scheduling, while the
server sees the same thing either way, 8 backends with statements in flight at
once (``busy_samples`` counts them). ``bench/pg_writers.py`` runs the same
writers in 1 to 8 processes.

Each store gets a schema of its own (``touba_pgq_<random>``), dropped at teardown.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import psycopg
import pytest
from psycopg import sql

from tests._pg_locks import LockSampler, writer_dsn
from tests._pg_writers import KINDS, Writer, drop_schema, make_schema, names, prepare, writer
from tests._services import postgres_dsn
from touba.history.postgres import PostgresHistoryStore

pytestmark = pytest.mark.postgres

WRITERS = 8
SECONDS = 3.0  # of writing, per store
MIN_SAMPLES = 100  # the sampler loops every 2 ms: ~1,000 in 3 s on an idle machine
MIN_BUSY_SAMPLES = 20  # ... of which this many saw two or more writers' statements at once
MIN_DECISIONS = 5  # per writer


T = TypeVar("T")


@pytest.fixture
def exact_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The writers whose history write took the exact path (``_in_room`` with
    ``exact=True``), the first write of ``prepare`` (worker "first") left out."""
    taken: list[str] = []
    original = PostgresHistoryStore._in_room

    async def in_room(self: PostgresHistoryStore, attempt: Callable[[bool], Awaitable[T]]) -> T:
        async def counted(exact: bool) -> T:
            if exact and self.worker_id != "first":
                taken.append(str(self.worker_id))
            return await attempt(exact)

        return await original(self, counted)

    monkeypatch.setattr(PostgresHistoryStore, "_in_room", in_room)
    return taken


@pytest.fixture
def schema() -> Iterator[str]:
    dsn = postgres_dsn()
    name = f"touba_pgq_{uuid.uuid4().hex[:10]}"
    make_schema(dsn, name)
    yield name
    drop_schema(dsn, name)


async def _write_at_once(
    kind: str, dsn: str, schema: str, run: str
) -> tuple[LockSampler, list[int]]:
    """``WRITERS`` writers of ``kind`` writing for ``SECONDS`` under the sampler."""
    await prepare(kind, dsn, schema)
    writers = [
        writer(kind, writer_dsn(dsn, run, name), schema, name) for name in names(kind, dsn, WRITERS)
    ]
    for w in writers:
        await w.open()
    try:
        with LockSampler(dsn, run) as sampler:
            until = time.monotonic() + SECONDS

            async def loop(w: Writer) -> None:
                while time.monotonic() < until:
                    await w.write()

            await asyncio.gather(*(loop(w) for w in writers))
    finally:
        for w in writers:
            await w.close()
    return sampler, [w.decisions for w in writers]


@pytest.mark.parametrize("kind", KINDS)
async def test_no_writer_waits_on_another(kind: str, schema: str, exact_paths: list[str]) -> None:
    dsn = postgres_dsn()
    run = f"pgq{uuid.uuid4().hex[:8]}"
    sampler, decisions = await _write_at_once(kind, dsn, schema, run)
    summary = sampler.summary()
    assert min(decisions) >= MIN_DECISIONS, (decisions, summary)
    assert sampler.samples >= MIN_SAMPLES, summary
    assert sampler.busy_samples >= MIN_BUSY_SAMPLES, summary
    assert sampler.crossing == [], summary
    assert exact_paths == [], summary


async def test_the_sampler_sees_a_crossing_wait(schema: str) -> None:
    """Two writers of one row: the second waits on the first's transaction, and the
    sampler reports it as crossing, with its object."""
    dsn = postgres_dsn()
    run = f"pgq{uuid.uuid4().hex[:8]}"
    table = sql.Identifier(schema, "counter")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, n int)").format(table))
        conn.execute(sql.SQL("INSERT INTO {} VALUES (1, 0)").format(table))
    update = sql.SQL("UPDATE {} SET n = n + 1 WHERE id = 1").format(table)
    first = await psycopg.AsyncConnection.connect(writer_dsn(dsn, run, "a"))
    second = await psycopg.AsyncConnection.connect(writer_dsn(dsn, run, "b"), autocommit=True)
    try:
        with LockSampler(dsn, run) as sampler:
            await first.execute(update)  # holds the row
            waiting = asyncio.ensure_future(second.execute(update))
            await asyncio.sleep(0.3)
            await first.commit()
            await waiting
    finally:
        await first.close()
        await second.close()
    crossing = sampler.crossing
    assert crossing, sampler.summary()
    assert {(w.waiter, w.blockers) for w in crossing} == {("b", ("a",))}
    assert {w.locktype for w in crossing} <= {"transactionid", "tuple"}
