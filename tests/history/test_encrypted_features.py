"""Repair, copy, export/import, fork and erase on decision-history stores encrypted at rest
(SQLite, PostgreSQL, Redis), each behaving exactly as on a plain store.

Each value is sealed for its conversation key and position, so every reader outside the
decision path (``read_raw``, ``read_saved``, the export and copy readers, ``fork``) must
open what it reads, and every writer must seal for the value's new place. What is
checked: a check of a healthy sealed conversation reports nothing (its rows open); a
sealed row bit-flipped, or replaced by plaintext, is an ``unreadable_row`` and never
read as plaintext; each repair writes sealed rows a decision then accepts; copies,
imports and forks into an encrypted store hold no plaintext and read back equal; an
erase leaves nothing. Damage is made by hand in the store itself (SQL, Redis commands),
sealed with the store's own sealer where the damage is one a bug could have written.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import touba
from tests.history._stores import DURABLE, Stores, holding
from tests.history.test_encryption_stores import MARKER, converse, flip, raw_values
from tests.history.test_repair import answer, conversation, request
from tests.history.test_repair import whole_window_passes as window_passes
from touba.data import Stores as Deployment
from touba.data import copy_stores, erase_user, import_records, verify_copy, verify_erased
from touba.data._export import write_export
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    check_record,
    plan_repair,
)
from touba.history._repair import REPAIRED_ERROR


def sealing() -> touba.Encryption:
    return touba.Encryption(keys={"k1": bytes(32)}, current="k1")


def who(run: str, n: int = 1) -> ConversationIdentity:
    return ConversationIdentity("n", "openai", "m", "native", run, f"i{n}", "agent")


@pytest.fixture(params=DURABLE)
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    built = Stores(request.param, tmp_path)
    built.prepare()
    yield built
    await built.cleanup()


async def stored(stores: Stores, store: Any, name: str = "main") -> list[str]:
    """Every head and message body the store ``name`` keeps, as stored (a Redis row's
    ``[exchange,bytes,body]`` framing taken off)."""
    if stores.kind == "sqlite":
        with sqlite3.connect(stores.location(name)[0]) as conn:
            heads = [r[0] for r in conn.execute("SELECT head FROM touba_history_sessions")]
            bodies = [r[0] for r in conn.execute("SELECT body FROM touba_history_messages")]
        return [v for v in heads + bodies if v is not None]
    if stores.kind == "postgres":
        return await raw_values(stores, store)
    client, out = store._client, []
    async for found in client.scan_iter(match=stores.location(name)[1] + "*"):
        name_ = found
        kind = (await client.type(name_)).decode()
        if kind == "hash":
            head = await client.hget(name_, "head")
            out += [head.decode()] if head is not None else []
        elif kind == "list":
            for value in await client.lrange(name_, 0, -1):
                parts = value.decode()[1:-1].split(",", 2)
                out += [parts[2]] if len(parts) == 3 else []
    return out


async def all_sealed(stores: Stores, store: Any, name: str = "main") -> bool:
    values = await stored(stores, store, name)
    return bool(values) and all(touba.Encryption.is_sealed(v) for v in values)


# -- sealed damage, written behind the store's back ----------------------------------------


class Sealed:
    """One conversation's rows in an encrypted store: read opened, written sealed."""

    def __init__(self, stores: Stores, store: Any, key: str) -> None:
        self.kind, self.stores, self.store, self.key = stores.kind, stores, store, key
        self.sealer = store._sealer

    async def rows(self) -> list[tuple[int, int, str]]:
        """(seq, exchange, stored token) of every row, in position order."""
        if self.kind == "sqlite":
            return self._sqlite(
                "SELECT seq, exchange, body FROM touba_history_messages WHERE conv = "
                "(SELECT id FROM touba_history_sessions WHERE key = ?) ORDER BY seq",
                self.key,
            )
        if self.kind == "postgres":
            return await self._pg(
                "SELECT seq, exchange, body FROM {m} WHERE key = %s ORDER BY seq", self.key
            )
        listed = await self.store._client.lrange(self.store._keys(self.key).messages, 0, -1)
        out = []
        for seq, value in enumerate(listed):
            exchange, _size, token = value.decode()[1:-1].split(",", 2)
            out.append((seq, int(exchange), token))
        return out

    async def find(self, exchange: int, kind: str, name: str | None = None) -> tuple[int, str]:
        """The seq and plaintext of the first such message."""
        for seq, ex, token in await self.rows():
            text = self.sealer.open_body(self.key, seq, token)
            message = json.loads(text)
            if ex == exchange and message["kind"] == kind and name in (None, message.get("name")):
                return seq, text
        raise AssertionError(f"no {kind} row in exchange {exchange}")

    async def put(self, seq: int, exchange: int, text: str) -> None:
        """Message ``seq`` replaced by ``text``, sealed for its place."""
        await self.put_raw(seq, exchange, self.sealer.seal_body(self.key, seq, text), text)

    async def put_raw(self, seq: int, exchange: int, value: str, plain: str) -> None:
        size = len(plain.encode())
        if self.kind == "sqlite":
            self._sqlite(
                "UPDATE touba_history_messages SET body = ?, bytes = ? WHERE seq = ? AND conv = "
                "(SELECT id FROM touba_history_sessions WHERE key = ?)",
                value,
                size,
                seq,
                self.key,
            )
        elif self.kind == "postgres":
            await self._pg(
                "UPDATE {m} SET body = %s, bytes = %s WHERE key = %s AND seq = %s",
                value,
                size,
                self.key,
                seq,
            )
        else:
            name = self.store._keys(self.key).messages
            await self.store._client.lset(name, seq, f"[{exchange},{size},{value}]")

    async def delete(self, seq: int) -> None:
        """Row ``seq`` deleted, the later rows moved up one place (re-sealed there)."""
        later = [r for r in await self.rows() if r[0] > seq]
        opened = [(s, e, self.sealer.open_body(self.key, s, t)) for s, e, t in later]
        if self.kind == "sqlite":
            self._sqlite(
                "DELETE FROM touba_history_messages WHERE seq = ? AND conv = "
                "(SELECT id FROM touba_history_sessions WHERE key = ?)",
                seq,
                self.key,
            )
            for s, _e, _t in later:
                self._sqlite(
                    "UPDATE touba_history_messages SET seq = seq - 1 WHERE seq = ? AND conv = "
                    "(SELECT id FROM touba_history_sessions WHERE key = ?)",
                    s,
                    self.key,
                )
        elif self.kind == "postgres":
            await self._pg("DELETE FROM {m} WHERE key = %s AND seq = %s", self.key, seq)
            for s, _e, _t in later:
                await self._pg(
                    "UPDATE {m} SET seq = seq - 1 WHERE key = %s AND seq = %s", self.key, s
                )
        else:
            name = self.store._keys(self.key).messages
            await self.store._client.lset(name, seq, "deleted")
            await self.store._client.lrem(name, 1, "deleted")
        for s, e, text in opened:
            await self.put(s - 1, e, text)

    async def head(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.sealer.open_head(self.key, await self._head()))
        return value

    async def set_head(self, head: dict[str, Any]) -> None:
        text = json.dumps(head, separators=(",", ":"))
        token = self.sealer.seal_head(self.key, text)
        if self.kind == "sqlite":
            self._sqlite(
                "UPDATE touba_history_sessions SET head = ? WHERE key = ?", token, self.key
            )
        elif self.kind == "postgres":
            await self._pg("UPDATE {t} SET head = %s WHERE key = %s", token, self.key)
        else:
            await self.store._client.hset(self.store._keys(self.key).all[4], "head", token)

    async def _head(self) -> str:
        if self.kind == "sqlite":
            return str(
                self._sqlite("SELECT head FROM touba_history_sessions WHERE key = ?", self.key)[0][
                    0
                ]
            )
        if self.kind == "postgres":
            return str((await self._pg("SELECT head FROM {t} WHERE key = %s", self.key))[0][0])
        value = await self.store._client.hget(self.store._keys(self.key).all[4], "head")
        return str(value.decode())

    def _sqlite(self, statement: str, *args: Any) -> list[Any]:
        with sqlite3.connect(self.stores.location("main")[0]) as conn:
            return conn.execute(statement, args).fetchall()

    async def _pg(self, template: str, *args: Any) -> list[Any]:
        from psycopg import sql

        *schema, name = self.store.table.split(".")
        t, m = sql.Identifier(*schema, name), sql.Identifier(*schema, f"{name}_messages")
        async with self.store._pg.call() as conn:
            cursor = await conn.execute(sql.SQL(template).format(t=t, m=m), args)
            return await cursor.fetchall() if cursor.description else []


