"""``LogWrite.drop_last``: the newest messages leave, exchanges left empty too, atomically."""

from __future__ import annotations

import asyncio
import copy
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.history._stores import DURABLE, KINDS, Stores
from touba.errors import DecisionHistoryRecordInvalid
from touba.history._common import encode_record
from touba.history._memory import MemoryHistoryStore
from touba.history._model import canonical_json
from touba.history._store import LogWrite, as_log_store, log_drops

HEAD = {"kind": "touba.test", "version": 1}


class WholeStore:
    """A custom adapter offering only ``transact`` (a dict in RAM)."""

    def __init__(self) -> None:
        self.records: dict[str, Any] = {}

    async def transact(self, key: str, operation: Any) -> Any:
        record, result = await operation(copy.deepcopy(self.records.get(key)))
        if record is None:
            self.records.pop(key, None)
        else:
            self.records[key] = record
        return result


def write(**kwargs: Any) -> Any:
    async def operation(snapshot: Any, usage: Any) -> tuple[LogWrite, None]:
        return LogWrite(head=dict(HEAD), **kwargs), None

    return operation


@pytest.fixture(params=KINDS)
async def dropping(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """Each built-in store (all honour drop_last)."""
    built = Stores(request.param, tmp_path)
    built.prepare()
    yield built
    await built.cleanup()


async def test_drop_last_through_a_custom_adapter() -> None:
    store = WholeStore()
    assert log_drops(store)
    log = as_log_store(store)
    await log.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
    await log.transact_log("k", write(drop_last=2, append=[(1, {"m": 4})]))
    assert store.records["k"]["exchanges"] == [[{"m": 1}], [{"m": 4}]]
    with pytest.raises(ValueError, match="fewer messages"):
        await log.transact_log("k", write(drop_last=3))
    assert store.records["k"]["exchanges"] == [[{"m": 1}], [{"m": 4}]]


async def test_drop_last_removes_the_newest_messages(dropping: Stores) -> None:
    store = dropping()
    assert log_drops(store)
    await store.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
    await store.transact_log("k", write(drop_last=2, append=[(1, {"m": 4})]))
    record = await store.read("k")
    assert record["exchanges"] == [[{"m": 1}], [{"m": 4}]]
    with pytest.raises(ValueError, match="fewer messages"):
        await store.transact_log("k", write(drop_last=3))
    assert await store.read("k") == record  # a refusal changes nothing
    assert (await store.usage()).bytes == encode_record(record).bytes
    (row,) = await store.list()
    assert row.messages == 2
    await store.transact_log("k", write(drop_last=0))  # nothing dropped; the key was released
    assert await store.read("k") == record


async def test_a_drop_empties_exchanges_and_the_next_write_sees_it(dropping: Stores) -> None:
    store = dropping()
    await store.transact_log("k", write(append=[(0, {"m": 1}), (0, {"m": 2})]))
    await store.transact_log("k", write(append=[(1, {"m": 3}), (2, {"m": 4})]))
    await store.transact_log("k", write(drop_last=3))  # exchanges 2 and 1 go, 0 keeps one
    seen: list[Any] = []

    async def look(snapshot: Any, usage: Any) -> tuple[LogWrite, None]:
        sizes = await snapshot.sizes(0)
        seen.append((snapshot.exchange_count, [(s.messages, s.bytes) for s in sizes]))
        seen.append(await snapshot.exchanges(0, snapshot.exchange_count))
        return LogWrite(head=dict(HEAD), append=[(1, {"m": 5})]), None

    await store.transact_log("k", look)
    one = len(canonical_json({"m": 1}))
    assert seen == [(1, [(1, one)]), [[{"m": 1}]]]
    record = await store.read("k")
    assert record["exchanges"] == [[{"m": 1}], [{"m": 5}]]
    assert (await store.usage()).bytes == encode_record(record).bytes


async def test_dropping_every_message_leaves_an_empty_log(dropping: Stores) -> None:
    store = dropping()
    await store.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2})]))
    await store.transact_log("k", write(drop_last=2))
    record = await store.read("k")
    assert record["exchanges"] == []
    assert (await store.usage()).bytes == encode_record(record).bytes
    await store.transact_log("k", write(append=[(0, {"m": 3})]))  # it grows again from 0
    assert (await store.read("k"))["exchanges"] == [[{"m": 3}]]


@pytest.mark.parametrize("kind", DURABLE)
async def test_a_drop_is_refused_when_rows_changed_behind_it(kind: str, tmp_path: Path) -> None:
    built = Stores(kind, tmp_path)
    built.prepare()
    try:
        store = built()
        await store.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
        await _delete_newest(built)  # another program deletes the newest row; the head counts it
        before = await store.read("k")
        with pytest.raises(DecisionHistoryRecordInvalid, match="changed behind touba"):
            await store.transact_log("k", write(drop_last=1))
        assert await store.read("k") == before  # nothing saved, and the key released
    finally:
        await built.cleanup()


