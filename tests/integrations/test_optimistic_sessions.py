"""ToubaSession's optimistic path: one store call while the cached tail is current,
the reservation path whenever it is not, and never a lost or a half write.

Every built-in durable store saves a cached session operation with one
``save_if`` (Redis, which cannot see edits made behind its back by the
version, compares the head, entries and rows the operation read, as text).
Every behaviour test runs on the three: the results must be those of the
reserved path, whoever else wrote, edited, held or filled the store in between.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._services import postgres_dsn
from tests.integrations.conftest import Factory, make_factory
from touba.errors import (
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
)
from touba.history.sqlite import SqliteHistoryStore
from touba.integrations.openai_agents import ToubaSession


def item(n: int) -> Any:
    return {"role": "user", "content": f"message {n:04d} " + "x" * 200}


class Calls:
    """Counts the backend primitives a store object calls."""

    NAMES = ("reserve", "save", "save_if", "release", "read_sizes", "read_rows", "peek")

    def __init__(self, store: Any) -> None:
        self.counts: Counter[str] = Counter()
        backend = store._reservations.backend
        for name in self.NAMES:
            method = getattr(backend, name, None)
            if method is not None:
                setattr(backend, name, self._counted(name, method))

    def _counted(self, name: str, method: Any) -> Any:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return await method(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        counts = dict(self.counts)
        self.counts.clear()
        return counts

    def refused_then_reserved(self) -> None:
        """The calls since the last take: one optimistic write, refused (it wrote
        nothing: the reserved path then found the state it expected), then one
        reservation and its save."""
        counts = self.take()
        assert counts.get("save_if") == 1
        assert counts.get("reserve") == 1
        assert counts.get("save") == 1


@pytest.fixture
def redis_factory(private_dir: Any, store_name: str) -> Iterator[Factory]:
    """Redis stores only, for what is Redis's own (content mode)."""
    factory, cleanup = make_factory("redis", private_dir, store_name)
    yield factory
    cleanup()


@pytest.fixture
async def two(store_factory: Factory) -> AsyncIterator[tuple[Any, Any]]:
    """Two store objects on the same data: two processes, as far as caches go."""
    async with store_factory() as first, store_factory() as second:
        yield first, second


def sessions_of(two: tuple[Any, Any]) -> tuple[ToubaSession, ToubaSession]:
    """The one session "s1" (namespace "ns"), through each of the two store objects."""
    first, second = two
    return (
        ToubaSession("s1", store=first, namespace="ns"),
        ToubaSession("s1", store=second, namespace="ns"),
    )


async def test_a_cached_operation_is_one_store_call(two: tuple[Any, Any]) -> None:
    store, _ = two
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items([item(0), item(1)])
    assert await session.get_items() == [item(0), item(1)]  # the tail is cached now
    calls = Calls(store)
    await session.add_items([item(2)])
    items = await session.get_items()
    assert items == [item(0), item(1), item(2)]
    # One store call each: the append's conditional write, the read's peek (a read
    # takes no reservation: a worker killed in it leaves nothing to recover).
    assert calls.take() == {"save_if": 1, "peek": 1}


async def test_another_writer_since_sends_the_operation_through_a_reservation(
    two: tuple[Any, Any],
) -> None:
    """No lost update: the stale tail's write is refused, then made on the stored state."""
    mine, theirs = sessions_of(two)
    await mine.add_items([item(0)])
    assert await mine.get_items() == [item(0)]
    await theirs.add_items([item(1)])  # first's cached tail is stale now
    calls = Calls(two[0])
    await mine.add_items([item(2)])
    calls.refused_then_reserved()  # the stale tail wrote nothing
    assert await theirs.get_items() == [item(0), item(1), item(2)]
    assert await mine.get_items() == [item(0), item(1), item(2)]