async def orphan_call(raw: Sealed) -> None:
    seq, _ = await raw.find(0, "result", "refund")
    await raw.delete(seq)


async def result_without_call(raw: Sealed) -> None:
    seq, text = await raw.find(1, "result")
    await raw.put(seq, 1, text.replace('"name":"lookup"', '"name":"forged"'))


async def duplicate_id(raw: Sealed) -> None:
    _, decision = await raw.find(0, "decision")
    first = json.loads(decision)["calls"][0]
    seq, text = await raw.find(0, "result", "refund")
    copy = {**json.loads(text), "call_id": first["call_id"], "name": first["name"]}
    await raw.put(seq, 0, json.dumps(copy, separators=(",", ":")))


async def bit_flipped_row(raw: Sealed) -> None:
    seq, text = await raw.find(1, "result")
    token = next(t for s, _e, t in await raw.rows() if s == seq)
    await raw.put_raw(seq, 1, flip(token), text)


async def plaintext_row(raw: Sealed) -> None:
    """A well-formed message written unsealed: never read as plaintext."""
    seq, text = await raw.find(1, "result")
    await raw.put_raw(seq, 1, text, text)


async def moved_row(raw: Sealed) -> None:
    """The sealed row before it copied over it: it does not open at that place."""
    seq, text = await raw.find(1, "result")
    rows = {s: (e, t) for s, e, t in await raw.rows()}
    await raw.put_raw(seq, 1, rows[seq - 1][1], text)


