"""PostgresHistoryStore against the real server of TOUBA_POSTGRES_DSN.

Each test works in tables of its own (``touba_t_<random>``) dropped at teardown.
Without a reachable server these tests are skipped, except under ``CI=true``
where that is a failure (see ``tests/_services.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from tests._services import DEFAULT_POSTGRES_DSN, postgres_dsn
from tests.history._stores import holding
from tests.history._strategies import json_values
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history import ConversationIdentity, MemoryHistoryStore
from touba.history._record import RECORD_KIND, join_record, new_head
from touba.history._store import LogSnapshot, LogWrite, StoreUsage
from touba.history.postgres import PostgresHistoryStore

pytestmark = pytest.mark.postgres

DEFAULT_DSN = DEFAULT_POSTGRES_DSN  # for tests that never connect


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def dsn() -> str:
    return postgres_dsn()


def _tables(name: str) -> list[sql.Identifier]:
    return [
        sql.Identifier(f"{name}_messages"),
        sql.Identifier(name),
        sql.Identifier(f"{name}_meta"),
        sql.Identifier(f"{name}_usage"),
    ]


@pytest.fixture
def table(dsn: str) -> Iterator[str]:
    name = f"touba_t_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(_tables(name))))
        for function in ("usage_count", "usage_count_row", "usage_take", "messages_changed"):
            name_ = sql.Identifier(f"{name}_{function}")
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}").format(name_))


Make = Callable[..., PostgresHistoryStore]


@pytest.fixture
async def make_store(dsn: str, table: str) -> AsyncIterator[Make]:
    made: list[PostgresHistoryStore] = []

    def make(**options: Any) -> PostgresHistoryStore:
        options.setdefault("table", table)
        store = PostgresHistoryStore(dsn, **options)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def query(dsn: str, statement: str, table: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run ``statement`` with ``{t}``/``{m}``/``{meta}``/``{u}`` naming the test's tables."""
    m, t, meta, u = _tables(table)
    composed = sql.SQL(statement).format(t=t, m=m, meta=meta, u=u)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(composed, params)
        return await cur.fetchall() if cur.description else []


def put(record: dict[str, Any] | None, result: Any = None) -> Any:
    async def operation(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
        return copy.deepcopy(record), result

    return operation


async def current(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
    return snapshot, copy.deepcopy(snapshot)


def identity(namespace: str = "ns") -> ConversationIdentity:
    return ConversationIdentity(namespace, "openai", "m", "native", "r-1", "i-1", "agent")


def touba_record(namespace: str = "ns", exchanges: int = 2) -> dict[str, Any]:
    messages: list[list[dict[str, Any]]] = [
        [{"role": "assistant", "n": i}, {"role": "tool", "ok": "é"}] for i in range(exchanges)
    ]
    return join_record(new_head(identity(namespace)), messages)


def appender(
    *messages: tuple[int | None, dict[str, Any]], head: dict[str, Any] | None = None
) -> Any:
    """A log operation appending ``messages`` (exchange None = a new exchange)."""

    async def operation(
        snapshot: LogSnapshot | None, usage: StoreUsage | None
    ) -> tuple[LogWrite, int]:
        count = snapshot.exchange_count if snapshot else 0
        new_head_ = head or (snapshot.head if snapshot else new_head(identity()))
        append = [(count if index is None else index, m) for index, m in messages]
        return LogWrite(copy.deepcopy(new_head_), append), count

    return operation


# -- construction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["", "touba-history", "1abc", "a.b.c", 'x"; DROP TABLE y; --', "a b", "é", "t" * 49, 7],
)
def test_unsafe_table_name_is_refused(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="table must be a plain identifier"):
        PostgresHistoryStore(DEFAULT_DSN, table=name)


def test_exactly_one_of_dsn_or_pool() -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        PostgresHistoryStore()
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(DEFAULT_DSN, open=False)
    with pytest.raises(ConfigurationError, match="exactly one"):
        PostgresHistoryStore(DEFAULT_DSN, pool=pool)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"pool": "postgresql://x"}, "pool must be a psycopg_pool.AsyncConnectionPool"),
        ({"dsn": "not a dsn"}, "not a valid PostgreSQL connection string"),
        ({"dsn": DEFAULT_DSN, "max_sessions": 0}, "max_sessions"),
        ({"dsn": DEFAULT_DSN, "ttl_seconds": 0}, "ttl_seconds"),
        ({"dsn": DEFAULT_DSN, "worker_id": ""}, "worker_id"),
    ],
)
def test_misconfiguration_is_refused_at_construction(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        PostgresHistoryStore(**options)


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, "touba.history.postgres")
    with pytest.raises(ImportError, match=r'pip install "touba\[postgres\]"'):
        importlib.import_module("touba.history.postgres")


async def test_unreachable_server_is_a_configuration_error_at_open() -> None:
    store = PostgresHistoryStore("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2")
    with pytest.raises(ConfigurationError, match="could not open") as info:
        await store.open()
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    await store.close()


# -- schema ------------------------------------------------------------------------------


async def test_tables_are_created_once_even_by_concurrent_opens(
    make_store: Make, dsn: str, table: str
) -> None:
    stores = [make_store() for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))
    rows = await query(dsn, "SELECT name, value FROM {meta}", table)
    assert rows == [("schema_version", "6")]


async def _usage_matches_rows(dsn: str, table: str) -> tuple[int, int]:
    """The sums of the 64 usage counters, checked against the aggregate over the
    conversations table. (Only the sums mean something: since schema version 5 a
    change is counted in whichever shard no other writer holds, so a shard's own
    figures are not those of the keys hashing to it.)"""
    summed = "SELECT coalesce(sum(sessions), 0), coalesce(sum(bytes), 0) FROM {u}"
    [counted] = await query(dsn, summed, table)
    [actual] = await query(dsn, "SELECT count(*), coalesce(sum(bytes), 0) FROM {t}", table)
    assert counted == actual
    shards = await query(dsn, "SELECT shard FROM {u} ORDER BY shard", table)
    assert [r[0] for r in shards] == list(range(64))
    return int(counted[0]), int(counted[1])


