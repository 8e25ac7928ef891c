"""Encryption at rest of the checkpoint stores and resource bindings (SQLite, PostgreSQL):
round trips, no plaintext in the file or the table, every kind of tampering refused,
rotation interrupted and resumed, bounds counted on the plaintext."""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from touba import Encryption
from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.runtime import (
    InvocationContext,
    Program,
    ResourceAddress,
    Resources,
    Runtime,
    SqliteCheckpointStore,
    SqliteResourceBinding,
)

from ._helpers import RawProvider, calls, done
from ._stores import Place, postgres_sql

MARKER = "WombatNarwhal4821"
K1, K2 = b"1" * 32, b"2" * 32
HERE = ResourceAddress("notes", "user", "ada")
THERE = ResourceAddress("notes", "user", "bob")


def enc(current: str = "k1", **keys: bytes) -> Encryption:
    return Encryption(keys=keys or {"k1": K1}, current=current)


def checkpoints(place: Place, encryption: Encryption | None) -> Any:
    if place.kind == "sqlite":
        store: Any = SqliteCheckpointStore(place.where[0], encryption=encryption)
    else:
        from touba.runtime import PostgresCheckpointStore

        store = PostgresCheckpointStore(place.where[0], table=place.where[1], encryption=encryption)
    place.opened.append(store)
    return store


def resources(place: Place, encryption: Encryption | None) -> Any:
    if place.kind == "sqlite":
        binding: Any = SqliteResourceBinding(place.where[0], encryption=encryption)
    else:
        from touba.runtime import PostgresResourceBinding

        binding = PostgresResourceBinding(
            place.where[0], table=place.where[1], encryption=encryption
        )
    place.opened.append(binding)
    return binding