async def head_mismatch(raw: Sealed) -> None:
    head = await raw.head()
    head["stats"] = {**head["stats"], "exchanges": head["stats"]["exchanges"] + 2}
    head["pending"] = []
    await raw.set_head(head)


DAMAGES: dict[str, tuple[Callable[[Sealed], Awaitable[None]], set[str]]] = {
    "orphan_call": (orphan_call, {"orphan_call"}),
    "result_without_call": (result_without_call, {"result_without_call", "orphan_call"}),
    "duplicate_id": (duplicate_id, {"duplicate_id", "orphan_call"}),
    "bit_flipped_row": (bit_flipped_row, {"unreadable_row", "orphan_call"}),
    "plaintext_row": (plaintext_row, {"unreadable_row", "orphan_call"}),
    "moved_row": (moved_row, {"unreadable_row", "orphan_call"}),
    "head_mismatch": (head_mismatch, {"head_mismatch", "orphan_call"}),
}


# -- 1. repair ------------------------------------------------------------------------------


async def test_a_healthy_encrypted_conversation_checks_clean(durable: Stores) -> None:
    store = durable("main", encryption=sealing())
    _provider, _last, key = await conversation(store)
    raw = await store.read_raw(key)
    assert raw is not None
    assert json.loads(raw.head)["identity"]["namespace"] == "repair"  # opened, not a token
    assert all(json.loads(row.body)["kind"] for row in raw.rows)
    assert check_record(raw) == []
    plan = plan_repair(raw)
    assert not plan.changes
    assert await store.repair(plan) is False
    assert await store.read_raw(key) == raw
    assert await all_sealed(durable, store)


