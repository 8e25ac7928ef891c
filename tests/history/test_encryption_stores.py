"""Encryption at rest of the durable history stores (SQLite, PostgreSQL, Redis).

Every test runs on the real store: a real SQLite file, the real PostgreSQL and
Redis servers. Damage is made by hand in the store itself (SQL, Redis commands),
the way an attacker with access to the database, or a bad restore, would.
"""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.history._stores import DURABLE, WHO, Stores
from touba import Encryption
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)

MARKER = "zebra-marker-7731"
K1 = bytes(range(32))
K2 = bytes(range(32, 64))


def enc(current: str = "k1", **extra: bytes) -> Encryption:
    return Encryption(keys={"k1": K1, "k2": K2, **extra}, current=current)


@pytest.fixture(params=DURABLE)
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    built = Stores(request.param, tmp_path)
    built.prepare()
    yield built
    await built.cleanup()


def identity(n: int) -> ConversationIdentity:
    return ConversationIdentity("n", "openai", "m", "native", "r", f"i{n}", "agent")


async def converse(store: Any, who: ConversationIdentity, steps: int, **config: Any) -> None:
    """``steps`` decisions of one conversation, each a call whose result holds MARKER."""
    history = DecisionHistory(HistoryConfig(store=store, namespace=who.namespace, **config))
    pending: CapabilityCall | None = None
    stored = await store.read(who.key)
    if stored is not None and stored["pending"]:
        last = stored["exchanges"][-1][0]["calls"][0]
        pending = CapabilityCall(last["call_id"], last["name"], last["arguments"])
    for n in range(steps):
        observations = []
        if pending is not None:
            observations.append(
                Observation(
                    pending.call_id, pending.name, pending.arguments, "ok", {"note": MARKER}
                )
            )
        call = CapabilityCall(f"c{n}", "lookup", {"q": f"{MARKER}-{n}"})

        async def generate(window: HistoryWindow, call: CapabilityCall = call) -> DecisionMessage:
            return DecisionMessage(text=f"thinking {MARKER}", calls=(call,))

        await history.step(who, observations, generate)
        pending = call


# -- raw access to what each store keeps ---------------------------------------------------


async def raw_values(durable: Stores, store: Any) -> list[str]:
    """Every head and message body the store keeps, as stored."""
    if durable.kind == "sqlite":
        import sqlite3

        with sqlite3.connect(durable.location("main")[0]) as conn:
            heads = [r[0] for r in conn.execute("SELECT head FROM touba_history_sessions")]
            bodies = [r[0] for r in conn.execute("SELECT body FROM touba_history_messages")]
        return [v for v in heads + bodies if v is not None]
    if durable.kind == "postgres":
        raw = Raw(durable, store)
        heads = await raw.pg("SELECT head FROM {t}")
        bodies = await raw.pg("SELECT body FROM {m}")
        return [r[0] for r in [*heads, *bodies] if r[0] is not None]
    client = store._client
    out = []
    async for name in client.scan_iter(match=durable.location("main")[1] + "*"):
        kind = await client.type(name)
        if kind in (b"hash", "hash"):
            out += [v.decode() for v in (await client.hgetall(name)).values()]
        elif kind in (b"list", "list"):
            out += [v.decode() for v in await client.lrange(name, 0, -1)]
    return out


async def raw_file_bytes(durable: Stores) -> bytes:
    path = Path(durable.location("main")[0])
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


# -- round trip and what is at rest -------------------------------------------------------


async def test_round_trip_and_no_plaintext_at_rest(durable: Stores) -> None:
    store = durable("main", encryption=enc())
    await converse(store, WHO, 6)
    record = await store.read(WHO.key)
    assert record is not None
    assert len(record["exchanges"]) == 6
    assert record["exchanges"][0][0]["calls"][0]["arguments"] == {"q": f"{MARKER}-0"}
    values = await raw_values(durable, store)
    assert values
    assert not any(MARKER in v for v in values)
    if durable.kind == "sqlite":
        await store.close()
        assert MARKER.encode() not in await raw_file_bytes(durable)
    # Another store object, same key: reads it; without the key: refuses it.
    again = durable("main", encryption=enc())
    assert await again.read(WHO.key) == record
    plain = durable("main")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.read(WHO.key)
    history = DecisionHistory(HistoryConfig(store=plain, namespace="n"))

    async def generate(window: HistoryWindow) -> DecisionMessage:
        raise AssertionError("a sealed record must be refused before the model is called")

    answer = Observation("c5", "lookup", {"q": f"{MARKER}-5"}, "ok", {})
    with pytest.raises(DecisionHistoryRecordInvalid):  # the decision path refuses it too
        await history.step(WHO, [answer], generate)
    await converse(again, WHO, 2)  # the refusal left it intact and free
    assert len((await again.read(WHO.key))["exchanges"]) == 8


