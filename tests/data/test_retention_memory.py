"""Retention on the chat memory stores (SQLite and PostgreSQL), with data at controlled
ages (the stores' clock): exactly what is older than each bound goes, nothing else."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.memory.conftest import FakeClock, drop_postgres_tables
from touba.data import Retention, Stores, apply_retention
from touba.errors import ConfigurationError
from touba.memory._sql import SqlMemoryStore
from touba.memory.sqlite import SqliteMemoryStore
from touba.providers._types import TraceCall

DAY = 86_400.0
T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(
    request: pytest.FixtureRequest, private_dir: Path, clock: FakeClock
) -> AsyncIterator[SqlMemoryStore]:
    if request.param == "sqlite":
        opened: SqlMemoryStore = SqliteMemoryStore(private_dir / "memory.db", clock=clock)
        yield opened
        await opened.close()
        return
    import uuid

    from tests._services import postgres_dsn
    from touba.memory.postgres import PostgresMemoryStore

    dsn, prefix = postgres_dsn(), f"tr_{uuid.uuid4().hex[:10]}"
    opened = PostgresMemoryStore(dsn, prefix=prefix, clock=clock)
    try:
        yield opened
    finally:
        await opened.close()
        drop_postgres_tables(dsn, prefix)


CALL = TraceCall("c1", "lookup", {"order": "MARK-D4"}, "ok", {"found": "MARK-R"}, None)


async def _turn(store: SqlMemoryStore, session: str, text: str) -> None:
    await store.append_turn(
        session,
        user=text,
        replies=[f"re {text}"],
        trace=[[CALL]],
        invocation_id=f"inv-{text}",
        context={"prompt_bytes": 10},
    )


async def _closed_event(store: SqlMemoryStore, owner: str, title: str) -> str:
    event = await store.create_event(
        owner=owner, type="refund", title=title, details="d", session_id="s"
    )
    await store.update_event(owner, event.id, {"status": "in_progress"}, session_id="s")
    await store.update_event(owner, event.id, {"status": "closed"}, session_id="s")
    return event.id


async def _finished_job(store: SqlMemoryStore, session: str, ok: bool) -> str:
    job, _ = await store.enqueue_job(
        session_id=session, owner="user:u1", agent_ref="a", transcript_ref="t", max_attempts=1
    )
    claimed = await store.claim_job("w", 60, job_id=job.id)
    assert claimed is not None
    assert claimed.lease_token is not None
    if ok:
        await store.complete_job(job.id, claimed.lease_token, {"created": []})
    else:
        await store.fail_job(job.id, claimed.lease_token, "boom", None)
    return job.id


async def _fill(store: SqlMemoryStore, clock: FakeClock) -> dict[str, str]:
    """Old data at T0, new data ten days later; the clock ends at T0 + 10 days."""
    assert clock.now == T0
    ids: dict[str, str] = {}
    # old: an ended session (2 turns), an open session with one old turn, a preview one
    await store.open_session("ended-old", owner="user:u1", agent_ref="a", mode="live")
    await _turn(store, "ended-old", "o1")
    await _turn(store, "ended-old", "o2")
    await store.open_session("open", owner="user:u1", agent_ref="a", mode="live")
    await _turn(store, "open", "o3")
    await store.open_session("never-turned", owner="user:u2", agent_ref="a", mode="preview")
    ids["old_closed"] = await _closed_event(store, "user:u1", "old closed")
    ids["old_open"] = (
        await store.create_event(
            owner="user:u1", type="refund", title="old open", details="", session_id="s"
        )
    ).id
    ids["old_done_job"] = await _finished_job(store, "ended-old", ok=True)
    ids["old_failed_job"] = await _finished_job(store, "open", ok=False)
    ids["old_pending_job"] = (
        await store.enqueue_job(
            session_id="never-turned",
            owner="user:u2",
            agent_ref="a",
            transcript_ref="t",
            max_attempts=3,
        )
    )[0].id
    clock.advance(3600)
    await store.end_session("ended-old")
    await store.end_session("never-turned")
    # new, ten days later
    clock.advance(10 * DAY - 3600)
    await _turn(store, "open", "n1")
    await store.open_session("ended-new", owner="user:u1", agent_ref="a", mode="live")
    await _turn(store, "ended-new", "n2")
    await store.end_session("ended-new")
    ids["new_closed"] = await _closed_event(store, "user:u2", "new closed")
    ids["new_done_job"] = await _finished_job(store, "ended-new", ok=True)
    return ids


async def _texts(store: SqlMemoryStore, session: str) -> list[str]:
    return [t.user for t in await store.recent_turns(session, 100)]


async def test_turns_days_removes_old_turns_emptied_ended_sessions_and_finished_jobs(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    ids = await _fill(store, clock)
    now = T0 + timedelta(days=15)
    report = await apply_retention(Stores(memory=store), Retention(turns_days=10), now=now)
    # cutoff T0 + 5 days: the T0 turns, the sessions ended at T0 + 1 h with no turn left,
    # the jobs finished at T0
    assert report.counts == {"memory": {"turns": 3, "sessions": 2, "extraction_jobs": 2}}
    assert report.total == 7
    assert report.at == now
    assert not report.dry_run
    assert await store.get_session("ended-old") is None
    assert await store.get_session("never-turned") is None
    kept = await store.get_session("open")  # open: kept, with its new turn; numbering goes on
    assert kept is not None
    assert kept.turns == 2
    assert await _texts(store, "open") == ["n1"]
    assert await _texts(store, "ended-new") == ["n2"]
    assert await store.get_job(ids["old_done_job"]) is None
    assert await store.get_job(ids["old_failed_job"]) is None
    pending = await store.get_job(ids["old_pending_job"])
    assert pending is not None
    assert pending.status == "pending"
    assert await store.get_job(ids["new_done_job"]) is not None
    # another kind untouched: every key event and its history
    old_closed = await store.get_event("user:u1", ids["old_closed"])
    assert old_closed is not None
    assert old_closed.history is not None
    assert len(old_closed.history) == 2
    # the session goes on numbering after its expired turns
    await _turn(store, "open", "n3")
    turns = await store.recent_turns("open", 10)
    assert [(t.index, t.user) for t in turns] == [(1, "n1"), (2, "n3")]


async def test_the_bound_is_strict_to_the_microsecond(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
    await _turn(store, "s", "at-cutoff")
    clock.advance(1e-6)
    await _turn(store, "s", "after")
    exactly = T0 + timedelta(days=2)  # cutoff == the first turn's time: it stays
    report = await apply_retention(Stores(memory=store), Retention(turns_days=2), now=exactly)
    assert report.counts["memory"]["turns"] == 0
    later = exactly + timedelta(microseconds=1)  # now only the first is older
    report = await apply_retention(Stores(memory=store), Retention(turns_days=2), now=later)
    assert report.counts["memory"]["turns"] == 1
    assert await _texts(store, "s") == ["after"]


async def test_events_closed_days_removes_closed_events_and_their_history_only(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    ids = await _fill(store, clock)
    # an old event closed long ago but edited recently: its last change counts
    edited = await _closed_event(store, "user:u1", "closed, edited later")
    before = [len(await store.recent_turns(s, 100)) for s in ("ended-old", "open", "ended-new")]
    now = T0 + timedelta(days=15)
    report = await apply_retention(Stores(memory=store), Retention(events_closed_days=10), now=now)
    assert report.counts == {"memory": {"key_events": 1, "key_event_updates": 2}}
    assert await store.get_event("user:u1", ids["old_closed"]) is None
    for owner, key in (("user:u1", "old_open"), ("user:u2", "new_closed")):
        assert await store.get_event(owner, ids[key]) is not None
    assert await store.get_event("user:u1", edited) is not None
    # the open event stays however old; turns untouched
    assert [len(await store.recent_turns(s, 100)) for s in ("ended-old", "open", "ended-new")] == (
        before
    )
    # an event reopened is not closed any more: it stays even when old
    reopened = await _closed_event(store, "user:u3", "reopened")
    await store.update_event("user:u3", reopened, {"status": "open"}, session_id="s")
    far = clock.now + timedelta(days=100)
    report = await apply_retention(Stores(memory=store), Retention(events_closed_days=1), now=far)
    assert await store.get_event("user:u3", reopened) is not None
    assert report.counts["memory"]["key_events"] == 2  # new_closed and edited
    assert await store.count_all_events(include_closed=True) == 2  # old open + reopened


async def test_traces_days_drops_trace_and_context_and_keeps_the_text(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    await _fill(store, clock)
    now = T0 + timedelta(days=15)
    report = await apply_retention(Stores(memory=store), Retention(traces_days=10), now=now)
    assert report.counts == {"memory": {"traces": 3}}
    old = await store.recent_turns("ended-old", 10)
    assert [(t.user, t.replies, t.trace, t.context) for t in old] == [
        ("o1", ("re o1",), (), None),
        ("o2", ("re o2",), (), None),
    ]
    (new,) = await store.recent_turns("ended-new", 10)
    assert new.trace == ((CALL,),)
    assert new.context == {"prompt_bytes": 10}
    # a second application finds nothing left to drop
    again = await apply_retention(Stores(memory=store), Retention(traces_days=10), now=now)
    assert again.counts == {"memory": {"traces": 0}}


async def test_defaults_change_nothing_and_dry_run_deletes_nothing(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    ids = await _fill(store, clock)
    far = T0 + timedelta(days=3650)

    async def snapshot() -> Any:
        sessions = await store.list_sessions(limit=100)
        turns = {s.session_id: await store.recent_turns(s.session_id, 100) for s in sessions}
        events = {k: await store.get_event(o, ids[k]) for k, o in _OWNERS.items()}
        jobs = await store.list_jobs(limit=100)
        return sessions, turns, events, jobs

    before = await snapshot()
    nothing = await apply_retention(Stores(memory=store), Retention(), now=far)
    assert nothing.counts == {}
    assert nothing.total == 0
    every = Retention(turns_days=10, events_closed_days=10, traces_days=5)
    now = T0 + timedelta(days=15, hours=1)
    dry = await apply_retention(Stores(memory=store), every, now=now, dry_run=True)
    assert dry.dry_run
    assert await snapshot() == before
    real = await apply_retention(Stores(memory=store), every, now=now)
    assert real.counts == dry.counts
    # traces: the new turns (T0 + 10 days) are older than 5 days; old turns went whole
    assert dict(real.counts["memory"]) == {
        "turns": 3,
        "sessions": 2,
        "extraction_jobs": 2,
        "key_events": 1,
        "key_event_updates": 2,
        "traces": 2,
    }


_OWNERS = {"old_closed": "user:u1", "old_open": "user:u1", "new_closed": "user:u2"}


async def test_a_big_purge_runs_in_batches_and_finishes(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    for s in range(3):
        await store.open_session(f"s{s}", owner="user:u", agent_ref="a", mode="live")
        for i in range(7):
            await _turn(store, f"s{s}", f"t{i}")
        await store.end_session(f"s{s}")
    for i in range(5):
        await _closed_event(store, "user:u", f"e{i}")
    clock.advance(DAY)
    await store.open_session("young", owner="user:u", agent_ref="a", mode="live")
    await _turn(store, "young", "y")
    counts = await store.purge_before(
        turns=T0 + timedelta(hours=1),
        events_closed=T0 + timedelta(hours=1),
        traces=T0 + timedelta(days=2),
        batch_size=2,
    )
    assert counts == {
        "turns": 21,
        "sessions": 3,
        "extraction_jobs": 0,
        "key_events": 5,
        "key_event_updates": 10,
        "traces": 1,
    }
    assert [s.session_id for s in await store.list_sessions()] == ["young"]


async def test_bad_arguments_are_refused_and_nothing_is_deleted(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
    await _turn(store, "s", "t")
    naive = datetime(2030, 1, 1)
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        await store.purge_before(turns=naive)
    with pytest.raises(ConfigurationError, match="batch_size"):
        await store.purge_before(turns=T0 + timedelta(days=1), batch_size=0)
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        await apply_retention(Stores(memory=store), Retention(turns_days=1), now=naive)
    with pytest.raises(ConfigurationError, match="Stores"):
        await apply_retention(store, Retention(turns_days=1))  # type: ignore[arg-type]
    assert await _texts(store, "s") == ["t"]


async def test_the_default_now_is_the_memory_store_clock(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
    await _turn(store, "s", "t")
    clock.advance(2 * DAY)
    report = await apply_retention(Stores(memory=store), Retention(turns_days=1))
    assert report.at == clock.now
    assert report.counts["memory"]["turns"] == 1


class _PlainStore:
    """A memory store of a user's, without the retention primitive."""

    def now(self) -> datetime:
        return T0