# The version-5 layout: a growth's room taken by an UPDATE, no function.
VERSION_5_TAKE = [
    "DROP FUNCTION {take}(boolean, bigint, bigint, text)",
    "UPDATE {meta} SET value = '5'",
]
# The version-4 counters: each change counted in the shard its key hashes to.
VERSION_4_COUNTERS = [
    "CREATE OR REPLACE FUNCTION {count}() RETURNS trigger LANGUAGE plpgsql AS $touba$"
    " DECLARE d record;"
    " BEGIN"
    "  IF TG_OP = 'INSERT' THEN"
    "   FOR d IN SELECT hashtext(key) & 63 AS shard, count(*) AS n,"
    "     sum(bytes) AS b FROM new_rows GROUP BY 1 ORDER BY 1 LOOP"
    "    UPDATE {u} SET sessions = sessions + d.n, bytes = bytes + d.b"
    "     WHERE shard = d.shard;"
    "   END LOOP;"
    "  ELSE"
    "   FOR d IN SELECT hashtext(key) & 63 AS shard, count(*) AS n,"
    "     sum(bytes) AS b FROM old_rows GROUP BY 1 ORDER BY 1 LOOP"
    "    UPDATE {u} SET sessions = sessions - d.n, bytes = bytes - d.b,"
    "     seats = seats + d.n, room = room + d.b WHERE shard = d.shard;"
    "   END LOOP;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$",
    "CREATE OR REPLACE FUNCTION {count_row}() RETURNS trigger LANGUAGE plpgsql AS $touba$"
    " BEGIN"
    "  IF OLD.key = NEW.key THEN"
    "   UPDATE {u} SET bytes = bytes + NEW.bytes - OLD.bytes,"
    "    room = room + greatest(OLD.bytes - NEW.bytes, 0)"
    "    WHERE shard = hashtext(NEW.key) & 63;"
    "  ELSE"
    "   UPDATE {u} SET sessions = sessions - 1, bytes = bytes - OLD.bytes,"
    "    seats = seats + 1, room = room + OLD.bytes"
    "    WHERE shard = hashtext(OLD.key) & 63;"
    "   UPDATE {u} SET sessions = sessions + 1, bytes = bytes + NEW.bytes"
    "    WHERE shard = hashtext(NEW.key) & 63;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$",
    "UPDATE {meta} SET value = '4'",
]
# The version-3 layout: no version column, no triggers on the messages table.
VERSION_3 = [
    "DROP TRIGGER {msg_ins} ON {m}",
    "DROP TRIGGER {msg_upd} ON {m}",
    "DROP TRIGGER {msg_del} ON {m}",
    "DROP FUNCTION {changed}()",
    "ALTER TABLE {t} DROP COLUMN version",
    "UPDATE {meta} SET value = '3'",
]
# The version-2 layout (one usage row kept by triggers), as touba 2 created it.
VERSION_2_USAGE = [
    "DROP TRIGGER {ins} ON {t}",
    "DROP TRIGGER {upd} ON {t}",
    "DROP TRIGGER {delete} ON {t}",
    "DROP FUNCTION {count}()",
    "DROP FUNCTION {count_row}()",
    "DROP TABLE {u}",
    "CREATE TABLE {u} (sessions bigint NOT NULL, bytes bigint NOT NULL)",
    "INSERT INTO {u} SELECT count(*), coalesce(sum(bytes), 0) FROM {t}",
    "CREATE FUNCTION {count}() RETURNS trigger LANGUAGE plpgsql AS $touba$"
    " DECLARE n bigint := 0; b bigint := 0;"
    " BEGIN"
    "  IF TG_OP = 'INSERT' THEN"
    "   SELECT count(*), coalesce(sum(bytes), 0) INTO n, b FROM new_rows;"
    "  ELSIF TG_OP = 'DELETE' THEN"
    "   SELECT -count(*), -coalesce(sum(bytes), 0) INTO n, b FROM old_rows;"
    "  ELSE"
    "   SELECT coalesce(sum(bytes), 0) INTO b FROM new_rows;"
    "   b := b - (SELECT coalesce(sum(bytes), 0) FROM old_rows);"
    "  END IF;"
    "  IF n <> 0 OR b <> 0 THEN"
    "   UPDATE {u} SET sessions = sessions + n, bytes = bytes + b;"
    "  END IF;"
    "  RETURN NULL;"
    " END $touba$",
    "CREATE TRIGGER {ins} AFTER INSERT ON {t} REFERENCING NEW TABLE AS new_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
    "CREATE TRIGGER {upd} AFTER UPDATE ON {t}"
    " REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
    "CREATE TRIGGER {delete} AFTER DELETE ON {t} REFERENCING OLD TABLE AS old_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION {count}()",
    "UPDATE {meta} SET value = '2'",
]


async def _back_to_version(dsn: str, table: str, version: int) -> None:
    """Turn the test's tables back into the layout of schema ``version`` (1 to 5)."""
    m, t, meta, u = _tables(table)
    names = {
        "t": t,
        "m": m,
        "meta": meta,
        "u": u,
        "count": sql.Identifier(f"{table}_usage_count"),
        "count_row": sql.Identifier(f"{table}_usage_count_row"),
        **{k: sql.Identifier(f"{table}_usage_{k[:3]}") for k in ("ins", "upd", "delete")},
        **{f"msg_{k}": sql.Identifier(f"{table}_msg_{k}") for k in ("ins", "upd", "del")},
        "changed": sql.Identifier(f"{table}_messages_changed"),
        "take": sql.Identifier(f"{table}_usage_take"),
    }
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for statement in VERSION_5_TAKE:
            await conn.execute(sql.SQL(statement).format(**names))
        if version == 5:
            return
        if version == 4:
            for statement in VERSION_4_COUNTERS:
                await conn.execute(sql.SQL(statement).format(**names))
            return
        back = VERSION_4_COUNTERS + VERSION_3 + (VERSION_2_USAGE if version < 3 else [])
        for statement in back:
            await conn.execute(sql.SQL(statement).format(**names))
        if version == 1:  # no usage row, no triggers
            await conn.execute(sql.SQL("DROP TABLE {}").format(u))
            await conn.execute(sql.SQL("DROP FUNCTION {} CASCADE").format(names["count"]))
            await conn.execute(sql.SQL("UPDATE {} SET value = '1'").format(meta))


async def _counted_in_a_free_shard(dsn: str, table: str) -> bool:
    """Whether both counting triggers' functions are version 5's (a free shard)."""
    found = await query(
        dsn,
        "SELECT proname, prosrc LIKE '%%SKIP LOCKED%%' FROM pg_proc WHERE proname IN (%s, %s)",
        table,
        f"{table}_usage_count",
        f"{table}_usage_count_row",
    )
    return len(found) == 2 and all(free for _, free in found)


async def _room_taken_by_a_function(dsn: str, table: str) -> bool:
    """Whether the function of schema version 6 that takes a growth's room is there."""
    return bool(
        await query(dsn, "SELECT 1 FROM pg_proc WHERE proname = %s", table, f"{table}_usage_take")
    )


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
async def test_an_older_table_is_upgraded_in_place_with_its_usage_counted(
    make_store: Make, dsn: str, table: str, version: int
) -> None:
    async with make_store() as store:
        await store.transact("plain", put({"v": 1}))
        await store.transact_log("log", appender((None, {"m": 1}), (0, {"m": 2})))
        await store.transact("gone", put({"v": 2}))
        await store.transact("gone", put(None))
    await _back_to_version(dsn, table, version)
    assert await query(dsn, "SELECT value FROM {meta}", table) == [(str(version),)]
    assert version in (1, 5) or not await _counted_in_a_free_shard(dsn, table)
    assert not await _room_taken_by_a_function(dsn, table)
    if version == 2:
        assert await query(dsn, "SELECT sessions FROM {u}", table) == [(2,)]
    async with make_store(max_sessions=3) as store:
        assert await store.read("plain") == {"v": 1}
        assert await query(dsn, "SELECT value FROM {meta}", table) == [("6",)]
        assert await _counted_in_a_free_shard(dsn, table)
        assert await _room_taken_by_a_function(dsn, table)
        sessions, size = await _usage_matches_rows(dsn, table)
        assert (sessions, size) == (2, (await store.usage()).bytes)
        await store.transact_log("log", appender((None, {"m": 3})))
        await store.transact("third", put({"v": 3}))
        with pytest.raises(DecisionHistoryLimitExceeded):
            await store.transact("fourth", put({"v": 4}))
        assert await _usage_matches_rows(dsn, table) == (3, (await store.usage()).bytes)