async def test_unencrypted_store_still_plaintext(durable: Stores) -> None:
    store = durable("main")
    await converse(store, WHO, 2)
    assert any(MARKER in v for v in await raw_values(durable, store))
    sealed = durable("main", encryption=enc())
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await sealed.read(WHO.key)
    assert MARKER not in str(caught.value)


def test_encryption_argument_is_checked(tmp_path: Path) -> None:
    from touba.history.sqlite import SqliteHistoryStore

    with pytest.raises(ConfigurationError):
        SqliteHistoryStore(tmp_path / "h.sqlite", encryption="k1")  # type: ignore[arg-type]


# -- damage made in the store itself ------------------------------------------------------


class Raw:
    """One store's heads and message bodies, read and written behind touba's back."""

    def __init__(self, durable: Stores, store: Any) -> None:
        self.durable, self.store, self.kind = durable, store, durable.kind

    async def head(self, key: str) -> str:
        return (await self._heads())[key]

    async def bodies(self, key: str) -> list[str]:
        if self.kind == "sqlite":
            return [
                r[0]
                for r in self._sqlite(
                    "SELECT body FROM touba_history_messages WHERE conv = "
                    "(SELECT id FROM touba_history_sessions WHERE key = ?) ORDER BY seq",
                    key,
                )
            ]
        if self.kind == "postgres":
            return [
                r[0]
                for r in await self.pg(
                    "SELECT body FROM {m} WHERE key = %s ORDER BY seq",
                    key,
                )
            ]
        rows = await self.store._client.lrange(self.store._keys(key).messages, 0, -1)
        return [r.decode().split(",", 2)[2][:-1] for r in rows]

    async def set_head(self, key: str, value: str) -> None:
        if self.kind == "sqlite":
            self._sqlite("UPDATE touba_history_sessions SET head = ? WHERE key = ?", value, key)
        elif self.kind == "postgres":
            await self.pg("UPDATE {t} SET head = %s WHERE key = %s", value, key)
        else:
            await self.store._client.hset(self.store._keys(key).all[4], "head", value)

    async def set_body(self, key: str, seq: int, value: str) -> None:
        if self.kind == "sqlite":
            self._sqlite(
                "UPDATE touba_history_messages SET body = ? WHERE seq = ? AND conv = "
                "(SELECT id FROM touba_history_sessions WHERE key = ?)",
                value,
                seq,
                key,
            )
        elif self.kind == "postgres":
            await self.pg(
                "UPDATE {m} SET body = %s WHERE key = %s AND seq = %s",
                value,
                key,
                seq,
            )
        else:
            name = self.store._keys(key).messages
            row = (await self.store._client.lindex(name, seq)).decode()
            exchange, size, _body = row[1:-1].split(",", 2)
            await self.store._client.lset(name, seq, f"[{exchange},{size},{value}]")

    async def _heads(self) -> dict[str, str]:
        if self.kind == "sqlite":
            return dict(self._sqlite("SELECT key, head FROM touba_history_sessions"))
        if self.kind == "postgres":
            return dict(await self.pg("SELECT key, head FROM {t}"))
        out = {}
        for row in await self.store.list():
            out[row.key] = (
                await self.store._client.hget(self.store._keys(row.key).all[4], "head")
            ).decode()
        return out

    def _sqlite(self, sql: str, *args: Any) -> list[Any]:
        import sqlite3

        with sqlite3.connect(self.durable.location("main")[0]) as conn:
            return conn.execute(sql, args).fetchall()

    async def pg(self, template: str, *args: Any) -> list[Any]:
        """Run ``template`` with ``{t}``, ``{m}`` the store's tables (quoted identifiers)."""
        from psycopg import sql

        *schema, name = self.store.table.split(".")
        t, m = sql.Identifier(*schema, name), sql.Identifier(*schema, f"{name}_messages")
        query = sql.SQL(template).format(t=t, m=m)
        async with self.store._pg.call() as conn:
            cursor = await conn.execute(query, args)
            return await cursor.fetchall() if cursor.description else []