async def test_a_session_held_elsewhere_refuses_and_keeps_the_holders_write(
    two: tuple[Any, Any],
) -> None:
    mine, holder = sessions_of(two)
    await mine.add_items([item(0)])
    assert await mine.get_items() == [item(0)]  # cached: the optimistic path is armed
    async with holder.exclusive():
        await holder.add_items([item(1)])
        with pytest.raises(DecisionHistoryBusy):
            await mine.add_items([item(2)])
        with pytest.raises(DecisionHistoryBusy):
            await mine.get_items()
    assert await mine.get_items() == [item(0), item(1)]


async def test_a_write_that_does_not_fit_is_refused_and_changes_nothing(
    store_factory: Factory,
) -> None:
    async with store_factory(max_store_bytes=64 * 1024) as store:
        session = ToubaSession("s1", store=store, namespace="ns")
        await session.add_items([item(n) for n in range(20)])
        before = await session.get_items()
        used = (await store.usage()).bytes
        with pytest.raises(DecisionHistoryLimitExceeded):
            await session.add_items([{"role": "user", "content": "y" * 80_000}])
        assert await session.get_items() == before
        assert (await store.usage()).bytes == used
        await session.add_items([item(99)])  # the path still works after a refusal
        assert await session.get_items() == [*before, item(99)]


