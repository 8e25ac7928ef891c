"""The SQLite store's cached tails, its schema 2 and its usage row, on real files.

A store object keeps the parsed tail of each conversation it decided
(:mod:`touba.history._tail_cache`), checked at every reservation against the
version the file stores, which every save by any store object or process
changes. These tests share files between store objects and processes, delete
and re-create conversations behind a cached tail, damage rows, migrate a
version-1 file, and compare the usage row with a count over the sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._sqlite import raw
from tests.history._clock import Clock
from tests.history._stores import WHO
from touba.errors import (
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history import (
    CapabilityCall,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
    ResultMessage,
)
from touba.history._backend import Reserved
from touba.history._common import iso
from touba.history._reservations import HINT_MEMORY, Recent
from touba.history._store import LogSnapshot, LogWrite, StoreUsage
from touba.history._tail_cache import TailCache
from touba.history.sqlite import PURGE_INTERVAL, SqliteHistoryStore


@pytest.fixture
def db_path(private_dir: Path) -> Path:
    return private_dir / "history.sqlite"


class Agent:
    """Decisions on one conversation through one store; each window's texts recorded."""

    def __init__(self, store: SqliteHistoryStore, *, max_messages: int = 8) -> None:
        config = HistoryConfig(store=store, namespace="n", max_messages=max_messages)
        self.history = DecisionHistory(config)
        self.windows: list[list[str | None]] = []

    async def decide(self, text: str, observations: list[Observation]) -> list[Observation]:
        """One decision answering ``observations``; returns the observations of its call."""

        async def generate(window: HistoryWindow) -> DecisionMessage:
            texts = [m.text for m in window.messages if isinstance(m, DecisionMessage)]
            self.windows.append(texts)
            return DecisionMessage(text=text, calls=(CapabilityCall(f"c-{text}", "f", {}),))

        await self.history.step(WHO, observations, generate)
        return [Observation(f"c-{text}", "f", {}, "ok", {"r": text})]


def spy_reserve(store: SqliteHistoryStore) -> list[Reserved]:
    """Record what each reservation of ``store`` read (the real primitive runs)."""
    seen: list[Reserved] = []
    original = store._db.reserve

    def reserve(*args: Any) -> Reserved:
        reserved = original(*args)
        seen.append(reserved)
        return reserved

    store._db.reserve = reserve  # type: ignore[method-assign,assignment]
    return seen


def stored_version(path: Path, key: str) -> str | None:
    with raw(path) as conn:
        row = conn.execute(
            "SELECT version FROM touba_history_sessions WHERE key = ?", (key,)
        ).fetchone()
    return None if row is None else row[0]


# -- hits and misses --------------------------------------------------------------------


