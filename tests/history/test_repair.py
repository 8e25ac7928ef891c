"""Damaged conversations are found, repaired, and accepted again.

Each kind of damage is made by writing raw rows into the real stores (a SQLite
file, a PostgreSQL table, a Redis list and hash; the RAM store's own entry):
``check_record`` over ``store.read_raw`` names it, ``plan_repair`` fixes it,
``store.repair`` writes the fix under a reservation, and then the whole record
passes the window check and a real decision (``ScriptedProvider``, through
``DecisionHistory.step``) is accepted. A healthy conversation checks clean and
its repair changes nothing; a reserved conversation, or one changed since its
plan, is refused with nothing written.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._services import postgres_dsn
from tests.history._stores import Stores, holding, state
from touba.errors import DecisionHistoryBusy, DecisionHistoryRecordInvalid
from touba.history import (
    HistoryConfig,
    Observation,
    RawConversation,
    check_record,
    plan_repair,
)
from touba.history._integrity import check_window
from touba.history._model import message_from_dict
from touba.history._repair import REPAIRED_ERROR, export_lines
from touba.providers import CapabilitySpec, Decision, DecisionRequest
from touba.testing import ScriptedProvider

NS = "repair"
LOOKUP = CapabilitySpec("lookup", "Find", {"type": "object", "properties": {}})
REFUND = CapabilitySpec("refund", "Refund", {"type": "object", "properties": {}})


def request(observations: Sequence[Observation] = ()) -> DecisionRequest:
    return DecisionRequest(
        run_id="r1",
        invocation_id="i1",
        agent_ref="support",
        instructions="Help with orders.",
        input="Where is my order?",
        capabilities=(LOOKUP, REFUND),
        observations=tuple(observations),
    )


def answer(decision: Decision) -> list[Observation]:
    return [Observation(c.call_id, c.name, c.arguments, "ok", "done") for c in decision.calls]


async def conversation(store: Any) -> tuple[ScriptedProvider, Decision, str]:
    """Three exchanges: [decision(lookup, refund), 2 results], [decision(lookup), result],
    [decision(refund)] awaiting its result. Returns the provider (one step left: a
    final answer), the last decision and the key."""
    provider = ScriptedProvider(
        ScriptedProvider.calls(("lookup", {}), ("refund", {})),
        ScriptedProvider.call("lookup"),
        ScriptedProvider.call("refund"),
        ScriptedProvider.final("done"),
        history=HistoryConfig(store=store, namespace=NS),
    )
    decision = await provider.decide(request())
    decision = await provider.decide(request(answer(decision)))
    decision = await provider.decide(request(answer(decision)))
    (row,) = await store.list()
    return provider, decision, row.key


# -- raw access to each store's rows --------------------------------------------------------


class Raw:
    """A conversation's stored rows and head, written behind the store's back."""

    def __init__(self, stores: Stores, store: Any, key: str) -> None:
        self.kind = stores.kind
        self.where = stores.location("main") if stores.kind != "memory" else ()
        self.store = store
        self.key = key

    async def rows(self) -> list[tuple[Any, int, str]]:
        """(handle, exchange, body) of every row, in order."""
        if self.kind == "memory":
            entry = self.store._entries[self.key]
            return [
                ((e, i), e, body)
                for e, ex in enumerate(entry.exchanges)
                for i, body in enumerate(ex)
            ]
        if self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                return conn.execute(
                    "SELECT id, exchange, body FROM touba_history_messages WHERE conv = "
                    "(SELECT id FROM touba_history_sessions WHERE key = ?) ORDER BY exchange, seq",
                    (self.key,),
                ).fetchall()
        if self.kind == "postgres":
            return await self._pg(
                "SELECT seq, exchange, body FROM {m} WHERE key = %s ORDER BY seq", (self.key,)
            )
        listed = await self.store._client.lrange(self.store._keys(self.key).messages, 0, -1)
        out = []
        for index, value in enumerate(listed):
            exchange, _size, message = json.loads(value)
            out.append((index, exchange, json.dumps(message, separators=(",", ":"))))
        return out

    async def find(self, exchange: int, kind: str, name: str | None = None) -> tuple[Any, str]:
        for handle, ex, body in await self.rows():
            message = json.loads(body)
            if ex == exchange and message["kind"] == kind and name in (None, message.get("name")):
                return handle, body
        raise AssertionError(f"no {kind} row in exchange {exchange}")

    async def set_body(self, handle: Any, exchange: int, body: str) -> None:
        if self.kind == "memory":
            self.store._entries[self.key].exchanges[handle[0]][handle[1]] = body
            self._touched()
        elif self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                conn.execute(
                    "UPDATE touba_history_messages SET body = ? WHERE id = ?", (body, handle)
                )
        elif self.kind == "postgres":
            await self._pg(
                "UPDATE {m} SET body = %s WHERE key = %s AND seq = %s", (body, self.key, handle)
            )
        else:
            row = f"[{exchange},{len(body.encode())},{body}]"
            await self.store._client.lset(self.store._keys(self.key).messages, handle, row)

    def _touched(self) -> None:
        """The RAM entry's parsed cache and sizes follow its edited texts."""
        from touba.history import ExchangeSize

        entry = self.store._entries[self.key]
        entry.parsed, entry.well_formed = {}, set()
        entry.sizes = [
            ExchangeSize(len(ex), sum(len(b.encode()) for b in ex)) for ex in entry.exchanges
        ]

    async def set_redis_row(self, handle: int, text: str) -> None:
        await self.store._client.lset(self.store._keys(self.key).messages, handle, text)

    async def delete(self, handle: Any) -> None:
        if self.kind == "memory":
            del self.store._entries[self.key].exchanges[handle[0]][handle[1]]
            self._touched()
        elif self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                conn.execute("DELETE FROM touba_history_messages WHERE id = ?", (handle,))
        elif self.kind == "postgres":
            await self._pg("DELETE FROM {m} WHERE key = %s AND seq = %s", (self.key, handle))
        else:
            name = self.store._keys(self.key).messages
            await self.store._client.lset(name, handle, "deleted")
            await self.store._client.lrem(name, 1, "deleted")

    async def head(self) -> dict[str, Any]:
        raw = await self.store.read_raw(self.key)
        assert raw is not None
        value: dict[str, Any] = json.loads(raw.head)
        return value

    async def set_head(self, head: dict[str, Any]) -> None:
        text = json.dumps(head, separators=(",", ":"))
        if self.kind == "memory":
            self.store._entries[self.key].head = text
        elif self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                conn.execute(
                    "UPDATE touba_history_sessions SET head = ? WHERE key = ?", (text, self.key)
                )
        elif self.kind == "postgres":
            await self._pg("UPDATE {t} SET head = %s WHERE key = %s", (text, self.key))
        else:
            await self.store._client.hset(self.store._keys(self.key).all[4], "head", text)

    async def _pg(self, statement: str, params: Sequence[Any]) -> list[Any]:
        import psycopg
        from psycopg import sql

        table = sql.Identifier(*self.where[1].split("."))
        messages = sql.Identifier(*f"{self.where[1]}_messages".split("."))
        with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
            cursor = conn.execute(sql.SQL(statement).format(t=table, m=messages), params)
            return cursor.fetchall() if cursor.description else []


