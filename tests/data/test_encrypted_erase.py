"""touba.erase_user and verify_erased on a deployment whose memory, checkpoint and resource
stores are encrypted at rest (SQLite and PostgreSQL).

A sealed checkpoint body is opened to find whose it is (its ``user_id`` is inside): the
checkpoint known by its body only is erased too. A body that does not open, of a
checkpoint not matched by its ``run_id``, cannot say whose it is: the erase refuses,
naming it, before anything is erased (never skipped silently).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import touba
from tests._services import postgres_dsn
from tests.data._world import Deployment, marker, sessions_of
from touba.data import erase_user, verify_erased
from touba.errors import DecisionHistoryRecordInvalid

ALICE, BOB = "alice-7f3", "bob-2c1"
PARAMS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def sealing() -> touba.Encryption:
    return touba.Encryption(keys={"k1": bytes(32)}, current="k1")


@pytest.fixture(params=PARAMS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Deployment]:
    deployment = Deployment(request.param, tmp_path, encryption=sealing())
    try:
        await deployment.open()
        await deployment.populate(ALICE)
        await deployment.populate(BOB)
        await deployment.populate_shared()
        yield deployment
    finally:
        await deployment.cleanup()


def _mentions(rows: list[str], user: str) -> list[str]:
    return [r for r in rows if user in r or marker(user) in r]


def set_body(world: Deployment, checkpoint_id: str, body: str) -> None:
    """Overwrite a checkpoint's stored body, outside the store."""
    if world.kind == "sqlite":
        with closing(sqlite3.connect(world.path("checkpoints"))) as conn:
            conn.execute(
                "UPDATE touba_checkpoints SET body = ? WHERE id = ?", (body, checkpoint_id)
            )
            conn.commit()
        return
    import psycopg
    from psycopg import sql

    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        table = sql.Identifier(world.root, "touba_checkpoints")
        query = sql.SQL("UPDATE {} SET body = %s WHERE id = %s").format(table)
        conn.execute(query, (body, checkpoint_id))


def get_body(world: Deployment, checkpoint_id: str) -> str:
    if world.kind == "sqlite":
        with closing(sqlite3.connect(world.path("checkpoints"))) as conn:
            found = conn.execute(
                "SELECT body FROM touba_checkpoints WHERE id = ?", (checkpoint_id,)
            ).fetchone()
        return str(found[0])
    import psycopg
    from psycopg import sql

    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        table = sql.Identifier(world.root, "touba_checkpoints")
        query = sql.SQL("SELECT body FROM {} WHERE id = %s").format(table)
        found = conn.execute(query, (checkpoint_id,)).fetchone()
    assert found is not None
    return str(found[0])


async def raw_rows(world: Deployment) -> list[str]:
    if world.kind == "sqlite":
        return world.sqlite_rows()
    return await world.raw()


async def test_erase_on_encrypted_stores_leaves_nothing_and_keeps_the_other_user(
    world: Deployment,
) -> None:
    stores = world.stores
    before = await raw_rows(world)
    sealed = [r for r in before if "history" not in r.split(":", 1)[0]]  # histories: plain
    assert sealed
    assert marker(ALICE) not in "\n".join(sealed)  # the content is sealed
    assert get_body(world, f"cp-{ALICE}-2").startswith("tbe1.k1.")
    assert set(await verify_erased(ALICE, stores)) == {
        "memory",
        "history",
        "checkpoints",
        "resources",
    }
    assert (await verify_erased(ALICE, stores))["checkpoints"] == {"checkpoints": 2}
    bob_counts = await verify_erased(BOB, stores)
    bob_rows = _mentions(before, BOB)

    receipt = await erase_user(ALICE, stores)

    # Both checkpoints went: the one of Alice's session, and the one whose body alone
    # (sealed) names her.
    assert receipt.counts["checkpoints"] == {"checkpoints": 2}
    assert receipt.counts["resources"] == {"user_values": 1, "session_values": 1, "run_values": 1}
    assert receipt.counts["memory"]["turns"] == 4
    assert await verify_erased(ALICE, stores) == {}
    assert await verify_erased(BOB, stores) == bob_counts
    rows = await raw_rows(world)
    assert _mentions(rows, ALICE) == []
    assert _mentions(rows, BOB) == bob_rows  # byte for byte
    # Bob's sealed rows still open.
    checkpoints: Any = stores.checkpoints
    assert (await checkpoints.get(f"cp-{BOB}-2"))["user_id"] == BOB
    memory: Any = stores.memory
    turns = await memory.list_turns(sessions_of(BOB)[0])
    assert [t.user for t in turns] == [f"{marker(BOB)} question {n}" for n in range(2)]
    assert (await erase_user(ALICE, stores)).counts == {}


async def test_a_body_that_does_not_open_refuses_the_erase_naming_it(world: Deployment) -> None:
    stores = world.stores
    alice_before = await verify_erased(ALICE, stores)
    # Bob's checkpoint known by its body only, altered: whose it is cannot be told.
    token = get_body(world, f"cp-{BOB}-2")
    set_body(world, f"cp-{BOB}-2", token[:-8] + ("A" if token[-8] != "A" else "B") + token[-7:])
    with pytest.raises(DecisionHistoryRecordInvalid, match=f"cp-{BOB}-2") as caught:
        await erase_user(ALICE, stores)
    assert marker(BOB) not in str(caught.value)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await verify_erased(ALICE, stores)
    # Nothing was erased.
    set_body(world, f"cp-{BOB}-2", token)
    assert await verify_erased(ALICE, stores) == alice_before
    # Plaintext in the encrypted store is refused the same way (never read as plaintext).
    set_body(world, f"cp-{BOB}-2", json.dumps({"user_id": ALICE, "run_id": "x"}))
    with pytest.raises(DecisionHistoryRecordInvalid, match=f"cp-{BOB}-2"):
        await erase_user(ALICE, stores)
    set_body(world, f"cp-{BOB}-2", token)


async def test_a_damaged_body_matched_by_its_run_id_is_erased(world: Deployment) -> None:
    stores = world.stores
    set_body(world, f"cp-{ALICE}-1", "tbe1.k1.damaged")  # run_id: Alice's session
    receipt = await erase_user(ALICE, stores)
    assert receipt.counts["checkpoints"] == {"checkpoints": 2}
    assert await verify_erased(ALICE, stores) == {}