async def raw(place: Place, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """``statement`` with ``{t}`` naming the store's table, ``%s`` placeholders."""
    if place.kind == "postgres":
        return await postgres_sql(place.where[0], statement, place.where[1], *params)
    conn = sqlite3.connect(place.where[0])
    try:  # each test uses one of the two tables
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        table = "touba_checkpoints" if "touba_checkpoints" in names else "touba_resources"
        text = statement.replace("{t}", table).replace("%s", "?")
        found = conn.execute(text, params).fetchall()
        conn.commit()
        return found
    finally:
        conn.close()


async def everything(place: Place, what: str) -> str:
    if place.kind == "sqlite":
        return "".join(
            p.read_bytes().decode("latin-1") for p in Path(place.where[0]).parent.glob("store*")
        )
    del what
    return "".join(str(r) for r in await raw(place, "SELECT t::text FROM {t} t"))


def _flip(token: str) -> str:
    head, _, body = token.rpartition(".")
    data = bytearray(base64.urlsafe_b64decode(body))
    data[len(data) // 2] ^= 0x10
    return f"{head}.{base64.urlsafe_b64encode(bytes(data)).decode()}"


TAMPER: dict[str, Callable[[str, str], str]] = {
    "swapped": lambda mine, other: other,
    "truncated": lambda mine, other: mine[: len(mine) // 2],
    "bit-flipped": lambda mine, other: _flip(mine),
    "plaintext": lambda mine, other: '{"status": "awaiting_approval", "v": 1}',
}


# -- checkpoints --------------------------------------------------------------------------


def checkpoint(n: int, revision: int = 0) -> dict[str, Any]:
    return {
        "run_id": f"r-{n}",
        "invocation_id": f"i-{n}",
        "agent_ref": "a",
        "status": "awaiting_approval",
        "revision": revision,
        "approvals": [{"call": "refund", "arguments": {"note": f"{MARKER} {n}"}}],
    }


async def test_checkpoints_round_trip_sealed(durable: Place) -> None:
    store = checkpoints(durable, enc())
    await store.save("c1", checkpoint(1))
    await store.save("c2", checkpoint(2))
    assert await store.get("c1") == checkpoint(1)
    assert await store.replace("c1", checkpoint(1, revision=1), revision=0)
    assert not await store.replace("c1", checkpoint(1, revision=2), revision=0)
    listed = await store.list()
    assert [(i.checkpoint_id, i.run_id, i.status, i.revision) for i in listed] == [
        ("c1", "r-1", "awaiting_approval", 1),
        ("c2", "r-2", "awaiting_approval", 0),
    ]
    assert [i.checkpoint_id for i in await store.list(run_id="r-2")] == ["c2"]
    assert MARKER not in await everything(durable, "checkpoints")
    assert await store.take("c1") == checkpoint(1, revision=1)
    assert await store.take("c1") is None
    assert await store.replace("c2", None, revision=0)
    assert await store.list() == []


@pytest.mark.parametrize("how", TAMPER)
async def test_a_tampered_checkpoint_is_refused_and_not_taken(durable: Place, how: str) -> None:
    store = checkpoints(durable, enc())
    await store.save("c1", checkpoint(1))
    await store.save("c2", checkpoint(2))
    bodies = dict(await raw(durable, "SELECT id, body FROM {t}"))
    changed = TAMPER[how](bodies["c1"], bodies["c2"])
    await raw(durable, "UPDATE {t} SET body = %s WHERE id = %s", changed, "c1")
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await store.get("c1")
    assert MARKER not in str(caught.value)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await store.take("c1")
    if durable.kind == "sqlite":  # PostgreSQL's replace reads the plaintext revision column
        with pytest.raises(DecisionHistoryRecordInvalid):
            await store.replace("c1", None, revision=0)
    assert [r[0] for r in await raw(durable, "SELECT id FROM {t} ORDER BY id")] == ["c1", "c2"]
    assert await store.get("c2") == checkpoint(2)


async def test_checkpoints_refuse_the_other_kind_of_row(durable: Place) -> None:
    plain = checkpoints(durable, None)
    await plain.save("plain", checkpoint(1))
    sealed = checkpoints(durable, enc())
    await sealed.save("sealed", checkpoint(2))
    with pytest.raises(DecisionHistoryRecordInvalid):
        await sealed.get("plain")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await plain.get("sealed")
    with pytest.raises(DecisionHistoryRecordInvalid, match="'k1'"):
        await checkpoints(durable, Encryption(keys={"k9": K2}, current="k9")).get("sealed")


async def test_checkpoint_rotation_interrupted_and_resumed(durable: Place) -> None:
    old = checkpoints(durable, enc())
    for n in range(5):
        await old.save(f"c{n}", checkpoint(n))
    both = Encryption(keys={"k1": K1, "k2": K2}, current="k2")
    assert await checkpoints(durable, both).rekey(batch=2) == 2
    resumed = checkpoints(durable, both)
    assert [await resumed.get(f"c{n}") for n in range(5)] == [checkpoint(n) for n in range(5)]
    assert await resumed.rekey(batch=2) == 2
    assert await resumed.rekey(batch=2) == 1
    assert await resumed.rekey(batch=2) == 0
    new_only = checkpoints(durable, Encryption(keys={"k2": K2}, current="k2"))
    assert await new_only.get("c0") == checkpoint(0)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await old.get("c0")
    with pytest.raises(ConfigurationError):
        await checkpoints(durable, None).rekey()


# -- resources ----------------------------------------------------------------------------


async def test_resources_round_trip_sealed(durable: Place) -> None:
    binding = resources(durable, enc())
    item = await binding.put(HERE, "a/1", {"note": f"{MARKER} one"})
    assert item.value == {"note": f"{MARKER} one"}
    await binding.put(HERE, "a/2", [MARKER, 2])
    await binding.put(THERE, "a/1", "bob's")
    got = await binding.get(HERE, "a/1")
    assert got is not None
    assert got.value == {"note": f"{MARKER} one"}
    assert await binding.keys(HERE, prefix="a/", limit=10) == ["a/1", "a/2"]
    assert await binding.delete(HERE, "a/2")
    assert await binding.keys(HERE, prefix="", limit=10) == ["a/1"]
    assert MARKER not in await everything(durable, "resources")


@pytest.mark.parametrize("how", TAMPER)
async def test_a_tampered_resource_value_is_refused(durable: Place, how: str) -> None:
    binding = resources(durable, enc())
    await binding.put(HERE, "k", f"{MARKER} mine")
    await binding.put(HERE, "other", f"{MARKER} other key")
    await binding.put(THERE, "k", f"{MARKER} bob's")
    rows = await raw(durable, "SELECT scope_key, key, value FROM {t}")
    values = {(r[0], r[1]): r[2] for r in rows}
    other = values[("ada", "other")] if how == "swapped" else values[("bob", "k")]
    changed = TAMPER[how](values[("ada", "k")], other)
    await raw(durable, "UPDATE {t} SET value = %s WHERE scope_key = 'ada' AND key = 'k'", changed)
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await binding.get(HERE, "k")
    assert MARKER not in str(caught.value)
    got = await binding.get(THERE, "k")
    assert got is not None
    assert got.value == f"{MARKER} bob's"


async def test_a_resource_value_moved_to_another_user_is_refused(durable: Place) -> None:
    binding = resources(durable, enc())
    await binding.put(HERE, "k", "ada's")
    await binding.put(THERE, "k", "bob's")
    [(bobs,)] = await raw(durable, "SELECT value FROM {t} WHERE scope_key = 'bob'")
    await raw(durable, "UPDATE {t} SET value = %s WHERE scope_key = 'ada'", bobs)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await binding.get(HERE, "k")


async def test_resources_refuse_the_other_kind_of_row(durable: Place) -> None:
    await resources(durable, None).put(HERE, "plain", "x")
    await resources(durable, enc()).put(HERE, "sealed", "y")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await resources(durable, enc()).get(HERE, "plain")
    with pytest.raises(DecisionHistoryRecordInvalid):
        await resources(durable, None).get(HERE, "sealed")


async def test_resource_rotation_interrupted_and_resumed(durable: Place) -> None:
    old = resources(durable, enc())
    for n in range(5):
        await old.put(HERE, f"k{n}", n)
    both = Encryption(keys={"k1": K1, "k2": K2}, current="k2")
    assert await resources(durable, both).rekey(batch=3) == 3
    resumed = resources(durable, both)
    assert [(await resumed.get(HERE, f"k{n}")).value for n in range(5)] == list(range(5))
    assert await resumed.rekey(batch=3) == 2
    assert await resumed.rekey(batch=3) == 0
    new_only = resources(durable, Encryption(keys={"k2": K2}, current="k2"))
    assert (await new_only.get(HERE, "k4")).value == 4
    with pytest.raises(DecisionHistoryRecordInvalid):
        await old.get(HERE, "k4")


@pytest.mark.parametrize("encrypted", [False, True])
async def test_max_value_bytes_counts_the_plaintext(durable: Place, encrypted: bool) -> None:
    program = Program()
    program.resource("notes", scopes=("user",), read=("r",), write=("w",), max_value_bytes=12)

    @program.capability(permissions=("w",))
    async def remember(text: str, resources: Resources) -> str:
        await resources["notes"].put("last", text)
        return "ok"

    provider = RawProvider(
        calls(("c1", "remember", {"text": "é" * 5})),  # "ééééé" is 12 bytes as JSON
        calls(("c2", "remember", {"text": "é" * 6})),  # 14: over
        done("done"),
    )
    program.agent("a", provider=provider, capabilities=("remember",), grants=("r", "w"))
    binding = resources(durable, enc() if encrypted else None)
    runtime = Runtime(program, resources=binding)
    result = await runtime.invoke("a", input="go", context=InvocationContext(user_id="ada"))
    observations = [dict(e.data) for e in result.trace.of_kind("observation")]
    assert [o.get("status") for o in observations] == ["ok", "error"]
    item = await binding.get(HERE, "last")
    assert item is not None
    assert item.value == "é" * 5


async def test_an_approval_pauses_and_resumes_through_a_sealed_checkpoint(durable: Place) -> None:
    from touba.testing import ScriptedProvider

    from ._helpers import final, step
    from .test_approvals import make_program

    store = checkpoints(durable, enc())
    model = ScriptedProvider(
        step(("c1", "lookup_invoice", {"invoice": MARKER}), ("c2", "pay", {"invoice": MARKER})),
        final("done"),
    )
    program, log = make_program(model)
    paused = await Runtime(program, checkpoints=store).invoke("billing")
    assert paused.checkpoint_id is not None
    assert [c.arguments for c in paused.pending] == [{"invoice": MARKER}]
    assert [i.checkpoint_id for i in await store.list()] == [paused.checkpoint_id]
    assert MARKER not in await everything(durable, "checkpoints")
    result = await Runtime(program, checkpoints=store).resume(
        paused.checkpoint_id, approvals={"c2": True}
    )
    assert result.status == "completed"
    assert log == [f"lookup {MARKER}", f"pay {MARKER}"]


async def test_rotation_catches_rows_written_with_the_old_key_behind_its_cursor(
    durable: Place,
) -> None:
    old = checkpoints(durable, enc())
    for n in range(4):
        await old.save(f"c{n}", checkpoint(n))
    rotating = checkpoints(durable, Encryption(keys={"k1": K1, "k2": K2}, current="k2"))
    assert await rotating.rekey(batch=2) == 2  # c0, c1
    await old.save("a", checkpoint(9))  # a process still on the old key, behind the cursor
    assert await rotating.rekey(batch=2) == 2  # c2, c3
    assert await rotating.rekey(batch=2) == 1  # nothing past c3: from the start, "a"
    assert await rotating.rekey(batch=2) == 0
    new_only = checkpoints(durable, Encryption(keys={"k2": K2}, current="k2"))
    assert await new_only.get("a") == checkpoint(9)


async def test_resource_rotation_catches_values_behind_its_cursor(durable: Place) -> None:
    old = resources(durable, enc())
    for n in range(4):
        await old.put(THERE, f"k{n}", n)
    rotating = resources(durable, Encryption(keys={"k1": K1, "k2": K2}, current="k2"))
    assert await rotating.rekey(batch=3) == 3
    await old.put(HERE, "early", "x")  # "ada" sorts before "bob"
    assert await rotating.rekey(batch=3) == 1  # bob's k3
    assert await rotating.rekey(batch=3) == 1  # from the start: ada's
    assert await rotating.rekey(batch=3) == 0
    new_only = resources(durable, Encryption(keys={"k2": K2}, current="k2"))
    item = await new_only.get(HERE, "early")
    assert item is not None
    assert item.value == "x"