# -- the damages ----------------------------------------------------------------------------


async def orphan_call(raw: Raw) -> None:
    handle, _ = await raw.find(0, "result", "refund")
    await raw.delete(handle)


async def result_without_call(raw: Raw) -> None:
    handle, body = await raw.find(1, "result")
    await raw.set_body(handle, 1, body.replace('"name":"lookup"', '"name":"forged"'))


async def duplicate_id(raw: Raw) -> None:
    _, decision = await raw.find(0, "decision")
    first = json.loads(decision)["calls"][0]
    handle, body = await raw.find(0, "result", "refund")
    copy = {**json.loads(body), "call_id": first["call_id"], "name": first["name"]}
    await raw.set_body(handle, 0, json.dumps(copy, separators=(",", ":")))


async def unreadable_row(raw: Raw) -> None:
    handle, _ = await raw.find(1, "result")
    await raw.set_body(handle, 1, '{"kind": "result", "call_id": ')


async def unreadable_framing(raw: Raw) -> None:
    """Redis only: the row's own ``[exchange,bytes,message]`` framing is broken."""
    handle, _ = await raw.find(1, "result")
    await raw.set_redis_row(handle, "not a row")


async def head_mismatch(raw: Raw) -> None:
    head = await raw.head()
    head["stats"] = {**head["stats"], "exchanges": head["stats"]["exchanges"] + 2}
    head["pending"] = []  # the last exchange's call no longer listed: it becomes an orphan
    await raw.set_head(head)