async def test_interleaved_writers_lose_nothing(two: tuple[Any, Any]) -> None:
    """Two store objects taking turns on one session, each with a tail the other
    keeps making stale: every item lands once, in order."""
    sessions = sessions_of(two)
    for n in range(12):
        session = sessions[(n // 2) % 2]  # two in a row each: a hit, then a stale tail
        await session.add_items([item(n)])
        assert (await session.get_items())[-1] == item(n)
    expected = [item(n) for n in range(12)]
    assert await sessions[0].get_items() == expected
    assert await sessions[1].get_items() == expected


async def test_interleaved_adds_and_pops_keep_the_items_and_the_totals(
    two: tuple[Any, Any], backend: str
) -> None:
    """Two store objects adding and popping on one session in a pattern that
    leaves each one's tail stale at some pops and current at others: the items
    are those of one writer doing it all, and (SQLite and PostgreSQL, where a
    pop's drop is weighed from the cached tail) the recorded totals are the
    rows' own."""
    sessions = sessions_of(two)
    expected: list[Any] = []
    for n in range(24):
        session = sessions[(n // 3) % 2]
        if n % 3 == 2:
            assert await session.pop_item() == expected.pop()
        else:
            new = [item(n), item(100 + n)] if n % 4 == 0 else [item(n)]
            await session.add_items(new)
            expected += new
        assert await session.get_items() == expected
    assert await sessions[0].get_items() == expected
    assert await sessions[1].get_items() == expected
    if backend != "redis":  # where a pop's drop is weighed from the cached tail
        for store in two:
            messages, recorded, held = await totals(store, sessions[0].session_key)
            assert (messages, recorded) == (len(expected), held)
            assert (await store.usage()).bytes == held


async def test_a_head_edited_behind_touba_is_read_again_not_overwritten(
    store_factory: Factory, backend: str, private_dir: Any, store_name: str
) -> None:
    """The version only moves with touba's saves and the rows' triggers: a head
    changed by hand (here: the same value, other text) must send the operation
    through a reservation, which reads the head as stored."""
    async with store_factory() as store:
        session = ToubaSession("s1", store=store, namespace="ns")
        await session.add_items([item(0)])
        assert await session.get_items() == [item(0)]
        await _rewrite_head(backend, store, private_dir, store_name, session.session_key)
        calls = Calls(store)
        await session.add_items([item(1)])
        calls.refused_then_reserved()  # refused: the head is not the one cached
        assert await session.get_items() == [item(0), item(1)]


def _respelled(text: str) -> str:
    """Other text of the same JSON value."""
    return json.dumps(json.loads(text), indent=1)


async def _rewrite_head(backend: str, store: Any, directory: Any, name: str, key: str) -> None:
    """Store the head of ``key`` again as other text of the same JSON value."""
    respelled = _respelled
    if backend == "redis":
        client = store._client
        head = store._keys(key).all[4]
        await client.hset(head, "head", respelled((await client.hget(head, "head")).decode()))
        return
    if backend == "sqlite":
        with contextlib.closing(sqlite3.connect(directory / "history.sqlite")) as conn:
            (head,) = conn.execute(
                "SELECT head FROM touba_history_sessions WHERE key = ?", (key,)
            ).fetchone()
            conn.execute(
                "UPDATE touba_history_sessions SET head = ? WHERE key = ?", (respelled(head), key)
            )
            conn.commit()
        return
    import psycopg
    from psycopg import sql

    table = sql.Identifier(f"touba_integrations_{name}", "h")
    with psycopg.connect(postgres_dsn(), autocommit=True) as pg:
        row = pg.execute(sql.SQL("SELECT head FROM {} WHERE key = %s").format(table), (key,))
        (head,) = row.fetchone() or ("",)
        pg.execute(
            sql.SQL("UPDATE {} SET head = %s WHERE key = %s").format(table), (respelled(head), key)
        )


@pytest.mark.redis
async def test_a_row_edited_behind_touba_on_redis_is_read_again_not_built_on(
    redis_factory: Factory,
) -> None:
    """Redis: another client's LSET of a row changes no version; the optimistic
    script compares the rows the operation read: an append, which reads only the
    last exchange, stands; the next read of the window refuses, and the reserved
    path reads the row as it is now. (An edit also leaves the exchange's entry
    weighing its old bytes, so later optimistic reads of it keep being refused:
    slower, never wrong.)"""
    async with redis_factory() as store:
        session = ToubaSession("s1", store=store, namespace="ns")
        await session.add_items([item(0), item(1)])
        assert await session.get_items() == [item(0), item(1)]
        client, rows = store._client, store._keys(session.session_key).all[5]

        async def edit(index: int, content: str) -> None:
            exchange, _size, body = json.loads((await client.lindex(rows, index)).decode())
            text = json.dumps({**body, "content": content}, separators=(",", ":"))
            await client.lset(rows, index, f"[{exchange},{len(text.encode())},{text}]")

        calls = Calls(store)
        await edit(0, "first, edited")  # outside what an append reads
        await session.add_items([item(2)])
        assert calls.take() == {"save_if": 1}  # it stands
        first = {**item(0), "content": "first, edited"}
        assert await session.get_items() == [first, item(1), item(2)]
        # A read peeks, without a reservation: the rows as they are now, edit included.
        assert calls.take() == {"peek": 1}
        await edit(-1, "last, edited")  # what an append reads
        await session.add_items([item(3)])
        calls.refused_then_reserved()
        last = {**item(2), "content": "last, edited"}
        assert await session.get_items() == [first, item(1), last, item(3)]


@pytest.mark.redis
async def test_redis_reads_what_a_narrow_claim_left_unchecked_only_once_compared(
    redis_factory: Factory,
) -> None:
    """Redis: after a narrow claim (an append that found its tail stale reserves,
    and its claim brings only the last exchange), the window's older exchanges
    are held unchecked; an optimistic read may use them because its script
    compares every entry and row it read before writing, so it is one call when
    they are current and refused when one was edited. (A read of more than
    OPTIMISTIC_READ exchanges reserves instead: the last check.)"""
    async with redis_factory() as store, redis_factory() as other:
        session = ToubaSession("s1", store=store, namespace="ns")
        elsewhere = ToubaSession("s1", store=other, namespace="ns")
        await session.add_items([item(n) for n in range(30)])
        expected = [item(n) for n in range(30)]
        await session.get_items(limit=6)
        calls = Calls(store)
        for n in (100, 102):
            await elsewhere.add_items([item(n)])  # this store object's tail is stale now
            await session.add_items([item(n + 1)])  # refused, then a narrow claim
            expected += [item(n), item(n + 1)]
            assert calls.take().get("reserve") == 1
            assert await session.get_items(limit=6) == expected[-6:]
            assert calls.take() == {"peek": 1}  # one atomic read, no reservation
        client, rows = store._client, store._keys(session.session_key).all[5]
        at = len(expected) - 4  # in the window, outside what the append reads
        exchange, _size, body = json.loads((await client.lindex(rows, at)).decode())
        text = json.dumps({**body, "content": "edited"}, separators=(",", ":"))
        await client.lset(rows, at, f"[{exchange},{len(text.encode())},{text}]")
        expected[at] = {**expected[at], "content": "edited"}
        await elsewhere.add_items([item(104)])
        await session.add_items([item(105)])
        expected += [item(104), item(105)]
        calls.take()
        assert await session.get_items(limit=6) == expected[-6:]  # the edited row as it is
        assert calls.take() == {"peek": 1}
        await session.get_items(limit=20)
        await session.get_items(limit=20)
        assert set(calls.take()) == {"peek"}  # reads never reserve, however wide


async def _popped_in_one_call(store: Any) -> tuple[ToubaSession, Calls]:
    """A session of five items whose tail the store object holds, popped once:
    one optimistic call."""
    session = ToubaSession("s1", store=store, namespace="ns")
    await session.add_items([item(n) for n in range(5)])
    assert await session.get_items() == [item(n) for n in range(5)]
    calls = Calls(store)
    assert await session.pop_item() == item(4)
    assert calls.take() == {"save_if": 1}
    return session, calls


@pytest.mark.redis
async def test_redis_pops_in_one_call_and_never_drops_a_row_it_did_not_read(
    redis_factory: Factory,
) -> None:
    """Redis: a pop's drop is computed from the rows the tail holds, which the
    script compares (sizes included) before it trims: one call while they are
    current; an edit of the newest row sends the pop through a reservation,
    which pops the row as stored."""
    async with redis_factory() as store:
        session, calls = await _popped_in_one_call(store)
        assert await session.get_items() == [item(n) for n in range(4)]
        calls.take()
        client, rows = store._client, store._keys(session.session_key).all[5]
        exchange, _size, body = json.loads((await client.lindex(rows, -1)).decode())
        text = json.dumps({**body, "content": "edited"}, separators=(",", ":"))
        await client.lset(rows, -1, f"[{exchange},{len(text.encode())},{text}]")
        assert await session.pop_item() == {**item(3), "content": "edited"}
        calls.refused_then_reserved()  # refused: the row it would drop changed
        assert await session.get_items() == [item(n) for n in range(3)]
        usage = await store.usage()
        async with redis_factory() as fresh:  # the totals as a new store object reads them
            assert await ToubaSession("s1", store=fresh, namespace="ns").get_items() == [
                item(n) for n in range(3)
            ]
            assert (await fresh.usage()).bytes == usage.bytes


async def totals(store: Any, key: str) -> tuple[int, int, int]:
    """SQLite and PostgreSQL: the (messages, bytes) the session's row records, and
    the bytes its head and message rows actually hold (the messages counted too)."""
    if isinstance(store, SqliteHistoryStore):

        def read() -> tuple[int, int, int, int, int]:
            found = store._db.conn.execute(
                "SELECT s.messages, s.bytes, length(CAST(s.head AS BLOB)),"
                " count(m.id), coalesce(sum(m.bytes), 0) FROM touba_history_sessions AS s"
                " LEFT JOIN touba_history_messages AS m ON m.conv = s.id WHERE s.key = ?"
                " GROUP BY s.id",
                (key,),
            ).fetchone()
            return tuple(found)

        messages, size, head, rows, weight = await store._run(key, read)
    else:
        query = sql.SQL(
            "SELECT h.messages, h.bytes, octet_length(h.head), count(m.seq),"
            " coalesce(sum(m.bytes), 0) FROM {} AS h LEFT JOIN {} AS m ON m.key = h.key"
            " WHERE h.key = %s GROUP BY h.key"
        ).format(store._sql.table, store._sql.messages_table)
        async with await psycopg.AsyncConnection.connect(postgres_dsn()) as conn:
            cur = await conn.execute(query, (key,))
            messages, size, head, rows, weight = await cur.fetchone() or (0, 0, 0, 0, 0)
    assert messages == rows
    return messages, size, head + weight


async def respell(store: Any, key: str, seq: int, text: str, was: str) -> None:
    """Store row ``seq`` of ``key`` as ``text`` (it was ``was``), behind touba's back:
    its bytes and the session's total follow, and the version is cleared."""
    grown = len(text.encode()) - len(was.encode())
    if isinstance(store, SqliteHistoryStore):

        def write() -> None:
            conn = store._db.conn
            (conv,) = conn.execute(
                "SELECT id FROM touba_history_sessions WHERE key = ?", (key,)
            ).fetchone()
            conn.execute(
                "UPDATE touba_history_messages SET body = ?, bytes = ? WHERE conv = ? AND seq = ?",
                (text, len(text.encode()), conv, seq),
            )
            conn.execute(
                "UPDATE touba_history_sessions SET bytes = bytes + ? WHERE id = ?", (grown, conv)
            )

        await store._run(key, write)
        return
    t, m = store._sql.table, store._sql.messages_table
    async with await psycopg.AsyncConnection.connect(postgres_dsn(), autocommit=True) as conn:
        await conn.execute(
            sql.SQL("UPDATE {} SET body = %s, bytes = %s WHERE key = %s AND seq = %s").format(m),
            (text, len(text.encode()), key, seq),
        )
        await conn.execute(
            sql.SQL("UPDATE {} SET bytes = bytes + %s WHERE key = %s").format(t), (grown, key)
        )


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_pop_is_one_call_and_deletes_only_what_it_weighed(
    store_factory: Factory,
) -> None:
    """SQLite and PostgreSQL: a pop's drop is weighed from the tail the version
    proves current (each message as touba encodes it), and the save deletes only
    rows that weigh that: one call while they do. A row stored in another
    encoding (same message, other bytes; the version made again by a reservation
    since) leaves no version to trust: the pop is made under a reservation, which
    reads the stored sizes. The totals stay exact either way."""
    async with store_factory() as store:
        session, calls = await _popped_in_one_call(store)
        key = session.session_key
        messages, recorded, held = await totals(store, key)
        assert (messages, recorded) == (4, held)
        compact = json.dumps(item(3), separators=(",", ":"))
        await respell(store, key, 3, json.dumps(item(3), separators=(", ", ": ")), compact)
        assert await session.get_items() == [item(n) for n in range(4)]
        assert calls.take() == {"peek": 1}  # a read peeks: it reserves nothing
        assert await session.pop_item() == item(3)
        # The version the respelling cleared leaves no tail to trust: the pop is made
        # under a reservation, which reads the stored sizes.
        assert calls.take() == {"reserve": 1, "read_rows": 1, "save": 1}
        messages, recorded, held = await totals(store, key)
        assert (messages, recorded) == (3, held)
        assert await session.pop_item() == item(2)
        assert calls.take() == {"save_if": 1}  # cached again, at the stored sizes
        messages, recorded, held = await totals(store, key)
        assert (messages, recorded) == (2, held)
        assert (await store.usage()).bytes == held  # the store's one session


async def test_a_record_replaced_by_another_kind_is_refused_not_written_over(
    two: tuple[Any, Any],
) -> None:
    """The tail cached for a session proves nothing once another store object has
    put another kind of record under its key: every operation is refused with
    DecisionHistoryRecordInvalid (SPEC section 11) and that record stays as it was."""
    first, second = two
    session = ToubaSession("s1", store=first, namespace="ns")
    await session.add_items([item(0), item(1)])
    assert await session.get_items() == [item(0), item(1)]  # the optimistic path is armed
    foreign = {"kind": "someone-else", "data": 1}

    async def replace(_record: Any) -> tuple[Any, None]:
        return foreign, None

    await second.transact(session.session_key, replace)
    for operation in (session.add_items([item(2)]), session.get_items(), session.pop_item()):
        with pytest.raises(DecisionHistoryRecordInvalid):
            await operation
    assert await second.read(session.session_key) == foreign
