"""``LogWrite.drop_last``: the newest messages leave, exchanges left empty too, atomically."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from touba.history import MemoryHistoryStore
from touba.history._common import encode_record
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


@pytest.mark.parametrize("kind", ["memory", "whole"])
async def test_drop_last_removes_the_newest_messages(kind: str) -> None:
    store: Any = MemoryHistoryStore() if kind == "memory" else WholeStore()
    assert log_drops(store)
    log = as_log_store(store)
    await log.transact_log("k", write(append=[(0, {"m": 1}), (1, {"m": 2}), (1, {"m": 3})]))
    await log.transact_log("k", write(drop_last=2, append=[(1, {"m": 4})]))
    read = store.read if kind == "memory" else None
    record = await read("k") if read else store.records["k"]
    assert record["exchanges"] == [[{"m": 1}], [{"m": 4}]]
    with pytest.raises(ValueError, match="fewer messages"):
        await log.transact_log("k", write(drop_last=3))
    record = await read("k") if read else store.records["k"]
    assert record["exchanges"] == [[{"m": 1}], [{"m": 4}]]  # a refusal changes nothing
    if kind == "memory":
        assert (await store.usage()).bytes == encode_record(record).bytes
        (row,) = await store.list()
        assert row.messages == 2


async def test_durable_stores_do_not_claim_drops(tmp_path: Any) -> None:
    from touba.history.sqlite import SqliteHistoryStore

    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    async with SqliteHistoryStore(directory / "h.sqlite") as store:
        assert not log_drops(store)  # TODO(issue 11, phase B): drop_last on durable stores