def test_the_sqlite_drop_finds_the_newest_rows_by_the_index(tmp_path: Path) -> None:
    """A drop deletes through the tail index from the first dropped exchange on,
    not by scanning every row of the conversation."""
    from touba.history import sqlite

    store = sqlite.SqliteHistoryStore(tmp_path / "h.sqlite")
    try:
        explain = "EXPLAIN QUERY PLAN " + sqlite._DROP_NEWEST
        plan = store._thread.call(lambda: store._db.conn.execute(explain, (1, 2, 3)).fetchall())
        (detail,) = [row[-1] for row in plan]
        assert "INDEX touba_history_messages_tail (conv=? AND exchange>?)" in detail
    finally:
        asyncio.run(store.close())


async def _delete_newest(built: Stores) -> None:
    where = built.location("main")
    if built.kind == "sqlite":
        conn = sqlite3.connect(where[0], isolation_level=None)
        try:
            conn.execute("DELETE FROM touba_history_messages WHERE seq = 2")
        finally:
            conn.close()
        return
    if built.kind == "redis":
        from redis.asyncio import Redis

        client = Redis.from_url(where[0])
        try:
            (messages,) = [k async for k in client.scan_iter(match=f"{where[1]}*:messages")]
            assert await client.rpop(messages) is not None
        finally:
            await client.aclose()
        return
    import psycopg
    from psycopg import sql

    schema, table = where[1].split(".")
    with psycopg.connect(where[0], autocommit=True) as pg:
        messages = sql.Identifier(schema, f"{table}_messages")
        pg.execute(sql.SQL("DELETE FROM {} WHERE seq = 2").format(messages))


async def test_a_backend_that_only_appends_refuses_a_drop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protocol refuses drop_last for a backend without ``drops`` (a new one,
    say), before anything is written, and releases the key."""
    from touba.history import sqlite

    monkeypatch.delattr(sqlite._Backend, "drops")
    store = sqlite.SqliteHistoryStore(tmp_path / "h.sqlite")
    try:
        await store.transact_log("k", write(append=[(0, {"m": 1})]))
        with pytest.raises(ValueError, match="only appends"):
            await store.transact_log("k", write(drop_last=1))
        assert await store.read("k") == {**HEAD, "exchanges": [[{"m": 1}]]}
        await store.transact_log("k", write(append=[(0, {"m": 2})]))  # the key was released
    finally:
        await store.close()


# Steps of a log: drop that many newest messages, then append (0: into the last
# exchange, 1: a new one) messages of one text each.
STEPS = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.lists(st.tuples(st.integers(0, 1), st.text(max_size=6)), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.parametrize("kind", DURABLE)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS)
def test_drops_and_appends_leave_what_the_ram_store_leaves(
    kind: str, steps: list[Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any mix of drops and appends: the same record, bytes and refusals as RAM, and
    the same snapshots (the durable store's from the tail it keeps across drops)."""

    async def run() -> None:
        built = Stores(kind, tmp_path_factory.mktemp(kind))
        built.prepare()
        try:
            reference, store = MemoryHistoryStore(), built()
            for drop, appends in steps:
                outcomes = []
                seen: list[Any] = []
                for each in (reference, store):

                    async def step(
                        snapshot: Any,
                        usage: Any,
                        drop: int = drop,
                        appends: Any = appends,
                        seen: list[Any] = seen,
                    ) -> tuple[LogWrite, None]:
                        kept = 0 if snapshot is None else snapshot.exchange_count
                        if snapshot is not None:
                            sizes = [(s.messages, s.bytes) for s in await snapshot.sizes(0)]
                            seen.append((kept, sizes, await snapshot.exchanges(0, kept)))
                        left = drop  # the exchanges the drop leaves: their appends are valid
                        for size in reversed(await snapshot.sizes(0) if snapshot else []):
                            if not 0 < size.messages <= left:
                                break
                            left, kept = left - size.messages, kept - 1
                        append = []
                        for new, text in appends:
                            kept += bool(new or not kept)
                            append.append((kept - 1, {"m": text}))
                        return LogWrite(head=dict(HEAD), drop_last=drop, append=append), None

                    try:
                        await each.transact_log("k", step)
                        outcomes.append("ok")
                    except ValueError as e:
                        outcomes.append(type(e).__name__)
                assert outcomes[0] == outcomes[1]
                assert seen[:1] == seen[1:]
                record = await reference.read("k")
                assert await store.read("k") == record
                assert (await store.usage()).bytes == (await reference.usage()).bytes
        finally:
            await built.cleanup()

    asyncio.run(run())
