"""``LogWrite.drop_last``: the newest messages leave, exchanges left empty too, atomically."""

from __future__ import annotations

import copy
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.history._stores import Stores
from touba.errors import DecisionHistoryRecordInvalid
from touba.history._common import encode_record
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


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def dropping(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """Each built-in store that honours drop_last (RAM, SQLite, PostgreSQL)."""
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


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_drop_is_refused_when_rows_changed_behind_it(kind: str, tmp_path: Path) -> None:
    built = Stores(kind, tmp_path)
    built.prepare()
    try:
        store = built()
        await store.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
        _delete_newest(built)  # another program deletes the newest row; the head counts it
        before = await store.read("k")
        with pytest.raises(DecisionHistoryRecordInvalid, match="changed behind touba"):
            await store.transact_log("k", write(drop_last=1))
        assert await store.read("k") == before  # nothing saved, and the key released
    finally:
        await built.cleanup()


def _delete_newest(built: Stores) -> None:
    where = built.location("main")
    if built.kind == "sqlite":
        conn = sqlite3.connect(where[0], isolation_level=None)
        try:
            conn.execute("DELETE FROM touba_history_messages WHERE seq = 2")
        finally:
            conn.close()
        return
    import psycopg
    from psycopg import sql

    schema, table = where[1].split(".")
    with psycopg.connect(where[0], autocommit=True) as pg:
        messages = sql.Identifier(schema, f"{table}_messages")
        pg.execute(sql.SQL("DELETE FROM {} WHERE seq = 2").format(messages))


async def test_each_durable_store_says_whether_it_drops_and_redis_refuses(
    durable: Stores,
) -> None:
    store = durable()
    if durable.kind != "redis":  # their drops are tested above
        assert log_drops(store)
        return
    assert not log_drops(store)  # TODO(issue 11, phase B): drop_last there too
    await store.transact_log("k", write(append=[(0, {"m": 1})]))
    with pytest.raises(ValueError, match="only appends"):
        await store.transact_log("k", write(drop_last=1))
    assert (await store.read("k"))["exchanges"] == [[{"m": 1}]]
    await store.transact_log("k", write(append=[(0, {"m": 2})]))  # the key was released
