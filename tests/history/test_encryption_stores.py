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
from touba.history._common import MiB

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
        async with store._pg.call() as conn:
            heads = await (await conn.execute(f"SELECT head FROM {store.table}")).fetchall()
            bodies = await (
                await conn.execute(f"SELECT body FROM {store.table}_messages")
            ).fetchall()
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
    assert values and not any(MARKER in v for v in values)
    if durable.kind == "sqlite":
        await store.close()
        assert MARKER.encode() not in await raw_file_bytes(durable)
    # Another store object, same key: reads it; without the key: refuses it.
    again = durable("main", encryption=enc())
    assert await again.read(WHO.key) == record
    plain = durable("main")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.read(WHO.key)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await converse(plain, WHO, 1)
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