@pytest.mark.parametrize("damage", list(DAMAGES))
async def test_each_damage_of_an_encrypted_conversation_is_repaired_sealed(
    durable: Stores, damage: str
) -> None:
    store = durable("main", encryption=sealing())
    provider, last, key = await conversation(store)
    make, kinds = DAMAGES[damage]
    await make(Sealed(durable, store, key))

    raw = await store.read_raw(key)
    assert raw is not None
    found = {p.kind for p in check_record(raw)}
    assert kinds <= found, found
    if "unreadable_row" in kinds:
        # only the damaged row: the rows that open are not called unreadable
        assert [p.kind for p in check_record(raw)].count("unreadable_row") == 1
    plan = plan_repair(raw)
    assert plan.changes
    assert plan.unrepairable is None
    if damage == "plaintext_row":  # kept as stored text, marked: never parsed as a message
        assert all(r.startswith("not sealed: ") for r in plan.removed_rows[:1])

    assert await store.repair(plan) is True
    assert await all_sealed(durable, store)  # the repair wrote sealed rows
    fresh = durable("main", encryption=sealing())  # another worker reads it
    repaired = await fresh.read_raw(key)
    assert repaired is not None
    assert check_record(repaired) == []
    await window_passes(fresh, key)

    observations = answer(last) if damage != "head_mismatch" else []
    decision = await provider.decide(request(observations))
    assert decision.output == "done"
    if "orphan_call" in found:
        assert REPAIRED_ERROR in json.dumps(provider.sent[-1])
    assert check_record(await store.read_raw(key)) == []
    assert await all_sealed(durable, store)


async def test_a_head_that_does_not_open_is_unrepairable_and_kept(durable: Stores) -> None:
    store = durable("main", encryption=sealing())
    _provider, _last, key = await conversation(store)
    sealed = Sealed(durable, store, key)
    head = await sealed._head()
    if durable.kind == "sqlite":
        sealed._sqlite("UPDATE touba_history_sessions SET head = ? WHERE key = ?", flip(head), key)
    elif durable.kind == "postgres":
        await sealed._pg("UPDATE {t} SET head = %s WHERE key = %s", flip(head), key)
    else:
        await store._client.hset(store._keys(key).all[4], "head", flip(head))
    raw = await store.read_raw(key)
    assert raw is not None
    plan = plan_repair(raw)
    assert plan.unrepairable is not None
    assert {p.kind for p in plan.problems} == {"head_mismatch"}
    before = await stored(durable, store)
    assert await store.repair(plan) is False
    assert await stored(durable, store) == before


# -- 2. copy ------------------------------------------------------------------------------

PG, REDIS = pytest.mark.postgres, pytest.mark.redis
COPIES = [
    pytest.param(("sqlite", False), ("postgres", True), marks=PG, id="sqlite->enc-pg"),
    pytest.param(("postgres", True), ("sqlite", False), marks=PG, id="enc-pg->sqlite"),
    pytest.param(("sqlite", True), ("redis", False), marks=REDIS, id="enc-sqlite->redis"),
    pytest.param(("sqlite", False), ("redis", True), marks=REDIS, id="sqlite->enc-redis"),
    pytest.param(("redis", True), ("sqlite", True), marks=REDIS, id="enc-redis->enc-sqlite"),
]