async def test_a_write_never_waits_for_the_counter_row_its_key_hashes_to(
    make_store: Make, dsn: str, table: str
) -> None:
    """Another transaction holds the usage shard of a key (as a writer of another key
    of that shard does while it commits): a new key's reservation, a growing save, a
    shrinking one and a delete of that key complete all the same, counted in a shard
    no one holds, and the sums stay exact."""
    store = make_store(max_sessions=100, max_store_bytes=100_000)
    await store.transact("first", put({"v": 1}))  # shares the room out
    [(shard,)] = await query(dsn, "SELECT hashtext(%s) & 63", table, "k")
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        u = _tables(table)[3]
        lock = sql.SQL("SELECT shard FROM {} WHERE shard = %s FOR UPDATE").format(u)
        await holder.execute(lock, (shard,))  # held until the end of this block
        await asyncio.wait_for(store.transact_log("k", appender((None, {"m": "x" * 50}))), 10)
        await asyncio.wait_for(store.transact_log("k", appender((None, {"m": "y" * 500}))), 10)
        await asyncio.wait_for(store.transact("k", put({"v": 2})), 10)  # a smaller rewrite
        assert await asyncio.wait_for(store.delete("k"), 10)
        await holder.rollback()
    assert await _usage_matches_rows(dsn, table) == (1, (await store.usage()).bytes)


