"""``LogWrite.drop_last``: the newest messages leave, exchanges left empty too, atomically."""

from __future__ import annotations

import copy
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.history._stores import Stores
from touba.errors import DecisionHistoryRecordInvalid
from touba.history import MemoryHistoryStore
from touba.history._common import encode_record
from touba.history._model import canonical_json
from touba.history._store import LogWrite, as_log_store, log_drops
from touba.history.sqlite import SqliteHistoryStore

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


@pytest.mark.parametrize("kind", ["memory", "whole", "sqlite"])
async def test_drop_last_removes_the_newest_messages(kind: str, tmp_path: Path) -> None:
    store: Any = WholeStore() if kind == "whole" else _store(kind, tmp_path)
    assert log_drops(store)
    log = as_log_store(store)
    await log.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
    await log.transact_log("k", write(drop_last=2, append=[(1, {"m": 4})]))
    read = store.read if kind != "whole" else None
    record = await read("k") if read else store.records["k"]
    assert record["exchanges"] == [[{"m": 1}], [{"m": 4}]]
    with pytest.raises(ValueError, match="fewer messages"):
        await log.transact_log("k", write(drop_last=3))
    record = await read("k") if read else store.records["k"]
    assert record["exchanges"] == [[{"m": 1}], [{"m": 4}]]  # a refusal changes nothing
    if kind != "whole":
        assert (await store.usage()).bytes == encode_record(record).bytes
        (row,) = await store.list()
        assert row.messages == 2
        await store.close()


def _store(kind: str, tmp_path: Path) -> Any:
    if kind == "memory":
        return MemoryHistoryStore()
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    return SqliteHistoryStore(directory / "h.sqlite")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_drop_empties_exchanges_and_the_next_write_sees_it(
    kind: str, tmp_path: Path
) -> None:
    store = _store(kind, tmp_path)
    async with store:
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


async def test_sqlite_refuses_a_drop_when_rows_changed_behind_it(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    path = directory / "h.sqlite"
    async with SqliteHistoryStore(path) as store:
        await store.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
        conn = sqlite3.connect(path, isolation_level=None)
        try:  # another program deletes the newest row; the head still counts it
            conn.execute("DELETE FROM touba_history_messages WHERE seq = 2")
        finally:
            conn.close()
        before = await store.read("k")
        with pytest.raises(DecisionHistoryRecordInvalid, match="changed behind touba"):
            await store.transact_log("k", write(drop_last=1))
        assert await store.read("k") == before  # nothing saved, and the key released


async def test_postgres_and_redis_do_not_claim_drops_and_refuse_them(durable: Stores) -> None:
    store = durable()
    if durable.kind == "sqlite":
        assert log_drops(store)
        return
    assert not log_drops(store)  # TODO(issue 11, phase B): drop_last there too
    await store.transact_log("k", write(append=[(0, {"m": 1})]))
    with pytest.raises(ValueError, match="only appends"):
        await store.transact_log("k", write(drop_last=1))
    assert (await store.read("k"))["exchanges"] == [[{"m": 1}]]
    await store.transact_log("k", write(append=[(0, {"m": 2})]))  # the key was released