DAMAGES: dict[str, tuple[Callable[[Raw], Awaitable[None]], set[str]]] = {
    "orphan_call": (orphan_call, {"orphan_call"}),
    "result_without_call": (result_without_call, {"result_without_call", "orphan_call"}),
    "duplicate_id": (duplicate_id, {"duplicate_id", "orphan_call"}),
    "unreadable_row": (unreadable_row, {"unreadable_row", "orphan_call"}),
    "head_mismatch": (head_mismatch, {"head_mismatch", "orphan_call"}),
}


async def whole_window_passes(store: Any, key: str) -> None:
    """Every exchange of the stored record passes the pre-send window check (the last
    one, awaiting its results, once they are there: the decision below checks it)."""
    record = await store.read(key)
    exchanges = [[message_from_dict(m) for m in ex] for ex in record["exchanges"]]
    check_window(key, 0, exchanges[:-1] if record["pending"] else exchanges)


@pytest.mark.parametrize("damage", list(DAMAGES))
async def test_each_damage_is_found_repaired_and_accepted(stores: Stores, damage: str) -> None:
    store = stores("main")
    provider, last, key = await conversation(store)
    make, kinds = DAMAGES[damage]
    await make(Raw(stores, store, key))

    raw = await store.read_raw(key)
    assert raw is not None
    assert not raw.active
    found = {p.kind for p in check_record(raw)}
    assert kinds <= found, found
    plan = plan_repair(raw)
    assert plan.changes
    assert plan.unrepairable is None
    assert set(plan.kinds) == found
    if damage in ("orphan_call", "result_without_call", "duplicate_id", "unreadable_row"):
        # Stuck before. (The RAM store only ever holds text it encoded: an unreadable
        # row put there by hand fails its parse, untyped.)
        refused = (DecisionHistoryRecordInvalid, ValueError)
        with pytest.raises(refused if stores.kind == "memory" else DecisionHistoryRecordInvalid):
            await provider.decide(request(answer(last)))

    assert await store.repair(plan) is True
    repaired = await store.read_raw(key)
    assert repaired is not None
    assert check_record(repaired) == []
    await whole_window_passes(store, key)
    assert not (await store.list())[0].active

    observations = answer(last) if damage != "head_mismatch" else []
    decision = await provider.decide(request(observations))  # a real step is accepted
    assert decision.output == "done"
    sent = json.dumps(provider.sent[-1])
    if "orphan_call" in found:
        assert REPAIRED_ERROR in sent  # the model is told the call was not run
    assert check_record(await store.read_raw(key)) == []


@pytest.mark.redis
async def test_unreadable_row_framing_in_redis(tmp_path: Path) -> None:
    stores = Stores("redis", tmp_path)
    stores.prepare()
    try:
        store = stores("main")
        provider, last, key = await conversation(store)
        await unreadable_framing(Raw(stores, store, key))
        raw = await store.read_raw(key)
        assert raw is not None
        assert any(r.exchange is None for r in raw.rows)
        assert "unreadable_row" in {p.kind for p in check_record(raw)}
        assert await store.repair(plan_repair(raw)) is True
        assert check_record(await store.read_raw(key)) == []
        assert (await provider.decide(request(answer(last)))).output == "done"
    finally:
        await stores.cleanup()