def flip(token: str) -> str:
    """``token`` with one bit of its ciphertext flipped (still a well-formed token)."""
    head, _, body = token.rpartition(".")
    raw = bytearray(base64.urlsafe_b64decode(body))
    raw[len(raw) // 2] ^= 0x01
    return f"{head}.{base64.urlsafe_b64encode(bytes(raw)).decode()}"


def truncate(token: str) -> str:
    head, _, body = token.rpartition(".")
    raw = base64.urlsafe_b64decode(body)
    return f"{head}.{base64.urlsafe_b64encode(raw[:-4]).decode()}"


A, B = identity(1), identity(2)


async def _two(durable: Stores) -> tuple[Any, Raw]:
    store = durable("main", encryption=enc())
    await converse(store, A, 3)
    await converse(store, B, 3)
    return store, Raw(durable, store)


async def _refused(durable: Stores, key: str, *, also: ConversationIdentity) -> None:
    """A fresh store object refuses ``key`` (read and decision), and still serves ``also``."""
    fresh = durable("main", encryption=enc())
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await fresh.read(key)
    assert MARKER not in str(caught.value)
    assert base64.b64encode(K1).decode() not in str(caught.value)
    who = A if key == A.key else B
    history = DecisionHistory(HistoryConfig(store=fresh, namespace="n"))

    async def generate(window: HistoryWindow) -> DecisionMessage:
        raise AssertionError("a damaged record must be refused before the model is called")

    answer = Observation("c2", "lookup", {"q": f"{MARKER}-2"}, "ok", {})
    with pytest.raises(DecisionHistoryRecordInvalid):
        await history.step(who, [answer], generate)
    other = await fresh.read(also.key)  # the other conversation is untouched
    assert other is not None
    assert len(other["exchanges"]) == 3


async def test_heads_swapped_between_conversations_are_refused(durable: Stores) -> None:
    _store, raw = await _two(durable)
    head_a, head_b = await raw.head(A.key), await raw.head(B.key)
    await raw.set_head(A.key, head_b)
    await raw.set_head(B.key, head_a)
    for key in (A.key, B.key):
        fresh = durable("main", encryption=enc())
        with pytest.raises(DecisionHistoryRecordInvalid):
            await fresh.read(key)


async def test_message_moved_to_another_conversation_is_refused(durable: Stores) -> None:
    _store, raw = await _two(durable)
    await raw.set_body(A.key, 1, (await raw.bodies(B.key))[1])
    await _refused(durable, A.key, also=B)


async def test_messages_swapped_between_positions_are_refused(durable: Stores) -> None:
    _store, raw = await _two(durable)
    bodies = await raw.bodies(A.key)
    await raw.set_body(A.key, 0, bodies[2])
    await raw.set_body(A.key, 2, bodies[0])
    await _refused(durable, A.key, also=B)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "plaintext", "other key"])
async def test_damaged_rows_are_refused(durable: Stores, damage: str) -> None:
    _store, raw = await _two(durable)
    body = (await raw.bodies(A.key))[-1]
    if damage == "truncated":
        value = truncate(body)
    elif damage == "bit-flipped":
        value = flip(body)
    elif damage == "plaintext":
        value = '{"kind":"decision","text":"injected","calls":[]}'
    else:  # a well-formed token of a key this store does not have
        value = Encryption(keys={"k9": os.urandom(32)}, current="k9").seal(b"{}", context=b"[]")
    await raw.set_body(A.key, (len(await raw.bodies(A.key))) - 1, value)
    await _refused(durable, A.key, also=B)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "plaintext"])
async def test_damaged_heads_are_refused(durable: Stores, damage: str) -> None:
    _store, raw = await _two(durable)
    head = await raw.head(A.key)
    value = {"truncated": truncate, "bit-flipped": flip}.get(damage, lambda _h: "{}")(head)
    if damage == "plaintext":
        value = '{"kind":"touba.decision_history","version":1}'
    await raw.set_head(A.key, value)
    await _refused(durable, A.key, also=B)


# -- bounds count plaintext ---------------------------------------------------------------


async def test_bounds_count_plaintext_bytes(durable: Stores) -> None:
    """The same conversation reaches the same byte count, and hits the same bound at
    the same decision, with and without encryption."""
    counts = {}
    for name, encryption in (("plain", None), ("sealed", enc())):
        store = durable(name, max_store_bytes=64 * 1024, encryption=encryption)
        with pytest.raises(Exception) as caught:
            await converse(store, WHO, 400)
        assert type(caught.value).__name__ == "DecisionHistoryLimitExceeded"
        record = await store.read(WHO.key)
        usage = await store.usage()
        counts[name] = (len(record["exchanges"]), usage.bytes, record["stats"]["bytes"])
    assert counts["plain"] == counts["sealed"]