@pytest.mark.parametrize(("source", "target"), COPIES)
async def test_copy_between_plain_and_encrypted_stores_verifies_clean(
    tmp_path: Path, source: tuple[str, bool], target: tuple[str, bool]
) -> None:
    places = []
    for n, (kind, _sealed) in enumerate((source, target)):
        (tmp_path / str(n)).mkdir()
        places.append(Stores(kind, tmp_path / str(n)))
        places[-1].prepare()
    try:
        a = places[0]("main", encryption=sealing() if source[1] else None)
        b = places[1]("main", encryption=sealing() if target[1] else None)
        first, second = who("r1", 1), who("r2", 2)
        await converse(a, first, 3)
        await converse(a, second, 2)
        origin, destination = Deployment(histories=[a]), Deployment(histories=[b])

        await copy_stores(origin, destination)
        report = await verify_copy(origin, destination)

        assert report.clean, report.mismatches
        assert report.matched == 2
        for identity in (first, second):
            assert await b.read(identity.key) == await a.read(identity.key)
        values = await stored(places[1], b)
        if target[1]:
            assert await all_sealed(places[1], b)
            assert not [v for v in values if MARKER in v]
        else:
            assert [v for v in values if MARKER in v]  # the scan does see plaintext
        await copy_stores(origin, destination)  # rerun: nothing doubled
        assert len(await stored(places[1], b)) == len(values)
        assert (await verify_copy(origin, destination)).clean
    finally:
        for place in places:
            await place.cleanup()


async def test_read_saved_of_a_held_encrypted_conversation_is_copied_opened(
    durable: Stores,
) -> None:
    a = durable("main", encryption=sealing())
    b = durable("other", encryption=sealing())
    first = who("r1", 1)
    await converse(a, first, 2)
    before = await a.read(first.key)
    assert await a.read_saved(first.key) == before  # opened, not tokens
    task, leave = await holding(a, first.key, lambda snapshot: (snapshot, None))
    try:
        assert await a.read_saved(first.key) == before
        origin, destination = Deployment(histories=[a]), Deployment(histories=[b])
        await copy_stores(origin, destination, include_active=True)
        assert await b.read(first.key) == before
        assert (await verify_copy(origin, destination)).clean
    finally:
        leave.set()
        await task
    assert await all_sealed(durable, b, "other")


# -- 3. export / import ---------------------------------------------------------------------


async def test_export_import_of_encrypted_conversations_round_trips(durable: Stores) -> None:
    a = durable("main", encryption=sealing())
    b = durable("other", encryption=sealing())
    first, second = who("r1", 1), who("r2", 2)
    await converse(a, first, 3)
    await converse(a, second, 2)
    out = io.BytesIO()
    await write_export(Deployment(histories=[a]), out, namespace="n")
    exported = out.getvalue()
    assert MARKER.encode() in exported  # the user's copy holds the plaintext
    assert b"tbe1." not in exported  # and never a token as content

    report = await import_records(Deployment(histories=[b]), io.BytesIO(exported))

    assert report.added == {"conversation": 2}
    for identity in (first, second):
        assert await b.read(identity.key) == await a.read(identity.key)
    assert await all_sealed(durable, b, "other")
    assert not [v for v in await stored(durable, b, "other") if MARKER in v]
    again = await import_records(Deployment(histories=[b]), io.BytesIO(exported))
    assert again.added == {}
    fresh = durable("other", encryption=sealing())
    await converse(fresh, first, 1)  # the imported conversation goes on
    assert len((await fresh.read(first.key))["exchanges"]) == 4


# -- 4. fork -----------------------------------------------------------------------------


async def test_a_fork_of_an_encrypted_conversation_reads_back_and_goes_on(
    durable: Stores,
) -> None:
    store = durable("main", encryption=sealing())
    original = who("r1", 1)
    await converse(store, original, 3)
    before = await store.read(original.key)
    copy = who("r2", 2)
    history = DecisionHistory(HistoryConfig(store=store, namespace="n"))

    key = await history.fork(original.key, copy, at_exchange=2)

    fresh = durable("main", encryption=sealing())
    forked = await fresh.read(key)
    assert forked is not None
    assert forked["exchanges"] == before["exchanges"][:2]
    assert await fresh.read(original.key) == before  # the original untouched
    assert await all_sealed(durable, store)
    raw = await fresh.read_raw(key)
    assert raw is not None
    assert check_record(raw) == []

    async def generate(window: HistoryWindow) -> DecisionMessage:
        return DecisionMessage(text="forked on")

    await DecisionHistory(HistoryConfig(store=fresh, namespace="n")).step(copy, [], generate)
    assert len((await fresh.read(key))["exchanges"]) == 3
    assert await all_sealed(durable, store)