async def test_a_store_without_purge_before_is_refused_before_anything_goes(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    from touba.runtime import MemoryCheckpointStore

    await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
    await _turn(store, "s", "t")
    plain: Any = _PlainStore()
    with pytest.raises(ConfigurationError, match="purge_before"):
        await apply_retention(Stores(memory=plain), Retention(turns_days=1))
    # the memory store is fine, the checkpoint store is not: nothing is deleted
    with pytest.raises(ConfigurationError, match="purge_before"):
        await apply_retention(
            Stores(memory=store, checkpoints=plain),
            Retention(turns_days=1, checkpoints_days=1),
            now=T0 + timedelta(days=5),
        )
    assert await _texts(store, "s") == ["t"]
    # a checkpoint store without the bound set is not asked anything
    report = await apply_retention(
        Stores(memory=store, checkpoints=MemoryCheckpointStore()),
        Retention(turns_days=1),
        now=T0 + timedelta(days=5),
    )
    assert report.counts == {"memory": {"turns": 1, "sessions": 0, "extraction_jobs": 0}}


# -- SQLite: the schema version 4 indexes, and the migration from version 3 ----------------

_V4_INDEXES = {
    "touba_memory_turns_created",
    "touba_memory_turns_traced",
    "touba_memory_sessions_ended",
    "touba_memory_events_closed",
}


def _indexes(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
    return {name for (name,) in rows}


async def test_a_version_3_sqlite_file_gets_the_retention_indexes(
    private_dir: Path, clock: FakeClock
) -> None:
    path = private_dir / "memory.db"
    async with SqliteMemoryStore(path, clock=clock) as store:
        await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
        await _turn(store, "s", "t")
    assert _indexes(path) >= _V4_INDEXES
    with sqlite3.connect(path) as conn:
        for name in _V4_INDEXES:
            conn.execute(f"DROP INDEX {name}")
        conn.execute("UPDATE touba_meta SET value = '3' WHERE name = 'memory_schema_version'")
    assert not _V4_INDEXES & _indexes(path)
    async with SqliteMemoryStore(path, clock=clock) as store:
        assert await _texts(store, "s") == ["t"]
    assert _indexes(path) >= _V4_INDEXES
    with sqlite3.connect(path) as conn:
        version = conn.execute(
            "SELECT value FROM touba_meta WHERE name = 'memory_schema_version'"
        ).fetchone()
    assert version == ("4",)


@pytest.mark.parametrize(
    ("statement", "index"),
    [
        ("delete_old_turns", "touba_memory_turns_created"),
        ("drop_traces", "touba_memory_turns_traced"),
        ("delete_closed_events", "touba_memory_events_closed"),
        ("delete_empty_sessions", "touba_memory_sessions_ended"),
        ("delete_finished_jobs", "touba_memory_jobs_"),  # _due (by status) or _updated
    ],
)
async def test_each_sqlite_purge_reads_through_its_index(
    private_dir: Path, clock: FakeClock, statement: str, index: str
) -> None:
    from touba.memory.sqlite import _SQL

    path = private_dir / "memory.db"
    async with SqliteMemoryStore(path, clock=clock):
        pass
    with sqlite3.connect(path) as conn:
        plan = conn.execute(f"EXPLAIN QUERY PLAN {_SQL[statement]}", (0, 0, 10)).fetchall()
    assert any(index in str(row[-1]) for row in plan), plan
    assert not [row for row in plan if str(row[-1]).startswith("SCAN")], plan  # no full scan


@pytest.mark.postgres
async def test_version_3_postgresql_tables_get_the_retention_indexes(clock: FakeClock) -> None:
    import uuid

    import psycopg
    from psycopg import sql

    from tests._services import postgres_dsn
    from touba.memory.postgres import PostgresMemoryStore

    dsn, prefix = postgres_dsn(), f"tr_{uuid.uuid4().hex[:10]}"
    names = [f"{prefix}_{index}_idx" for index in _PG_V4]

    def indexes() -> set[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT indexname FROM pg_indexes WHERE indexname = ANY(%s)", (names,)
            ).fetchall()
        return {name for (name,) in rows}

    try:
        async with PostgresMemoryStore(dsn, prefix=prefix, clock=clock) as store:
            await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
            await _turn(store, "s", "t")
        assert indexes() == set(names)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
            meta = sql.Identifier(f"{prefix}_meta")
            conn.execute(sql.SQL("UPDATE {} SET value = '3'").format(meta))
        assert indexes() == set()
        async with PostgresMemoryStore(dsn, prefix=prefix, clock=clock) as store:
            assert await _texts(store, "s") == ["t"]
            report = await store.purge_before(turns=clock.now + timedelta(seconds=1))
            assert report["turns"] == 1
        assert indexes() == set(names)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(sql.SQL("SELECT value FROM {}").format(meta)).fetchone()
        assert row == ("4",)
    finally:
        drop_postgres_tables(dsn, prefix)


_PG_V4 = ("turns_created", "turns_traced", "sessions_ended", "events_closed")


def _file_bytes(path: Path) -> bytes:
    found = b""
    for suffix in ("", "-wal", "-journal"):
        part = Path(f"{path}{suffix}")
        if part.exists():
            found += part.read_bytes()
    return found


async def test_sqlite_purges_leave_no_copy_of_what_went_in_the_files(
    private_dir: Path, clock: FakeClock
) -> None:
    from touba.runtime import SqliteCheckpointStore

    memory_path, checkpoints_path = private_dir / "memory.db", private_dir / "checkpoints.db"
    async with SqliteMemoryStore(memory_path, clock=clock) as store:
        await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
        await store.append_turn("s", user="MARK-OLD-TURN", replies=["MARK-OLD-REPLY"])
        await _closed_event(store, "user:u", "MARK-OLD-EVENT")
        clock.advance(10 * DAY)
        await store.append_turn("s", user="young words", replies=["r"])
        counts = await store.purge_before(
            turns=clock.now - timedelta(days=1), events_closed=clock.now - timedelta(days=1)
        )
        assert counts["turns"] == 1
        assert counts["key_events"] == 1
        assert await _texts(store, "s") == ["young words"]
        # while the store is open too, its file and WAL hold no copy
        raw = _file_bytes(memory_path)
        assert b"young words" in raw
        for marker in (b"MARK-OLD-TURN", b"MARK-OLD-REPLY", b"MARK-OLD-EVENT"):
            assert marker not in raw
    async with SqliteCheckpointStore(checkpoints_path) as checkpoints:
        await checkpoints.save("old", {"input": "MARK-OLD-CHECKPOINT"})
        later = datetime.now(UTC) + timedelta(seconds=1)
        assert await checkpoints.purge_before(later) == 1
        assert b"MARK-OLD-CHECKPOINT" not in _file_bytes(checkpoints_path)


@settings(max_examples=25, deadline=None)
@given(
    ages=st.lists(st.integers(0, 400), min_size=1, max_size=12),
    closed=st.lists(st.tuples(st.integers(0, 400), st.booleans()), max_size=6),
    turns_hours=st.one_of(st.none(), st.integers(1, 300)),
    events_hours=st.one_of(st.none(), st.integers(1, 300)),
    traces_hours=st.one_of(st.none(), st.integers(1, 300)),
)
def test_exactly_what_is_older_than_each_bound_goes(
    ages: list[int],
    closed: list[tuple[int, bool]],
    turns_hours: int | None,
    events_hours: int | None,
    traces_hours: int | None,
) -> None:
    """Turns and events written at random ages (hours before now); each bound removes
    exactly the records older than it, of its own kind."""
    import tempfile

    now = T0 + timedelta(hours=400)
    retention = Retention(
        turns_days=None if turns_hours is None else turns_hours / 24,
        events_closed_days=None if events_hours is None else events_hours / 24,
        traces_days=None if traces_hours is None else traces_hours / 24,
    )

    def older(age: int, hours: int | None) -> bool:
        return hours is not None and now - timedelta(hours=age) < now - timedelta(hours=hours)

    async def scenario(path: Path) -> None:
        clock = FakeClock()
        async with SqliteMemoryStore(path, clock=clock) as store:
            await store.open_session("s", owner="user:u", agent_ref="a", mode="live")
            # oldest first: the store numbers turns in the order they come
            for age in sorted(ages, reverse=True):
                clock.now = now - timedelta(hours=age)
                await _turn(store, "s", f"t{age}")
            events = {}
            for i, (age, is_closed) in enumerate(closed):
                clock.now = now - timedelta(hours=age)
                event = await store.create_event(
                    owner="user:u", type="t", title=f"e{i}", details="", session_id="s"
                )
                if is_closed:
                    await store.update_event(
                        "user:u", event.id, {"status": "closed"}, session_id="s"
                    )
                events[event.id] = (age, is_closed)
            report = await apply_retention(Stores(memory=store), retention, now=now)
            turns = await store.recent_turns("s", 100)
            kept = sorted((a for a in ages if not older(a, turns_hours)), reverse=True)
            assert [t.user for t in turns] == [f"t{a}" for a in kept]
            for turn in turns:
                stripped = older(int(turn.user[1:]), traces_hours)
                assert (turn.trace == ()) is stripped
                assert (turn.context is None) is stripped
            for event_id, (age, is_closed) in events.items():
                gone = is_closed and older(age, events_hours)
                assert (await store.get_event("user:u", event_id) is None) is gone
            memory = report.counts.get("memory", {})
            if turns_hours is not None:
                assert memory["turns"] == len(ages) - len(kept)
            if events_hours is not None:
                assert memory["key_events"] == sum(
                    c and older(a, events_hours) for a, c in events.values()
                )

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        asyncio.run(scenario(Path(tmp) / "memory.db"))