async def test_the_usage_row_follows_every_statement(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store()
    await store.transact("a", put({"v": 1}))
    await store.transact_log("b", appender((None, {"m": "x" * 100})))
    await store.transact_log("b", appender((None, {"m": "y"})))
    await store.transact("a", put({"v": "longer"}))
    assert await _usage_matches_rows(dsn, table) == (2, (await store.usage()).bytes)
    await store.transact("c", put(None))  # a new key, deleted: its place is given back
    with pytest.raises(RuntimeError):
        await store.transact("d", _raising)
    assert (await _usage_matches_rows(dsn, table))[0] == 2
    assert await store.delete("a")
    assert (await _usage_matches_rows(dsn, table))[0] == 1
    # Expired by the clock, not by waiting (a short TTL raced the steps above on a busy
    # machine).
    await query(dsn, "UPDATE {t} SET expires_at = now() - interval '1 second'", table)
    assert await store.purge_expired() == 1
    assert await _usage_matches_rows(dsn, table) == (0, 0)


# Random operations on a small, often full store; run by tasks here and in a child.
RANDOM_WORKER = """
import asyncio, sys
from tests.history.test_postgres_store import random_operations
from touba.history.postgres import PostgresHistoryStore

async def main(dsn, table, seed):
    store = PostgresHistoryStore(dsn, table=table, **LIMITS)
    await random_operations(store, int(seed), tasks=4)
    await store.close()
    print("done", flush=True)

LIMITS = {"max_sessions": 12, "max_store_bytes": 6000, "ttl_seconds": 0.3}
asyncio.run(main(*sys.argv[1:]))
"""
RANDOM_LIMITS = {"max_sessions": 12, "max_store_bytes": 6000, "ttl_seconds": 0.3}


async def random_operations(store: PostgresHistoryStore, seed: int, *, tasks: int) -> None:
    """``tasks`` tasks each running 60 random operations on 16 keys of ``store``: saves
    that grow or shrink, appends, deletions through ``transact``, failed operations,
    releases of new keys, deletes, reads, purges. Refusals and busy keys are expected."""
    import random

    from touba.errors import DecisionHistoryBusy

    async def one(rng: random.Random) -> None:
        key = f"k{rng.randrange(16)}"
        kind = rng.randrange(8)
        size = rng.randrange(20, 900)
        if kind == 0:
            await store.transact(key, put({"pad": "a" * size}))
        elif kind == 1:
            await store.transact(key, put(None))
        elif kind == 2:
            await store.transact_log(key, appender((None, {"pad": "b" * size})))
        elif kind == 3:
            with contextlib.suppress(RuntimeError):
                await store.transact(key, _raising)
        elif kind == 4:
            await store.transact_log(key, _releasing)
        elif kind == 5:
            await store.delete(key)
        elif kind == 6:
            await store.read(key)
        else:
            await store.purge_expired()

    async def run(task: int) -> None:
        rng = random.Random(seed * 100 + task)
        for _ in range(60):
            with contextlib.suppress(
                DecisionHistoryLimitExceeded, DecisionHistoryBusy, DecisionHistoryRecordInvalid
            ):
                await one(rng)
            await asyncio.sleep(rng.random() * 0.005)

    await asyncio.gather(*(run(task) for task in range(tasks)))


async def _releasing(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, None]:
    return None, None


async def test_usage_stays_exact_under_random_concurrent_operations_from_two_processes(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store(**RANDOM_LIMITS)
    await store.open()
    child = await asyncio.create_subprocess_exec(
        *[sys.executable, "-c", RANDOM_WORKER, dsn, table, "2"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        await random_operations(store, 1, tasks=4)
        out, errors = await asyncio.wait_for(child.communicate(), 120)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert out == b"done\n", errors.decode()
    usage = await store.usage()  # purges expired rows first
    [(count, size)] = await query(dsn, "SELECT count(*), coalesce(sum(bytes), 0) FROM {t}", table)
    assert (usage.sessions, usage.bytes) == (count, size)
    assert usage.sessions <= 12
    assert usage.bytes <= 6000
    assert await _usage_matches_rows(dsn, table) == (count, size)
    # What each shard holds plus its room is the limit the room was shared out under.
    [(seats, room, max_sessions, max_bytes)] = await query(
        dsn,
        "SELECT sum(sessions + seats), sum(bytes + room), min(max_sessions), min(max_bytes)"
        " FROM {u}",
        table,
    )
    assert (seats, room) == (max_sessions or seats, max_bytes or room)
    assert max_sessions in (None, 12)
    assert max_bytes in (None, 6000)
    # The triggers and the limits did run: some operations were refused or shared out.
    assert max_sessions is not None or max_bytes is not None


async def _raising(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
    raise RuntimeError("operation failed")


async def test_a_decision_takes_two_transactions_and_reads_the_tail_ahead(
    make_store: Make,
) -> None:
    from touba.history import (
        CapabilityCall,
        DecisionHistory,
        DecisionMessage,
        HistoryConfig,
        HistoryWindow,
        Observation,
    )

    store = make_store()
    history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
    who = identity("n")
    windows: list[int] = []
    opened: list[str] = []
    originals = {"transaction": store._pg.transaction, "statement": store._pg.statement}

    def counting(kind: str) -> Any:  # counts what the store opens; runs the real one
        def counted() -> Any:
            opened.append(kind)
            return originals[kind]()

        return counted

    # A statement is a transaction of its own (autocommit, on the store's own pool).
    store._pg.transaction = counting("transaction")  # type: ignore[method-assign]
    store._pg.statement = counting("statement")  # type: ignore[method-assign]
    observations: list[Observation] = []
    for step in range(8):

        async def generate(window: HistoryWindow, step: int = step) -> DecisionMessage:
            windows.append(len(window.messages))
            return DecisionMessage(calls=(CapabilityCall(f"c{step}", "f", {"n": step}),))

        opened.clear()
        await history.step(who, observations, generate)
        observations = [Observation(f"c{step}", "f", {"n": step}, "ok", {"r": step})]
        if step >= 2:  # once the store has seen how much of the tail is read
            # The reservation, then the save: each one statement, one round trip.
            assert opened == ["statement", "statement"], step
    assert windows[-1] == 6
    assert (await store.read(who.key)) is not None


async def test_more_conversations_than_connections_wait_outside_the_pool(
    make_store: Make,
) -> None:
    """Decisions beyond the own pool's connections wait for a place in the store
    (a future each), never inside psycopg_pool (a task and a timer each)."""
    from touba.history._pg import POOL_SIZE

    store = make_store()
    histories = [(_history(store), _Decider(), f"n{i}") for i in range(4 * POOL_SIZE)]

    async def decide(rounds: int) -> None:
        async def one(history: Any, decider: _Decider, name: str) -> None:
            for step in range(rounds):
                who = ConversationIdentity("n", "openai", "m", "native", "r-1", name, "agent")
                await decider.step(history, f"{name}-{step}", who=who)

        await asyncio.gather(*(one(*h) for h in histories))

    await decide(2)  # the pool opens its connections as they are first needed
    pool = store._pg._pool
    assert pool is not None
    for _ in range(100):  # on a loaded machine it may still be growing: let it get there
        stats = pool.get_stats()
        if stats["pool_size"] >= POOL_SIZE and stats["pool_available"] == stats["pool_size"]:
            break
        if stats["pool_size"] < POOL_SIZE:
            await decide(1)
        else:  # a connection is still being prepared
            await asyncio.sleep(0.05)
    queued = pool.get_stats().get("requests_queued", 0)
    await decide(5)
    assert pool.get_stats().get("requests_queued", 0) == queued
    assert pool.get_stats()["pool_size"] <= POOL_SIZE
    for _, decider, name in histories:  # each saw its own previous decision last
        assert _texts(decider.windows[-1])[-1] == f"{name}-3"


async def test_a_window_is_parsed_once_shared_read_only_and_never_stale(
    make_store: Make,
) -> None:
    from touba.history import DecisionHistory, DecisionMessage, HistoryConfig, HistoryWindow

    a, b = make_store(), make_store()  # two workers on the same table
    history = DecisionHistory(HistoryConfig(store=a, namespace="n", max_messages=8))
    who = identity("n")
    windows: list[HistoryWindow] = []

    async def decide(window: HistoryWindow) -> DecisionMessage:
        windows.append(window)
        decisions = [m for ex in window.exchanges for m in ex if isinstance(m, DecisionMessage)]
        if decisions:
            with pytest.raises(TypeError, match="read-only"):
                decisions[0].output["changed"] = True
        return DecisionMessage(text=f"d{len(windows)}", output={"n": len(windows)}, final=True)

    for _ in range(4):
        await history.step(who, [], decide)
    first, second = windows[-2].exchanges[0][0], windows[-1].exchanges[0][0]
    assert isinstance(first, DecisionMessage)
    assert isinstance(second, DecisionMessage)
    assert first.text == second.text == "d1"
    assert second is first  # parsed once, then reused from the same stored text

    async def rewrite(record: Any) -> tuple[Any, None]:
        record["exchanges"][0][0]["text"] = "rewritten by another worker"
        return record, None

    await b.transact(who.key, rewrite)
    await history.step(who, [], decide)
    texts = [m.text for ex in windows[-1].exchanges for m in ex if isinstance(m, DecisionMessage)]
    assert texts == ["rewritten by another worker", "d2", "d3", "d4"]
    # Another worker's save changed the version: the whole tail was read and parsed
    # again (a cached tail is reused only at the version it was read at).
    assert windows[-1].exchanges[1][0] == windows[-2].exchanges[1][0]
    assert windows[-1].exchanges[1][0] is not windows[-2].exchanges[1][0]


# -- the tail cache (the version column and its triggers) --------------------------------


def _history(store: PostgresHistoryStore) -> Any:
    from touba.history import DecisionHistory, HistoryConfig

    return DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))


def _texts(window: Any) -> list[str | None]:
    from touba.history import DecisionMessage

    return [m.text for ex in window.exchanges for m in ex if isinstance(m, DecisionMessage)]


class _Decider:
    """Decides with text ``prefix<n>``; keeps the windows it was shown."""

    def __init__(self) -> None:
        self.windows: list[Any] = []

    async def step(
        self,
        history: Any,
        text: str,
        during: Callable[[], Awaitable[Any]] | None = None,
        who: Any = None,
    ) -> None:
        """One decision; ``during`` runs while it is reserved (as the model call)."""
        from touba.history import DecisionMessage, HistoryWindow

        async def decide(window: HistoryWindow) -> DecisionMessage:
            self.windows.append(window)
            if during is not None:
                await during()
            return DecisionMessage(text=text, final=True)

        await history.step(identity("n") if who is None else who, [], decide)


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows each multi-row statement of the store returned, in order."""
    import touba.history.postgres as module
    from touba.history._pg import rows as original  # what the store imports as _rows

    counts: list[int] = []

    async def counted(*args: Any) -> Any:
        found = await original(*args)
        counts.append(len(found))
        return found

    monkeypatch.setattr(module, "_rows", counted)
    return counts


async def test_an_optimistic_renewal_commits_without_waiting_for_the_wal_flush(
    make_store: Make, dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save without a reservation that only renews the expiry (the head unchanged,
    nothing added: a session's read) runs with synchronous_commit off for its own
    transaction; one that writes anything waits for the flush as always."""
    import touba.history.postgres as module
    from touba.history._pg import row as original

    store = make_store(ttl_seconds=600)
    await store.transact_log("k", appender((None, {"m": 0})))
    sent: list[tuple[Any, Any]] = []

    async def spied(conn: Any, statement: Any, params: Any = ()) -> Any:
        sent.append((statement, params))
        return await original(conn, statement, params)

    async def renew(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[Any, None]:
        assert snapshot is not None
        return LogWrite(copy.deepcopy(snapshot.head)), None

    monkeypatch.setattr(module, "_row", spied)
    await query(dsn, "UPDATE {t} SET expires_at = now() + interval '1 minute'", table)
    await store.transact_log_optimistic("k", renew)
    await store.transact_log_optimistic("k", appender((None, {"m": 1})))
    (renewal, renewal_params), (append, append_params) = sent[-2:]
    assert renewal == store._sql.renew_unreserved
    assert append == store._sql.append_unreserved
    ((minutes,),) = await query(
        dsn, "SELECT extract(epoch FROM expires_at - now()) / 60 FROM {t}", table
    )
    assert minutes > 9  # renewed: ten minutes from now, not one
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for statement, params, level in (
            (renewal, renewal_params, "off"),
            (append, append_params, "on"),
        ):
            async with conn.transaction(force_rollback=True):  # replayed, then undone
                await conn.execute(statement, params)
                cur = await conn.execute("SHOW synchronous_commit")
                assert await cur.fetchone() == (level,)
    assert [len(x) for x in (await store.read("k") or {})["exchanges"]] == [1, 1]


async def test_a_cache_hit_reads_no_message_rows(make_store: Make, fetched: list[int]) -> None:
    store = make_store()
    history, decider = _history(store), _Decider()
    for step in range(4):
        await decider.step(history, f"d{step}")
    fetched.clear()
    await decider.step(history, "d4")
    assert fetched == [1]  # the reservation's own row: no message, no size
    assert _texts(decider.windows[-1]) == ["d0", "d1", "d2", "d3"]
    assert len(store._reservations.cache) == 1


async def test_another_store_objects_save_invalidates_the_cache(
    make_store: Make, fetched: list[int]
) -> None:
    a, b = make_store(), make_store()
    history_a, history_b, decider = _history(a), _history(b), _Decider()
    for step in range(3):
        await decider.step(history_a, f"a{step}")
    await decider.step(history_b, "b0")
    fetched.clear()
    await decider.step(history_a, "a3")
    assert fetched[0] > 1  # the version changed: the tail was read again
    assert _texts(decider.windows[-1]) == ["a0", "a1", "a2", "b0"]
    fetched.clear()
    await decider.step(history_a, "a4")
    assert fetched == [1]  # and is cached again at a's own save


async def test_an_external_update_of_a_cached_row_is_seen_by_the_next_decision(
    make_store: Make, dsn: str, table: str, fetched: list[int]
) -> None:
    store = make_store()
    history, decider = _history(store), _Decider()
    for step in range(4):
        await decider.step(history, f"d{step}")
    [(seq, body)] = await query(
        dsn, "SELECT seq, body FROM {m} WHERE body LIKE %s", table, '%"text":"d3"%'
    )
    await query(
        dsn, "UPDATE {m} SET body = %s WHERE seq = %s", table, body.replace("d3", "X3"), seq
    )
    assert await query(dsn, "SELECT version FROM {t}", table) == [(None,)]
    fetched.clear()
    await decider.step(history, "d4")
    assert fetched[0] > 1
    assert _texts(decider.windows[-1]) == ["d0", "d1", "d2", "X3"]
    # An external insert clears the version too: the next decision sees the
    # second decision in exchange 3 and is refused.
    assert (await query(dsn, "SELECT version FROM {t}", table))[0][0] is not None
    copy_row = "INSERT INTO {m} SELECT key, 999, exchange, bytes, body FROM {m} WHERE seq = %s"
    await query(dsn, copy_row, table, seq)
    assert await query(dsn, "SELECT version FROM {t}", table) == [(None,)]
    with pytest.raises(DecisionHistoryRecordInvalid, match="in exchange 3"):
        await decider.step(history, "refused")
    await query(dsn, "DELETE FROM {m} WHERE seq = 999", table)
    await decider.step(history, "d5")
    assert _texts(decider.windows[-1]) == ["d0", "d1", "d2", "X3", "d4"]
    # And so does an external delete.
    assert (await query(dsn, "SELECT version FROM {t}", table))[0][0] is not None
    await query(dsn, "DELETE FROM {m} WHERE body LIKE %s", table, '%"text":"d0"%')
    assert await query(dsn, "SELECT version FROM {t}", table) == [(None,)]


async def test_an_external_update_made_while_a_decision_runs_is_seen_by_the_next(
    make_store: Make, dsn: str, table: str, fetched: list[int]
) -> None:
    """The save that ends a reservation must not hide an edit made during it."""
    store = make_store()
    history, decider = _history(store), _Decider()
    for step in range(3):
        await decider.step(history, f"d{step}")
    [(seq, body)] = await query(
        dsn, "SELECT seq, body FROM {m} WHERE body LIKE %s", table, '%"text":"d1"%'
    )

    async def edit() -> None:
        replaced = body.replace("d1", "X1")
        await query(dsn, "UPDATE {m} SET body = %s WHERE seq = %s", table, replaced, seq)

    await decider.step(history, "d3", during=edit)
    assert await query(dsn, "SELECT version FROM {t}", table) == [(None,)]
    fetched.clear()
    await decider.step(history, "d4")
    assert fetched[0] > 1  # read again, not served from the cache
    assert _texts(decider.windows[-1]) == ["d0", "X1", "d2", "d3"]
    # Once read again, the tail is cached at the next save.
    assert (await query(dsn, "SELECT version FROM {t}", table))[0][0] is not None
    fetched.clear()
    await decider.step(history, "d5")
    assert fetched == [1]


@pytest.mark.parametrize("recreate", ["same store", "other store"])
async def test_delete_and_recreate_never_serves_stale_messages(
    make_store: Make, recreate: str
) -> None:
    a = make_store()
    b = a if recreate == "same store" else make_store()
    history_a, decider = _history(a), _Decider()
    for step in range(3):
        await decider.step(history_a, f"old{step}")
    assert await b.delete(identity("n").key)
    await decider.step(_history(b), "new0")
    await decider.step(history_a, "new1")
    assert _texts(decider.windows[-1]) == ["new0"]
    await decider.step(history_a, "new2")
    assert _texts(decider.windows[-1]) == ["new0", "new1"]
    record = await a.read(identity("n").key)
    assert record is not None
    stored = [m.get("text") for ex in record["exchanges"] for m in ex]
    assert stored == ["new0", "new1", "new2"]


@pytest.mark.parametrize("recreate", ["same store", "other store"])
async def test_a_log_write_to_a_deleted_key_never_joins_its_old_tail(
    make_store: Make, recreate: str
) -> None:
    a = make_store()
    b = a if recreate == "same store" else make_store()
    seen: list[list[list[Any]]] = []

    async def read_all(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> Any:
        assert snapshot is not None
        seen.append(await snapshot.exchanges(0, snapshot.exchange_count))
        return None, None

    await a.transact_log("k", appender((None, {"old": 0})))  # as many exchanges as anew
    await a.transact_log("k", read_all)  # the tail is cached, the history read hinted
    await a.transact_log("k", read_all)  # the tail is cached as far as that hint
    assert await b.delete("k")
    await b.transact_log("k", appender((None, {"new": 0})))
    await a.transact_log("k", read_all)
    assert seen[-1] == [[{"new": 0}]]
    await a.transact_log("k", appender((None, {"new": 1})))
    await a.transact_log("k", read_all)
    assert seen[-1] == [[{"new": 0}], [{"new": 1}]]
    record = await make_store().read("k")
    assert record is not None
    assert record["exchanges"] == seen[-1]


async def test_migration_from_3_keeps_every_conversation_readable_and_equal(
    make_store: Make, dsn: str, table: str
) -> None:
    async with make_store() as store:
        history, decider = _history(store), _Decider()
        for step in range(5):
            await decider.step(history, f"d{step}")
        await store.transact("plain", put({"v": 1, "nested": {"é": [1, 2]}}))
        await store.transact("record", put(touba_record(exchanges=3)))
        await store.transact_log("log", appender((None, {"m": 1}), (0, {"m": 2})))
        keys = [identity("n").key, "plain", "record", "log"]
        before = {key: await store.read(key) for key in keys}
    await _back_to_version(dsn, table, 3)
    columns = await query(
        dsn,
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s",
        table,
        table,
    )
    assert ("version",) not in columns
    async with make_store() as store:
        assert {key: await store.read(key) for key in keys} == before
        assert await query(dsn, "SELECT value FROM {meta}", table) == [("6",)]
        assert await query(dsn, "SELECT count(*) FROM {t} WHERE version IS NULL", table) == [(4,)]
        decider = _Decider()
        await decider.step(_history(store), "d5")
        assert _texts(decider.windows[-1]) == ["d0", "d1", "d2", "d3", "d4"]
        await store.transact_log("log", appender((None, {"m": 3})))
        log = await store.read("log")
        assert log is not None
        assert log["exchanges"] == [[{"m": 1}, {"m": 2}], [{"m": 3}]]
        assert await _usage_matches_rows(dsn, table) == (4, (await store.usage()).bytes)


async def test_newer_schema_version_is_refused_untouched(
    make_store: Make, dsn: str, table: str
) -> None:
    async with make_store() as store:
        await store.transact("k", put({"v": 1}))
    await query(dsn, "UPDATE {meta} SET value = '7'", table)
    with pytest.raises(DecisionHistoryRecordInvalid, match="schema version '7'"):
        await make_store().read("k")
    assert await query(dsn, "SELECT key, head FROM {t}", table) == [("k", '{"v":1}')]


async def test_schema_qualified_table(dsn: str) -> None:
    schema = f"touba_s_{uuid.uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            async with PostgresHistoryStore(dsn, table=f"{schema}.history") as store:
                await store.transact_log("k", appender((None, {"a": 1})))
                assert [c.key for c in await store.list()] == ["k"]
            cur = await conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s"
                " ORDER BY table_name",
                (schema,),
            )
            assert await cur.fetchall() == [
                ("history",),
                ("history_messages",),
                ("history_meta",),
                ("history_usage",),
            ]
        finally:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def test_foreign_table_of_that_name_is_refused_untouched(
    make_store: Make, dsn: str, table: str
) -> None:
    await query(dsn, "CREATE TABLE {t} (x integer)", table)
    with pytest.raises(ConfigurationError, match="not a touba history table"):
        await make_store().open()
    columns = await query(
        dsn,
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s",
        table,
        table,
    )
    assert columns == [("x",)]


# -- round trips -------------------------------------------------------------------------

_json = json_values(text=st.text(max_size=12), keys=st.text(max_size=6), leaves=16)
_dicts = st.dictionaries(st.text(max_size=6), _json, max_size=5)
_touba_shaped = st.builds(
    lambda head, exchanges: {**head, "kind": RECORD_KIND, "exchanges": exchanges},
    _dicts,
    st.lists(st.lists(_dicts, min_size=1, max_size=3), max_size=4),
)


@pytest.fixture
def sync_store(dsn: str, table: str) -> Iterator[tuple[asyncio.Runner, PostgresHistoryStore]]:
    with asyncio.Runner() as runner:
        store = PostgresHistoryStore(dsn, table=table)
        runner.run(store.open())
        yield runner, store
        runner.run(store.close())


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(record=_dicts | _touba_shaped)
def test_any_json_dict_round_trips(
    sync_store: tuple[asyncio.Runner, PostgresHistoryStore], record: dict[str, Any]
) -> None:
    runner, store = sync_store
    runner.run(store.transact("k", put(record)))
    assert runner.run(store.read("k")) == record
    assert runner.run(store.transact("k", current)) == record


async def test_touba_records_round_trip_as_rows(make_store: Make, dsn: str, table: str) -> None:
    store = make_store()
    record = touba_record(exchanges=3)
    assert await store.transact("k", put(record, "done")) == "done"
    assert await store.read("k") == record
    rows = await query(dsn, "SELECT seq, exchange FROM {m} WHERE key = 'k' ORDER BY seq", table)
    assert rows == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    [entry] = await store.list()
    assert entry.identity == identity().as_dict()
    assert (entry.messages, entry.active, entry.reservation) == (6, False, None)


async def serializable(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.set_isolation_level(psycopg.IsolationLevel.SERIALIZABLE)


async def test_store_given_a_pool_leaves_it_open(dsn: str, table: str) -> None:
    # Connections returning dicts, in autocommit, serializable: the store copes.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        open=False,
        min_size=1,
        max_size=2,
        kwargs={"row_factory": dict_row, "autocommit": True},
        configure=serializable,
    )
    await pool.open(wait=True)
    try:
        async with PostgresHistoryStore(pool=pool, table=table) as store:
            record = touba_record()
            await store.transact("k", put(record))
            assert await store.read("k") == record
            # Decisions too: their single statements run in READ COMMITTED
            # transactions on a pool that is not the store's own.
            history, decider = _history(store), _Decider()
            for step in range(3):
                await decider.step(history, f"d{step}")
            assert _texts(decider.windows[-1]) == ["d0", "d1"]
        assert not pool.closed
        with pytest.raises(ConfigurationError, match="closed"):
            await store.read("k")
    finally:
        await pool.close()


async def test_store_refuses_a_pool_that_is_not_open(table: str) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(DEFAULT_DSN, open=False)
    store = PostgresHistoryStore(pool=pool, table=table)
    with pytest.raises(ConfigurationError, match=r"await pool.open\(\)"):
        await store.read("k")


# -- transact_log ------------------------------------------------------------------------


async def test_transact_log_appends_without_rewriting_old_rows(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store()
    await store.transact_log("k", appender((None, {"a": 1}), (None, {"b": 2})))
    physical = "SELECT seq, ctid::text, xmin::text FROM {m} WHERE key = 'k' ORDER BY seq"
    before = await query(dsn, physical, table)
    assert await store.transact_log("k", appender((0, {"c": 3}), (None, {"d": 4}))) == 1
    after = await query(dsn, physical, table)
    assert after[: len(before)] == before
    assert len(after) == 4
    assert (await store.read("k") or {})["exchanges"] == [
        [{"a": 1}, {"b": 2}, {"c": 3}],
        [{"d": 4}],
    ]


async def test_transact_log_matches_the_memory_store(make_store: Make) -> None:
    stores: list[PostgresHistoryStore | MemoryHistoryStore] = [make_store(), MemoryHistoryStore()]
    steps = [
        appender((None, {"d": 0}), (0, {"r": "é" * 3})),
        appender((None, {"d": 1})),
        appender((1, {"r": 1}), (None, {"d": 2}), (2, {"r": [2, None]})),
        appender(head={**new_head(identity()), "summary": {"text": "s"}}),
    ]
    seen: list[list[Any]] = [[], []]
    for step in steps:
        for store in stores:
            await store.transact_log("k", step)

    async def look(snapshot: LogSnapshot | None, usage: StoreUsage | None) -> tuple[None, Any]:
        assert snapshot is not None
        views = [snapshot.head, snapshot.exchange_count]
        for start in range(4):
            views.append(await snapshot.sizes(start))
            views.extend([await snapshot.exchanges(start, stop) for stop in range(5)])
        return None, views

    for store, out in zip(stores, seen, strict=True):
        out.append(await store.transact_log("k", look))
        out.append(await store.read("k"))
        out.append([(c.key, c.identity, c.messages, c.bytes) for c in await store.list()])
    assert seen[0] == seen[1]


async def test_transact_log_refuses_to_rewrite_history(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store()
    await store.transact_log("k", appender((None, {"a": 1})))
    await store.transact_log("k", appender((None, {"b": 2})))
    before = await store.read("k")
    with pytest.raises(ValueError, match="append to exchange 0 refused"):
        await store.transact_log("k", appender((0, {"late": True})))
    assert await store.read("k") == before
    assert await query(dsn, "SELECT count(*) FROM {m}", table) == [(2,)]


# -- exclusion, exceptions, crashes ------------------------------------------------------


async def test_second_worker_is_refused_at_once(make_store: Make) -> None:
    a, b = make_store(worker_id="worker-a"), make_store()
    await a.transact("k", put({"v": 0}))
    task, leave = await holding(a, "k", lambda snapshot: ({"v": 1}, None))
    async with asyncio.timeout(2):
        for attempt in (
            b.transact("k", put({"v": 2})),
            b.transact_log("k", appender((None, {}))),
            b.read("k"),
            b.delete("k"),
        ):
            with pytest.raises(DecisionHistoryBusy) as info:
                await attempt
            assert info.value.session_key == "k"
        [entry] = await b.list()
    assert entry.active
    assert entry.reservation is not None
    assert entry.reservation["worker_id"] == "worker-a"
    assert (entry.reservation["pid"], entry.reservation["host"]) == (
        os.getpid(),
        socket.gethostname(),
    )
    leave.set()
    await task
    assert await b.read("k") == {"v": 1}


async def test_exception_keeps_the_old_state_and_frees_the_key(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store()
    record = touba_record()
    await store.transact("k", put(record))

    async def fail(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        assert snapshot is not None
        snapshot["exchanges"].clear()
        raise RuntimeError("boom")

    for key in ("k", "new"):
        with pytest.raises(RuntimeError, match="boom"):
            await store.transact(key, fail if key == "k" else _raise)
    assert await store.read("k") == record
    assert await store.read("new") is None
    assert await query(dsn, "SELECT key, token FROM {t}", table) == [("k", None)]


async def test_damaged_record_is_refused_untouched(make_store: Make, dsn: str, table: str) -> None:
    store = make_store()
    await store.transact("k", put(touba_record()))
    await query(dsn, "UPDATE {m} SET body = '[1' WHERE seq = 1", table)
    damaged = await query(dsn, "SELECT head, bytes FROM {t}", table)
    for attempt in (store.read("k"), store.transact("k", put({"v": 1}))):
        with pytest.raises(DecisionHistoryRecordInvalid, match="not modified"):
            await attempt
    assert await query(dsn, "SELECT head, bytes FROM {t}", table) == damaged
    assert await store.delete("k") is True


async def _raise(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
    raise RuntimeError("boom")


async def test_cancelled_operation_frees_the_key(make_store: Make) -> None:
    store = make_store()
    inside = asyncio.Event()

    async def hang(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        inside.set()
        await asyncio.sleep(60)
        return {}, None

    task = asyncio.create_task(store.transact("k", hang))
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.transact("k", put({"v": 1}, "free")) == "free"


async def test_none_deletes_and_delete_reports(make_store: Make) -> None:
    store = make_store()
    await store.transact("k", put({"v": 1}))
    await store.transact("k", put(None))
    assert await store.read("k") is None
    await store.transact("k", put(touba_record()))
    assert await store.delete("k") is True
    assert await store.delete("k") is False
    assert await store.list() == []


async def test_recovery_while_running_refuses_the_late_save(make_store: Make) -> None:
    a, operator = make_store(), make_store()
    await a.transact("k", put({"v": 0}))
    task, leave = await holding(a, "k", lambda snapshot: ({"v": 1}, None))
    with pytest.raises(ConfigurationError, match="worker_stopped=True"):
        await operator.recover("k", worker_stopped=False)
    assert await operator.recover("k", worker_stopped=True) is True
    assert await operator.recover("k", worker_stopped=True) is False
    leave.set()
    with pytest.raises(DecisionHistoryBusy, match="recovered"):
        await task
    assert await operator.read("k") == {"v": 0}


CRASHING_WORKER = """
import asyncio, sys
from touba.history.postgres import PostgresHistoryStore

async def main(dsn, table):
    store = PostgresHistoryStore(dsn, table=table, worker_id="doomed")
    async def save(snapshot):
        return {"saved": "before the crash"}, None
    await store.transact("old", save)
    inside = asyncio.Barrier(3)
    async def hang(snapshot):
        await inside.wait()
        await asyncio.sleep(60)
        return {"saved": "never"}, None
    tasks = [asyncio.create_task(store.transact(key, hang)) for key in ("old", "new")]
    await inside.wait()
    print("reserved", flush=True)
    await asyncio.gather(*tasks)

asyncio.run(main(*sys.argv[1:]))
"""


async def crash_inside_operations(dsn: str, table: str) -> int:
    """Run a worker that saves key "old", reserves "old" and "new", then dies by SIGKILL.

    Returns the pid the worker had.
    """
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-c", CRASHING_WORKER, dsn, table],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        _, errors = await proc.communicate()
    assert line == b"reserved\n", errors.decode()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


async def test_crash_leaves_keys_busy_until_recovered(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store(max_sessions=2)
    await store.open()
    pid = await crash_inside_operations(dsn, table)
    for key in ("old", "new"):
        for attempt in (store.transact(key, put({})), store.read(key), store.delete(key)):
            with pytest.raises(DecisionHistoryBusy, match=r"worker doomed, pid \d+ on .*recover\("):
                await attempt
    new, old = await store.list()
    for entry in (old, new):
        assert entry.active
        assert entry.reservation is not None
        assert entry.reservation["worker_id"] == "doomed"
        assert (entry.reservation["pid"], entry.reservation["host"]) == (pid, socket.gethostname())
    # "new" had no record: a bare reservation, with no identity, holding its place.
    assert (new.key, new.identity, new.messages, new.bytes) == ("new", None, 0, 0)
    assert await store.list("ns") == []
    assert (await store.usage()).sessions == 2
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await store.transact("other", put({"v": 1}))
    assert caught.value.limit == "max_sessions"

    assert await store.recover("old", worker_stopped=True) is True
    assert await store.read("old") == {"saved": "before the crash"}
    assert await store.transact("old", current) == {"saved": "before the crash"}
    assert await store.recover("new", worker_stopped=True) is True
    assert await store.recover("new", worker_stopped=True) is False
    assert await store.read("new") is None
    await store.transact("other", put({"v": 1}))  # recovering "new" freed its place
    assert [c.key for c in await store.list()] == ["old", "other"]


# -- bounds ------------------------------------------------------------------------------


async def test_full_store_refuses_new_sessions_atomically(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store(max_sessions=2)
    await store.transact("a", put({"v": 1}))
    await store.transact_log("b", appender((None, {"m": 1})))
    for attempt in (
        store.transact("c", put({"v": 3})),
        store.transact_log("c", appender((None, {}))),
    ):
        with pytest.raises(DecisionHistoryLimitExceeded) as info:
            await attempt
        assert info.value.limit == "max_sessions"
    assert await query(dsn, "SELECT key, token FROM {t} ORDER BY key", table) == [
        ("a", None),
        ("b", None),
    ]
    await store.transact("a", put({"v": 2}))  # existing sessions may still change
    assert await store.read("a") == {"v": 2}


async def test_store_bytes_limit_refuses_atomically(make_store: Make, dsn: str, table: str) -> None:
    record = {"x": "a" * 100}  # 108 bytes
    store = make_store(max_store_bytes=250)
    await store.transact("a", put(record))
    # 7 bytes of head + 28 of message: 143 bytes stored in all
    await store.transact_log("b", appender((None, {"y": "b" * 20}), head={"h": 1}))
    before = await query(dsn, "SELECT key, seq, body FROM {m} ORDER BY key, seq", table)
    for attempt in (
        store.transact("a", put({"x": "a" * 208})),  # 216 + 35 = 251 bytes
        store.transact_log("b", appender((None, {"y": "c" * 100}))),  # 143 + 108 = 251 bytes
    ):
        with pytest.raises(DecisionHistoryLimitExceeded) as info:
            await attempt
        assert info.value.limit == "max_store_bytes"
    assert await store.read("a") == record
    assert await query(dsn, "SELECT key, seq, body FROM {m} ORDER BY key, seq", table) == before
    assert [(c.key, c.bytes) for c in await store.list()] == [("a", 108), ("b", 35)]
    await store.transact("a", put({"x": "a" * 207}))  # exactly 250 bytes fits


@pytest.mark.parametrize("limit", ["max_sessions", "max_store_bytes"])
async def test_two_workers_cannot_both_take_the_last_room(make_store: Make, limit: str) -> None:
    record = {"x": "a" * 100}  # 108 bytes
    options = {"max_sessions": 2} if limit == "max_sessions" else {"max_store_bytes": 270}
    a, b = make_store(**options), make_store(**options)
    await a.transact("first", put(record))
    inside: list[str] = []
    release = asyncio.Event()

    async def fill(snapshot: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
        inside.append("in")
        if len(inside) == 2:
            release.set()  # both hold a reservation: let them race to save
        await release.wait()
        return record, "saved"

    tasks = [asyncio.create_task(a.transact("x", fill)), asyncio.create_task(b.transact("y", fill))]
    await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    release.set()  # one was refused at its reservation: let the other save
    results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [r for r in results if isinstance(r, DecisionHistoryLimitExceeded)]
    assert len(refused) == 1, results
    assert refused[0].limit == limit
    assert results.count("saved") == 1
    # The last place is taken when reserving; bytes are known only when saving.
    assert len(inside) == (1 if limit == "max_sessions" else 2)
    assert len(await a.list()) == 2


# -- expiry ------------------------------------------------------------------------------


async def test_expired_session_is_purged_on_access_and_read_does_not_renew(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store(ttl_seconds=1.0)
    await store.transact("k", put({"v": 1}))
    await asyncio.sleep(0.6)
    assert await store.read("k") == {"v": 1}
    await asyncio.sleep(0.6)  # 1.2 s after the save: expired, although read at 0.6 s
    assert await query(dsn, "SELECT count(*) FROM {t}", table) == [(1,)]
    assert await store.read("k") is None
    assert await query(dsn, "SELECT count(*) FROM {t}", table) == [(0,)]
    assert await store.transact("k", current) is None


async def test_purge_spares_reserved_sessions_and_saving_renews(
    make_store: Make, dsn: str, table: str
) -> None:
    store = make_store(ttl_seconds=0.5)
    await store.transact("held", put({"v": 1}))
    await store.transact_log("idle", appender((None, {"m": 1})))
    task, leave = await holding(store, "held", lambda snapshot: (snapshot, None))
    await asyncio.sleep(0.7)
    assert await store.purge_expired() == 1
    assert await query(dsn, "SELECT count(*) FROM {m}", table) == [(0,)]
    leave.set()
    await task
    assert await store.read("held") == {"v": 1}
    assert [c.key for c in await store.list()] == ["held"]


@pytest.mark.parametrize("limit", ["max_sessions", "max_store_bytes"])
async def test_expired_rows_never_refuse_a_write(
    make_store: Make, dsn: str, table: str, limit: str
) -> None:
    """A write that fits only without the expired rows is accepted: the exact check
    purges them before refusing (this store object purged on its first access, so
    not its once-a-minute purge)."""
    options = {"max_sessions": 2} if limit == "max_sessions" else {"max_store_bytes": 300}
    store = make_store(ttl_seconds=0.5, **options)
    record = {"x": "a" * 150}  # 158 bytes: one fits under 300, not two
    await store.transact("a", put(record))
    if limit == "max_sessions":
        await store.transact("b", put(record))
    await asyncio.sleep(0.7)
    assert await query(dsn, "SELECT count(*) FROM {t}", table) == [
        (2 if limit == "max_sessions" else 1,)
    ]
    await store.transact("c", put(record))
    assert [c.key for c in await store.list()] == ["c"]
    assert await _usage_matches_rows(dsn, table) == (1, 158)


# -- listing and lifecycle ---------------------------------------------------------------


async def test_list_filters_by_namespace(make_store: Make) -> None:
    store = make_store()
    await store.transact("a", put(touba_record("alpha")))
    await store.transact_log("b", appender((None, {}), head=new_head(identity("beta"))))
    await store.transact("c", put({"plain": True}))
    assert [c.key for c in await store.list()] == ["a", "b", "c"]
    [beta] = await store.list("beta")
    assert (beta.key, beta.identity, beta.messages) == ("b", identity("beta").as_dict(), 1)
    assert beta.expires_at is not None
    assert beta.updated_at < beta.expires_at
    assert await store.list("gamma") == []


async def test_close_lets_a_running_operation_save(make_store: Make) -> None:
    store, other = make_store(), make_store()
    task, leave = await holding(store, "k", lambda snapshot: ({"v": 1}, "saved"))
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0.05)
    assert not closing.done()
    with pytest.raises(ConfigurationError, match="closed"):
        await store.read("k")
    leave.set()
    assert await task == "saved"
    await closing
    assert await other.read("k") == {"v": 1}


async def test_closed_store_refuses_and_closing_twice_is_fine(make_store: Make) -> None:
    store = make_store()
    await store.transact("k", put({"v": 1}))
    await store.close()
    await store.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await store.read("k")


# -- the server cuts the store's connections ---------------------------------------------


async def _cut(dsn: str, application: str) -> int:
    """Terminate every backend of ``application``; how many there were."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (application,),
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


@pytest.mark.parametrize("when", ["between decisions", "during the model call"])
async def test_connections_cut_by_the_server_fail_one_decision_then_the_store_goes_on(
    dsn: str, table: str, when: str
) -> None:
    """A cut connection is DecisionHistoryStoreUnavailable (retryable, chained to
    psycopg's error) for the decision that met it, which saves nothing and leaves the
    conversation free: the pool drops the dead connections and the next decision runs."""
    from psycopg.conninfo import make_conninfo

    from touba.errors import DecisionHistoryStoreUnavailable

    application = f"touba-cut-{table}"
    async with PostgresHistoryStore(
        make_conninfo(dsn, application_name=application), table=table
    ) as store:
        history, decider = _history(store), _Decider()
        for n in range(3):
            await decider.step(history, f"d{n}")

        async def cut() -> None:
            assert await _cut(dsn, application) >= 1

        if when == "between decisions":
            await cut()
        during = cut if when == "during the model call" else None
        with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
            await decider.step(history, "lost", during=during)
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, psycopg.Error)
        await decider.step(history, "d3")  # not left reserved, and the store reconnects
        await decider.step(history, "d4")
    assert _texts(decider.windows[-1]) == ["d0", "d1", "d2", "d3"]  # "lost" was never saved