async def test_a_healthy_conversation_checks_clean_and_repair_changes_nothing(
    stores: Stores,
) -> None:
    store = stores("main")
    _provider, _last, key = await conversation(store)
    raw = await store.read_raw(key)
    assert raw is not None
    assert check_record(raw) == []
    plan = plan_repair(raw)
    assert not plan.changes
    assert plan.problems == ()
    before = await state(store)
    assert await store.repair(plan) is False
    assert await state(store) == before
    assert await store.read_raw(key) == raw


async def test_repair_is_refused_on_an_active_reservation(stores: Stores) -> None:
    store = stores("main")
    _provider, _last, key = await conversation(store)
    await orphan_call(Raw(stores, store, key))
    plan = plan_repair(await store.read_raw(key))
    task, leave = await holding(store, key, lambda record: (record, None))
    try:
        held = await store.read_raw(key)  # a check still reads it, and says it is held
        assert held is not None
        assert held.active
        with pytest.raises(DecisionHistoryBusy):
            await store.repair(plan)
    finally:
        leave.set()
        await task
    raw = await store.read_raw(key)
    assert raw is not None
    assert "orphan_call" in {p.kind for p in check_record(raw)}


async def test_repair_is_refused_when_the_conversation_changed_since_its_plan(
    stores: Stores,
) -> None:
    store = stores("main")
    provider, last, key = await conversation(store)
    await orphan_call(Raw(stores, store, key))
    plan = plan_repair(await store.read_raw(key))
    head = await Raw(stores, store, key).head()
    head["updated_at"] = "2000-01-01T00:00:00+00:00"  # another writer since the plan
    await Raw(stores, store, key).set_head(head)
    changed = await store.read_raw(key)
    with pytest.raises(DecisionHistoryBusy, match="changed since it was checked"):
        await store.repair(plan)
    assert await store.read_raw(key) == changed
    assert not (await store.list())[0].active
    del provider, last


async def test_an_unreadable_head_is_reported_and_not_rebuilt(stores: Stores) -> None:
    store = stores("main")
    _provider, _last, key = await conversation(store)
    raw = await store.read_raw(key)
    assert raw is not None
    broken = RawConversation(
        key, "[not a head", raw.split, raw.rows, raw.exchanges, raw.messages, raw.bytes
    )
    plan = plan_repair(broken)
    assert [p.kind for p in plan.problems] == ["head_mismatch"]
    assert plan.record is None
    assert plan.unrepairable is not None
    assert "delete it" in plan.unrepairable


def test_the_export_keeps_the_original_record_and_unreadable_rows() -> None:
    from touba.history import raw_of_record

    record = {
        "kind": "touba.decision_history",
        "version": 1,
        "identity": {
            "namespace": "n",
            "provider": "p",
            "model": "m",
            "decision_interface": "native",
            "run_id": "r",
            "invocation_id": "i",
            "agent_ref": "a",
        },
        "pending": [],
        "summary": None,
        "stats": {"exchanges": 1, "messages": 1, "bytes": 1},
        "exchanges": [[{"kind": "decision", "calls": [{"call_id": "a", "name": "x"}]}]],
    }
    raw = raw_of_record("k", record)
    garbled = RawConversation(
        "k", raw.head, True, (*raw.rows, type(raw.rows[0])(0, 3, "{x")), 1, 2, raw.bytes
    )
    plan = plan_repair(garbled)
    lines = [json.loads(line) for line in export_lines(plan, touba_version="9", created_at="t")]
    assert lines[0] == {
        "format": "touba-export",
        "version": 1,
        "touba": "9",
        "created_at": "t",
        "selection": {"conversation": "k"},
    }
    assert lines[1]["kind"] == "conversation"
    assert lines[1]["key"] == "k"
    assert lines[1]["identity"] == record["identity"]
    assert lines[1]["record"]["exchanges"] == record["exchanges"]
    assert lines[1]["raw_rows"] == ["{x"]
    assert lines[2] == {"kind": "end", "records": 1}
    event = plan.event().to_dict()
    assert event["kind"] == "history_repaired"
    assert "unreadable_row" in event["repaired_kinds"]
    assert "orphan_call" in event["repaired_kinds"]
    assert "{x" not in json.dumps(event)  # no content