async def test_a_cached_tail_is_used_while_nothing_else_saved(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        agent = Agent(store)
        seen = spy_reserve(store)
        observations: list[Observation] = []
        for step in range(6):
            observations = await agent.decide(f"d{step}", observations)
        # Once the store knows how far back a decision reads, reservations read no rows.
        assert [r.rows is None for r in seen[2:]] == [True] * 4
        tail = store._reservations.cache.peek(WHO.key)
        assert tail is not None
        assert tail.version == stored_version(db_path, WHO.key)
        assert agent.windows[-1] == ["d1", "d2", "d3", "d4"]


async def test_a_session_pop_keeps_the_cached_tail(db_path: Path) -> None:
    """``pop_item`` (a drop) leaves the tail cached without the popped item: the
    next operations read no rows, and see what a fresh read sees."""
    from touba.integrations.openai_agents import ToubaSession

    def item(n: int) -> Any:
        return {"role": "user", "content": f"q{n}"}

    async with SqliteHistoryStore(db_path) as store:
        session = ToubaSession("s", store=store, namespace="ns")
        await session.add_items([item(n) for n in range(40)])
        assert len(await session.get_items(limit=20)) == 20  # the hints: 20 exchanges
        seen = spy_reserve(store)
        for n in range(40, 45):
            await session.add_items([item(n)])
            last = [item(k) for k in range(21, 40)] + [item(n)]  # n pushes 20 out, 40.. popped
            assert await session.get_items(limit=20) == last
            assert await session.pop_item() == item(n)
        assert [r.rows is None for r in seen] == [True] * len(seen)
        async with SqliteHistoryStore(db_path) as fresh:  # nothing cached: read from the file
            again = ToubaSession("s", store=fresh, namespace="ns")
            assert await again.get_items(limit=20) == await session.get_items(limit=20)


async def test_a_save_by_another_store_object_is_read_not_served_stale(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        a, b = Agent(one), Agent(two)
        seen = spy_reserve(two)
        observations = await b.decide("b0", [])
        observations = await b.decide("b1", observations)
        observations = await b.decide("b2", observations)
        cached = two._reservations.cache.peek(WHO.key)
        assert cached is not None
        old_version = cached.version
        observations = await a.decide("a3", observations)  # `two`'s tail is now stale
        assert stored_version(db_path, WHO.key) != old_version
        seen.clear()
        await b.decide("b4", observations)
        assert seen[0].rows is not None  # the version differed: the rows were read
        assert b.windows[-1] == ["b0", "b1", "b2", "a3"]
        assert a.windows[-1] == ["b0", "b1", "b2"]


CHILD = """
import asyncio, sys
from touba.history import (CapabilityCall, ConversationIdentity, DecisionHistory,
    DecisionMessage, HistoryConfig, Observation)
from touba.history.sqlite import SqliteHistoryStore

async def main(path, text, call_id):
    who = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")
    async with SqliteHistoryStore(path) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=8))

        async def generate(window):
            return DecisionMessage(text=text, calls=(CapabilityCall(f"c-{text}", "f", {}),))

        answer = [Observation(call_id, "f", {}, "ok", {"r": call_id})]
        await history.step(who, answer, generate)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_save_by_another_process_is_read_not_served_stale(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        agent = Agent(store)
        observations = await agent.decide("p0", [])
        observations = await agent.decide("p1", observations)
        cached = store._reservations.cache.peek(WHO.key)
        assert cached is not None
        assert cached.count == 2
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, str(db_path), "child2", "c-p1"
        )
        assert await asyncio.wait_for(child.wait(), timeout=60) == 0
        seen = spy_reserve(store)
        await agent.decide("p3", [Observation("c-child2", "f", {}, "ok", {"r": 2})])
        assert seen[0].rows is not None
        assert agent.windows[-1] == ["p0", "p1", "child2"]
        record = await store.read(WHO.key)
        assert record is not None
        assert [ex[0]["text"] for ex in record["exchanges"]] == ["p0", "p1", "child2", "p3"]


async def test_delete_and_recreate_with_a_same_length_history_is_never_stale(
    db_path: Path,
) -> None:
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        first, second = Agent(one), Agent(two)
        observations: list[Observation] = []
        for step in range(4):
            observations = await first.decide(f"old{step}", observations)
        assert one._reservations.cache.peek(WHO.key) is not None
        assert await two.delete(WHO.key) is True
        again: list[Observation] = []
        for step in range(4):  # as many exchanges, messages and bytes as before
            again = await second.decide(f"new{step}", again)
        [row] = await two.list()
        assert row.messages == 7
        await first.decide("next", again)
        assert first.windows[-1] == ["new0", "new1", "new2", "new3"]
        record = await one.read(WHO.key)
        assert record is not None
        assert [ex[0]["text"] for ex in record["exchanges"]] == [
            "new0",
            "new1",
            "new2",
            "new3",
            "next",
        ]


async def test_a_row_edited_behind_the_store_clears_the_version(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path) as store:
        agent = Agent(store)
        observations = await agent.decide("e0", [])
        observations = await agent.decide("e1", observations)
        assert stored_version(db_path, WHO.key) is not None
        with raw(db_path) as conn:
            conn.execute(
                "UPDATE touba_history_messages SET body = replace(body, '\"e0\"', '\"x0\"') "
                "WHERE exchange = 0"
            )
        assert stored_version(db_path, WHO.key) is None
        await agent.decide("e2", observations)
        assert agent.windows[-1] == ["x0", "e1"]  # read again, not served from the cache


async def test_a_row_edited_while_a_decision_runs_is_seen_by_the_next_one(
    db_path: Path,
) -> None:
    """An edit made during the model call (the reservation held) must not be
    hidden by the save that ends it."""
    async with SqliteHistoryStore(db_path) as store:
        agent = Agent(store)
        observations = await agent.decide("e0", [])
        observations = await agent.decide("e1", observations)
        history = agent.history

        async def generate(window: HistoryWindow) -> DecisionMessage:
            with raw(db_path) as conn:
                conn.execute(
                    "UPDATE touba_history_messages SET body = replace(body, '\"e0\"', '\"x0\"') "
                    "WHERE exchange = 0"
                )
            return DecisionMessage(text="e2", calls=(CapabilityCall("c-e2", "f", {}),))

        await history.step(WHO, observations, generate)
        assert stored_version(db_path, WHO.key) is None  # the edit still shows
        await agent.decide("e3", [Observation("c-e2", "f", {}, "ok", {"r": "e2"})])
        assert agent.windows[-1] == ["x0", "e1", "e2"]  # read again, not served from the cache


def commit_levels(statements: list[str]) -> list[str]:
    """The synchronous level each COMMIT of a traced connection ran under."""
    level, seen = "FULL", []
    for statement in statements:
        if statement.startswith("PRAGMA synchronous="):
            level = statement.split("=", 1)[1]
        elif statement == "COMMIT":
            seen.append(level)
    return seen


async def test_only_the_reservation_commits_without_waiting_for_the_disk(db_path: Path) -> None:
    """synchronous=NORMAL around the reservation's transaction alone; every
    other commit (the save, a refused reservation's aftermath) is FULL."""
    async with SqliteHistoryStore(db_path) as store:
        agent = Agent(store)
        observations = await agent.decide("s0", [])
        statements: list[str] = []
        await store._run(WHO.key, lambda: store._db.conn.set_trace_callback(statements.append))
        observations = await agent.decide("s1", observations)
        await store._run(WHO.key, lambda: store._db.conn.set_trace_callback(None))

        assert commit_levels(statements) == ["NORMAL", "FULL"]  # the reservation, then the save
        assert statements[-1] != "PRAGMA synchronous=NORMAL"

        def level() -> int:
            return int(store._db.conn.execute("PRAGMA synchronous").fetchone()[0])

        assert await store._run(WHO.key, level) == 2  # FULL between decisions
        with raw(db_path) as conn:  # held by someone else: the reservation is refused
            conn.execute("UPDATE touba_history_sessions SET token = 'other'")
        with pytest.raises(DecisionHistoryBusy):
            await agent.decide("s2", observations)
        assert await store._run(WHO.key, level) == 2


async def test_a_session_read_renews_without_waiting_for_the_disk_its_writes_wait(
    db_path: Path,
) -> None:
    """ToubaSession's optimistic read saves its head unchanged (reading is activity:
    the expiry moves) with synchronous=NORMAL; an append, a pop and every other
    commit stay FULL."""
    pytest.importorskip("agents")
    from touba.integrations.openai_agents import ToubaSession

    now = [1000.0]
    async with SqliteHistoryStore(db_path, ttl_seconds=60, clock=lambda: now[0]) as store:
        session = ToubaSession("s1", store=store, namespace="ns")
        await session.add_items([{"role": "user", "content": "hello"}])
        await session.get_items()  # the tail is cached: the next operations are optimistic
        statements: list[str] = []
        await store._run("", lambda: store._db.conn.set_trace_callback(statements.append))

        async def commits(operation: Any) -> list[str]:
            statements.clear()
            await operation
            return commit_levels(statements)

        now[0] += 30
        assert await commits(session.get_items()) == ["NORMAL"]
        (listed,) = await store.list()
        assert listed.expires_at == iso(1030.0 + 60)  # renewed by the read
        assert await commits(session.add_items([{"role": "user", "content": "again"}])) == ["FULL"]
        assert await commits(session.pop_item()) == ["FULL"]  # optimistic too: it drops a row

        async def retitle(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            assert snapshot is not None
            return LogWrite(head={**snapshot.head, "n": 99}), None

        await _append(store, "other", [{"m": 1}])
        await store.transact_log_optimistic("other", retitle)  # cached from here on
        assert await commits(store.transact_log_optimistic("other", retitle)) == ["NORMAL"]

        async def renamed(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, None]:
            assert snapshot is not None
            return LogWrite(head={**snapshot.head, "n": 100}), None

        # a new head, even with no message: a real write
        assert await commits(store.transact_log_optimistic("other", renamed)) == ["FULL"]
        await store._run("", lambda: store._db.conn.set_trace_callback(None))
        assert await session.get_items() == [{"role": "user", "content": "hello"}]


# -- what the cache holds -----------------------------------------------------------------


async def _append(store: SqliteHistoryStore, key: str, messages: list[dict[str, Any]]) -> None:
    head = {"kind": "touba.test", "n": len(messages)}

    async def operation(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, None]:
        count = 0 if snapshot is None else snapshot.exchange_count
        return LogWrite(head=head, append=[(count, m) for m in messages]), None

    await store.transact_log(key, operation)


async def test_cached_messages_are_read_only_and_equal_a_fresh_read(db_path: Path) -> None:
    call = {
        "kind": "decision",
        "text": "t",
        "calls": [{"call_id": "c", "name": "f", "arguments": {"a": [1]}}],
    }
    result = {
        "kind": "result",
        "call_id": "c",
        "name": "f",
        "arguments": {"a": [1]},
        "status": "ok",
        "result": {"v": [1, {"w": 2}]},
    }
    async with SqliteHistoryStore(db_path) as store, SqliteHistoryStore(db_path) as fresh:
        for _ in range(3):
            await _append(store, "k", [call, result])
        seen: dict[str, Any] = {}

        async def look(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, None]:
            assert snapshot is not None
            await snapshot.sizes(0)
            seen["messages"] = await snapshot.messages(0, 3)  # type: ignore[attr-defined]
            seen["exchanges"] = await snapshot.exchanges(0, 3)
            return None, None

        await store.transact_log("k", look)  # the tail read ahead, now cached
        await store.transact_log("k", look)  # served from the cache
        cached, copies = seen["messages"], seen["exchanges"]
        decision, answer = cached[2]
        assert isinstance(decision, DecisionMessage)
        assert isinstance(answer, ResultMessage)
        with pytest.raises(TypeError):
            answer.result["v"].append(3)
        with pytest.raises(TypeError):
            answer.result["v"][1]["w"] = 3
        with pytest.raises(TypeError):
            decision.calls[0].arguments["a"] = 2  # type: ignore[index]
        assert isinstance(cached[0], tuple)  # an exchange is read-only too
        cached.append(cached[0])  # the list itself is the caller's
        copies[0][1]["result"]["v"].append("mine")  # exchanges() gives private copies

        await fresh.transact_log("k", look)  # another store object: read from the file
        assert seen["messages"] == [(decision, answer)] * 3
        assert seen["exchanges"] == [[call, result]] * 3
        assert await store.read("k") == {
            "kind": "touba.test",
            "n": 2,
            "exchanges": [[call, result]] * 3,
        }


async def test_a_record_saved_whole_leaves_its_tail_cached(db_path: Path) -> None:
    exchanges = [[{"kind": "data", "observations": [], "n": n}] for n in range(6)]
    record = {"kind": "touba.test", "exchanges": exchanges}
    async with SqliteHistoryStore(db_path) as store, SqliteHistoryStore(db_path) as fresh:
        await _append(store, "warm", [{"m": 0}])
        seen: list[Any] = []

        async def look(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, None]:
            assert snapshot is not None
            seen.append((await snapshot.sizes(3), await snapshot.exchanges(3, 6)))
            return None, None

        await store.transact_log("warm", look)  # the store now reads 3 exchanges back

        async def put(_: Any) -> tuple[Any, None]:
            return record, None

        await store.transact("k", put)
        spied = spy_reserve(store)
        await store.transact_log("k", look)
        assert spied[0].rows is None  # served from what transact saved
        await fresh.transact_log("k", look)  # read from the file
        assert seen[-1] == seen[-2]
        assert seen[-1][1] == exchanges[3:]


async def test_the_cache_bound_holds(db_path: Path) -> None:
    message = {"kind": "data", "observations": [], "pad": "x" * 200}
    async with SqliteHistoryStore(db_path, max_sessions=64) as store:
        cache = TailCache(conversations=3, max_bytes=5_000)
        store._reservations.cache = cache

        async def read_all(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[None, None]:
            assert snapshot is not None
            await snapshot.exchanges(max(0, snapshot.exchange_count - 4), 2**31)
            return None, None

        for n in range(6):
            key = f"k{n}"
            for _ in range(8):
                await _append(store, key, [message])
            await store.transact_log(key, read_all)
            assert len(cache) <= 3
            assert cache.bytes <= 5_000
        assert [cache.peek(f"k{n}") is None for n in range(6)] == [True] * 3 + [False] * 3
        tail = cache.peek("k5")
        assert tail is not None
        # Only the hinted tail: 4 exchanges read, plus one (see the module docstring).
        assert tail.count - tail.bodies_first == 5
        assert len(tail.records) == 5

        big = {"kind": "data", "observations": [], "pad": "y" * 6_000}
        await _append(store, "huge", [big])
        await store.transact_log("huge", read_all)
        assert cache.peek("huge") is None  # larger than the whole bound: not kept
        assert cache.bytes <= 5_000


async def test_one_wide_read_widens_the_cached_tail_for_a_while_only(db_path: Path) -> None:
    """A look at a whole conversation (a session's ``get_items()``) keeps that much
    in the cache for the next HINT_MEMORY transactions, then the tail is trimmed
    back to what they read."""
    message = {"kind": "data", "observations": [], "pad": "x"}
    async with SqliteHistoryStore(db_path) as store:

        async def read_last(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
            assert snapshot is not None
            count = snapshot.exchange_count
            await snapshot.exchanges(count - 2 if last else 0, count)
            return LogWrite(head=snapshot.head, append=[(count, message)]), None

        for _ in range(50):
            await _append(store, "k", [message])
        last = False
        await store.transact_log("k", read_last)  # every exchange, once
        held: list[int] = []
        last = True
        for _ in range(HINT_MEMORY + 2):
            await store.transact_log("k", read_last)
            tail = store._reservations.cache.peek("k")
            assert tail is not None
            held.append(tail.count - tail.bodies_first)
        assert held[0] > 50  # still wide right after the wide read
        assert held[-1] == 3  # then the 2 exchanges read, plus one (the module docstring)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=60))
def test_a_recent_hint_is_the_most_of_the_last_values(values: list[int]) -> None:
    recent = Recent()
    for n in range(len(values)):
        recent.note(values[n])
        assert recent.most == max(values[max(0, n + 1 - HINT_MEMORY) : n + 1])
    assert recent.most == (max(values[-HINT_MEMORY:]) if values else 0)


async def test_a_failed_or_refused_save_drops_the_tail(db_path: Path) -> None:
    async with SqliteHistoryStore(db_path, max_store_bytes=3_000) as store:
        agent = Agent(store)
        observations = await agent.decide("f0", [])
        assert store._reservations.cache.peek(WHO.key) is not None

        async def boom(window: HistoryWindow) -> DecisionMessage:
            raise RuntimeError("provider down")

        with pytest.raises(RuntimeError, match="provider down"):
            await agent.history.step(WHO, observations, boom)
        assert store._reservations.cache.peek(WHO.key) is None
        observations = await agent.decide("f1", observations)
        assert store._reservations.cache.peek(WHO.key) is not None

        async def huge(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(text="z" * 4_000, final=True)

        with pytest.raises(DecisionHistoryLimitExceeded):
            await agent.history.step(WHO, observations, huge)
        assert store._reservations.cache.peek(WHO.key) is None
        record = await store.read(WHO.key)
        assert record is not None
        assert len(record["exchanges"]) == 2
        await agent.decide("f2", observations)
        assert agent.windows[-1] == ["f0", "f1"]


# -- migration from version 1 ---------------------------------------------------------------

V1_SCHEMA = (
    "CREATE TABLE touba_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE touba_history_sessions (
        key TEXT PRIMARY KEY, head TEXT, split INTEGER NOT NULL DEFAULT 0,
        namespace TEXT, identity TEXT, exchanges INTEGER NOT NULL DEFAULT 0,
        messages INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL DEFAULT 0,
        updated_at REAL, expires_at REAL,
        token TEXT, worker_id TEXT, pid INTEGER, host TEXT, since REAL)""",
    "CREATE INDEX touba_history_sessions_expiry ON touba_history_sessions (expires_at)",
    "CREATE INDEX touba_history_sessions_namespace ON touba_history_sessions (namespace)",
    """CREATE TABLE touba_history_messages (
        id INTEGER PRIMARY KEY, key TEXT NOT NULL, seq INTEGER NOT NULL,
        exchange INTEGER NOT NULL, bytes INTEGER NOT NULL, body TEXT NOT NULL)""",
    "CREATE INDEX touba_history_messages_tail "
    "ON touba_history_messages (key, exchange, seq, bytes)",
    "INSERT INTO touba_meta VALUES ('history_schema_version', '1')",
)


def _compact(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def build_v1(path: Path, records: dict[str, Any], now: float) -> None:
    """A file as touba with schema version 1 leaves it (its DDL, its rows)."""
    with raw(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        for statement in V1_SCHEMA:
            conn.execute(statement)
        for key, (record, holder) in records.items():
            token, worker, pid, host, since = holder or (None, None, None, None, None)
            if record is None:  # a bare reservation of a key without a record
                conn.execute(
                    "INSERT INTO touba_history_sessions (key, token, worker_id, pid, host, since) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (key, token, worker, pid, host, since),
                )
                continue
            exchanges = record.get("exchanges")
            split = isinstance(exchanges, list) and record.get("kind", "").startswith("touba.")
            head = {k: v for k, v in record.items() if k != "exchanges"} if split else record
            head_text = _compact(head)
            rows: list[tuple[str, int, int, int, str]] = []
            if split:
                for index, exchange in enumerate(exchanges):
                    for message in exchange:
                        body = _compact(message)
                        rows.append((key, len(rows), index, len(body.encode()), body))
            size = len(head_text.encode()) + sum(row[3] for row in rows)
            identity = head.get("identity") if split else None
            conn.execute(
                "INSERT INTO touba_history_sessions VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    head_text,
                    int(split),
                    identity["namespace"] if identity else None,
                    _compact(identity) if identity else None,
                    len(exchanges) if split else 0,
                    len(rows),
                    size,
                    now,
                    now + 86400,
                    token,
                    worker,
                    pid,
                    host,
                    since,
                ),
            )
            conn.executemany(
                "INSERT INTO touba_history_messages (key, seq, exchange, bytes, body) "
                "VALUES (?, ?, ?, ?, ?)",
                rows,
            )
    path.chmod(0o600)


async def test_a_version_1_file_is_migrated_in_place(db_path: Path) -> None:
    clock = Clock()
    identity = {"namespace": "ns", "agent": "a"}
    split = {
        "kind": "touba.decision_history",
        "identity": identity,
        "exchanges": [[{"m": n, "pad": "p" * n}, {"r": n}] for n in range(5)],
    }
    other = {"kind": "touba.other", "exchanges": [[{"only": True}]]}
    whole = {"not": "touba", "exchanges": "kept whole"}
    holder = ("tok-1", "worker-9", 4242, "host-x", clock.now - 5)
    bare = ("tok-2", "worker-8", 4343, "host-y", clock.now - 3)
    build_v1(
        db_path,
        {
            "split": (split, None),
            "other": (other, None),
            "whole": (whole, None),
            "held": (split, holder),
            "fresh": (None, bare),
        },
        clock.now,
    )
    async with SqliteHistoryStore(db_path, clock=clock) as store:
        assert await store.read("split") == split
        assert await store.read("other") == other
        assert await store.read("whole") == whole
        listed = {row.key: row for row in await store.list()}
        assert set(listed) == {"split", "other", "whole", "held", "fresh"}
        for key, (worker, pid) in {"held": ("worker-9", 4242), "fresh": ("worker-8", 4343)}.items():
            reservation = listed[key].reservation
            assert listed[key].active
            assert reservation is not None
            assert (reservation["worker_id"], reservation["pid"]) == (worker, pid)
        assert listed["split"].messages == 10
        assert listed["split"].identity == identity
        usage = await store.usage()
        assert usage.sessions == 5
        assert usage.bytes == sum(row.bytes for row in listed.values())
        assert await store.recover("held", worker_stopped=True) is True
        assert await store.read("held") == split
        await _append(store, "split", [{"m": "after"}])  # a log write on a migrated record
        record = await store.read("split")
        assert record is not None
        assert record["exchanges"][-1] == [{"m": "after"}]
    with raw(db_path) as conn:
        assert conn.execute(
            "SELECT value FROM touba_meta WHERE name = 'history_schema_version'"
        ).fetchone() == ("2",)
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        assert tables == {
            "touba_meta",
            "touba_history_sessions",
            "touba_history_messages",
            "touba_history_usage",
        }
        columns = [row[1] for row in conn.execute("PRAGMA table_info(touba_history_messages)")]
        assert "key" not in columns
        assert "conv" in columns
        index = [row[2] for row in conn.execute("PRAGMA index_info(touba_history_messages_tail)")]
        assert index == ["conv", "exchange", "seq", "bytes"]


async def test_two_store_objects_opening_a_version_1_file_migrate_it_once(db_path: Path) -> None:
    record = {"kind": "touba.x", "exchanges": [[{"a": 1}]]}
    build_v1(db_path, {"k": (record, None)}, time.time())
    async with SqliteHistoryStore(db_path) as one, SqliteHistoryStore(db_path) as two:
        assert await one.read("k") == await two.read("k") == record


# -- the usage row --------------------------------------------------------------------------


def counted(path: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    """The usage row and a count over the sessions table."""
    with raw(path) as conn:
        row = conn.execute("SELECT sessions, bytes FROM touba_history_usage").fetchone()
        total = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM touba_history_sessions"
        ).fetchone()
    return (row[0], row[1]), (total[0], total[1])


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["put", "append", "delete", "fail", "hold", "recover", "age", "purge"]),
        st.integers(0, 3),
        st.integers(0, 300),
    ),
    max_size=25,
)


async def _apply(
    store: SqliteHistoryStore, path: Path, clock: Clock, ops: list[tuple[str, int, int]]
) -> None:
    held: list[asyncio.Task[Any]] = []
    release = asyncio.Event()
    for name, n, size in ops:
        key = f"k{n}"
        try:
            if name == "put":
                record = {"kind": "touba.t", "exchanges": [[{"v": "x" * size}]]}

                async def put(_: Any, record: Any = record) -> tuple[Any, None]:
                    return record, None

                await store.transact(key, put)
            elif name == "append":
                await _append(store, key, [{"v": "y" * size}])
            elif name == "delete":
                await store.delete(key)
            elif name == "fail":

                async def fail(*_: Any) -> Any:
                    raise RuntimeError("no")

                with pytest.raises(RuntimeError):
                    await store.transact_log(key, fail)
            elif name == "hold":
                inside = asyncio.Event()

                async def hold(
                    _: Any, inside: asyncio.Event = inside, size: int = size
                ) -> tuple[Any, None]:
                    inside.set()
                    await release.wait()
                    return {"held": size}, None

                task = asyncio.create_task(store.transact(key, hold))
                waiter = asyncio.create_task(inside.wait())
                done, _ = await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if task in done:
                    task.exception()  # refused (busy, full): nothing held
                else:
                    held.append(task)
            elif name == "recover":
                await store.recover(key, worker_stopped=True)
            elif name == "age":
                clock.now += size  # some records expire, to be purged later
            else:
                await store.purge_expired()
        except (DecisionHistoryBusy, DecisionHistoryLimitExceeded, DecisionHistoryRecordInvalid):
            pass
        usage_row, total = counted(path)
        assert usage_row == total, (name, key)
    release.set()
    for task in held:  # recovered meanwhile (its save refused), or full
        with contextlib.suppress(DecisionHistoryBusy, DecisionHistoryLimitExceeded):
            await task


@settings(max_examples=30, deadline=None)
@given(ops=OPERATIONS)
def test_the_usage_row_equals_a_count_after_any_operations(ops: list[tuple[str, int, int]]) -> None:
    async def run(path: Path) -> None:
        clock = Clock()
        async with SqliteHistoryStore(
            path, max_sessions=3, max_store_bytes=2_000, ttl_seconds=100, clock=clock
        ) as store:
            await _apply(store, path, clock, ops)
            usage_row, total = counted(path)
            assert usage_row == total
            await store.purge_expired()
            usage = await store.usage()
            assert (usage.sessions, usage.bytes) == counted(path)[1]

    with tempfile.TemporaryDirectory() as directory:
        Path(directory).chmod(0o700)
        asyncio.run(run(Path(directory) / "h.sqlite"))


# -- purging expired records ---------------------------------------------------------------


def rows(path: Path) -> list[str]:
    with raw(path) as conn:
        return [r[0] for r in conn.execute("SELECT key FROM touba_history_sessions ORDER BY key")]


async def test_expired_records_are_purged_once_a_minute_not_at_every_write(db_path: Path) -> None:
    clock = Clock()
    async with SqliteHistoryStore(db_path, ttl_seconds=100, clock=clock) as store:
        for key in ("a", "b"):
            await _append(store, key, [{"v": key}])
        clock.now += 99
        await _append(store, "c", [{"v": "c"}])  # a minute passed: purged (nothing expired)
        clock.now += 2  # "a" and "b" expired
        await _append(store, "c", [{"v": "c2"}])
        await _append(store, "d", [{"v": "d"}])
        assert rows(db_path) == ["a", "b", "c", "d"]  # not purged at every write
        assert await store.read("a") is None  # but expired for every reader
        clock.now += PURGE_INTERVAL
        await _append(store, "c", [{"v": "c3"}])
        assert rows(db_path) == ["c", "d"]  # a minute after the last purge, the next write purged


async def test_expired_records_never_refuse_a_write(db_path: Path) -> None:
    clock = Clock()
    async with SqliteHistoryStore(
        db_path, ttl_seconds=10, max_sessions=2, max_store_bytes=1_000, clock=clock
    ) as store:
        await _append(store, "a", [{"v": "x" * 300}])
        await _append(store, "b", [{"v": "x" * 300}])
        clock.now += 11
        await _append(store, "c", [{"v": "y" * 600}])  # a full store, all of it expired
        assert rows(db_path) == ["c"]
        usage = await store.usage()
        assert usage.sessions == 1


async def test_reserving_an_expired_key_starts_it_afresh(db_path: Path) -> None:
    clock = Clock()
    async with SqliteHistoryStore(db_path, ttl_seconds=10, clock=clock) as store:
        await _append(store, "a", [{"v": 1}])
        await _append(store, "b", [{"v": 1}])  # so the last purge is recent
        clock.now += 11
        seen: list[int | None] = []

        async def look(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, None]:
            seen.append(None if snapshot is None else snapshot.exchange_count)
            return None, None

        await store.transact_log("a", look)
        assert seen == [None]
        assert rows(db_path) == ["b"]  # "a" went when it was reserved, "b" waits its turn


def test_random_keys_do_not_collide_in_the_usage_row(db_path: Path) -> None:
    """Many conversations created and deleted: ids are reused, messages never mixed."""

    async def run() -> None:
        rng = random.Random(7)
        async with SqliteHistoryStore(db_path) as store:
            alive: dict[str, list[dict[str, Any]]] = {}
            for step in range(60):
                key = f"k{rng.randrange(8)}"
                if key in alive and rng.random() < 0.3:
                    assert await store.delete(key)
                    del alive[key]
                    continue
                message = {"step": step}
                await _append(store, key, [message])
                alive.setdefault(key, []).append(message)
            for key, messages in alive.items():
                record = await store.read(key)
                assert record is not None
                assert record["exchanges"] == [[m] for m in messages]
            assert counted(db_path)[0] == counted(db_path)[1]

    asyncio.run(run())