# -- 5. erase -----------------------------------------------------------------------------


async def test_erase_on_an_encrypted_history_store_leaves_nothing(durable: Stores) -> None:
    store = durable("main", encryption=sealing())
    alice, bob = who("run-alice", 1), who("run-bob", 2)
    await converse(store, alice, 3)
    await converse(store, bob, 2)
    bob_before = await store.read(bob.key)
    bob_values = [v for v in await stored(durable, store) if v is not None]
    deployment = Deployment(histories=[store])

    receipt = await erase_user("alice", deployment, run_ids=["run-alice"])

    assert receipt.total >= 1
    assert await verify_erased("alice", deployment, run_ids=["run-alice"]) == {}
    assert [row.key for row in await store.list(purge=False)] == [bob.key]
    assert await store.read_raw(alice.key) is None
    assert await durable("main", encryption=sealing()).read(bob.key) == bob_before
    left = await stored(durable, store)
    assert 0 < len(left) < len(bob_values)
    assert await all_sealed(durable, store)
    assert (await erase_user("alice", deployment, run_ids=["run-alice"])).total == 0
    assert await verify_erased("alice", deployment, run_ids=["run-alice"]) == {}


async def test_a_check_without_the_keys_drops_nothing_and_says_so(durable: Stores) -> None:
    """The store opened without ``encryption=`` (an operator's mistake): every value is
    a token, the conversation is unrepairable with advice to open it with its keys
    (never to delete it), and a repair writes nothing."""
    store = durable("main", encryption=sealing())
    _provider, _last, key = await conversation(store)
    before = await store.read(key)
    plain = durable("main")
    raw = await plain.read_raw(key)
    assert raw is not None
    plan = plan_repair(raw)
    assert not plan.changes
    assert plan.unrepairable is not None
    assert "encryption=" in plan.unrepairable
    assert "delete it" not in plan.unrepairable
    assert await plain.repair(plan) is False
    assert await durable("main", encryption=sealing()).read(key) == before


async def test_rows_of_a_key_not_given_are_not_dropped(durable: Stores) -> None:
    """A rotation half done (old rows under k1, the head and new rows under k2) and the
    store opened with k2 only: the k1 rows are not damage; nothing is repaired."""
    k1, k2 = bytes(32), bytes(range(32))
    store = durable("main", encryption=sealing())
    first = who("r1", 1)
    key = first.key
    await converse(store, first, 2)
    both = durable("main", encryption=touba.Encryption(keys={"k1": k1, "k2": k2}, current="k2"))
    await converse(both, first, 1)  # a decision: the head and its new rows under k2
    raw_rows = [r for r in await stored(durable, both) if not r.startswith("tbe1.k2.")]
    assert raw_rows  # rows still under k1 (only the head was re-sealed)
    before = await both.read(key)

    only_k2 = durable("main", encryption=touba.Encryption(keys={"k2": k2}, current="k2"))
    raw = await only_k2.read_raw(key)
    assert raw is not None
    assert raw.missing_keys == ("k1",)
    plan = plan_repair(raw)
    assert not plan.changes
    assert plan.unrepairable is not None
    assert "'k1'" in plan.unrepairable
    assert await only_k2.repair(plan) is False
    assert await both.read(key) == before

    full = await both.read_raw(key)
    assert full is not None
    assert full.missing_keys == ()
    assert check_record(full) == []
