"""touba.erase_user and touba.verify_erased on every built-in store, with two users' data.

After erasing one user: ``verify_erased`` finds nothing; a raw scan of every table (and of
the SQLite files' bytes), of every Redis key and value under the prefix, finds neither the
user id nor the marker placed in their content; the other user's rows are the same, byte
for byte; shared rows (an agent's settings, agent-scoped resources) are kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

import touba
from tests.data._world import Deployment, marker, outside_run, sessions_of
from touba.data import ErasureReceipt, Stores, erase_user, owned_by, verify_erased
from touba.errors import ConfigurationError, DecisionHistoryBusy, InvocationBusy

ALICE, BOB = "alice-7f3", "bob-2c1"

PARAMS = [
    "sqlite",
    "ram",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
]


@pytest.fixture(params=PARAMS)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Deployment]:
    deployment = Deployment(request.param, tmp_path)
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


EVERY_KIND = {
    "memory": {"sessions", "turns", "key_events", "key_event_updates", "extraction_jobs"},
    "history": {"conversations", "messages"},
    "checkpoints": {"checkpoints"},
    "resources": {"user_values", "session_values", "run_values"},
}


async def test_erase_leaves_nothing_of_the_user_and_the_other_user_intact(
    world: Deployment,
) -> None:
    stores = world.stores
    assert set(await verify_erased(ALICE, stores)) == set(EVERY_KIND)  # data of every kind
    bob_counts = await verify_erased(BOB, stores)
    bob_rows = _mentions(await world.raw(), BOB)

    receipt = await erase_user(ALICE, stores)

    assert await verify_erased(ALICE, stores) == {}
    assert {store: set(kinds) for store, kinds in receipt.counts.items()} == EVERY_KIND
    assert receipt.counts["memory"] == {
        "sessions": 2,
        "turns": 4,
        "key_events": 2,
        "key_event_updates": 2,
        "extraction_jobs": 2,
    }
    assert receipt.counts["history"]["conversations"] == 3  # two sessions and the batch run
    assert receipt.counts["checkpoints"] == {"checkpoints": 2}
    assert receipt.counts["resources"] == {"user_values": 1, "session_values": 1, "run_values": 1}
    # The other user's rows: the same, byte for byte, and counted the same.
    assert await verify_erased(BOB, stores) == bob_counts
    raw = await world.raw()
    assert _mentions(raw, BOB) == bob_rows
    assert _mentions(raw, ALICE) == []
    # Shared rows are kept.
    memory: Any = stores.memory
    assert await memory.load_memory_config("support") is not None
    # Idempotent: a rerun erases nothing.
    again = await erase_user(ALICE, stores)
    assert again.counts == {}
    assert again.total == 0

    # SQLite: no table row, and no byte of any file, keeps the user id or the marker.
    if world.sqlite_files():
        before = world.sqlite_rows()
        await world.close()
        rows = world.sqlite_rows()
        assert rows == before
        assert _mentions(rows, ALICE) == []
        assert len(_mentions(rows, BOB)) > 0
        data = world.file_bytes()
        assert ALICE.encode() not in data
        assert marker(ALICE).encode() not in data
        assert marker(BOB).encode() in data  # the scan does read the content


async def test_the_receipt_names_the_user_by_hash_only(world: Deployment) -> None:
    receipt = await erase_user(ALICE, world.stores)
    assert isinstance(receipt, ErasureReceipt)

    assert receipt.user_hash == hashlib.sha256(ALICE.encode()).hexdigest()
    assert receipt.erased_at.tzinfo is UTC
    text = json.dumps(receipt.as_json())
    assert ALICE not in text
    assert marker(ALICE) not in text
    assert json.loads(text)["counts"] == {k: dict(v) for k, v in receipt.counts.items()}
    with pytest.raises(AttributeError):
        receipt.user_hash = "x"  # type: ignore[misc]


async def test_owned_by_derives_sessions_and_runs(world: Deployment) -> None:
    owned = await owned_by(ALICE, world.stores)
    assert owned.session_ids == frozenset(sessions_of(ALICE))
    # The batch run is the user's through its checkpoint's body alone.
    assert owned.run_ids == frozenset([*sessions_of(ALICE), outside_run(ALICE)])
    assert f"user:{ALICE}" in owned.owners


async def test_a_held_conversation_refuses_the_erase_unless_forced(world: Deployment) -> None:
    import asyncio

    stores = world.stores
    history: Any = stores.histories[0]
    conversation = next(
        c for c in await history.list(purge=False) if c.identity["run_id"] == sessions_of(ALICE)[0]
    )
    inside, leave = asyncio.Event(), asyncio.Event()

    async def hold(record: Any) -> tuple[Any, None]:
        inside.set()
        await leave.wait()
        return record, None

    holder = asyncio.create_task(history.transact(conversation.key, hold))
    await inside.wait()
    before = await verify_erased(ALICE, stores)
    with pytest.raises(DecisionHistoryBusy) as refused:
        await erase_user(ALICE, stores)
    assert refused.value.session_key == conversation.key
    assert ALICE not in str(refused.value)
    assert await verify_erased(ALICE, stores) == before  # nothing was erased

    receipt = await erase_user(ALICE, stores, force=True)
    assert receipt.counts["history"]["conversations"] == 3
    assert await verify_erased(ALICE, stores) == {}
    leave.set()
    with pytest.raises(DecisionHistoryBusy):  # the recovered worker's save is refused
        await holder
    assert await verify_erased(ALICE, stores) == {}  # its save wrote nothing back


async def test_a_running_checkpoint_refuses_the_erase_unless_forced(world: Deployment) -> None:
    stores = world.stores
    checkpoints: Any = stores.checkpoints
    body = {"run_id": sessions_of(ALICE)[1], "status": "running", "holder": {"worker_id": "w"}}
    await checkpoints.save("cp-running", body)
    with pytest.raises(InvocationBusy) as refused:
        await erase_user(ALICE, stores)
    assert refused.value.checkpoint_id == "cp-running"
    assert (await verify_erased(ALICE, stores))["checkpoints"] == {"checkpoints": 3}
    receipt = await erase_user(ALICE, stores, force=True)
    assert receipt.counts["checkpoints"] == {"checkpoints": 3}
    assert await checkpoints.get("cp-running") is None
    assert await verify_erased(ALICE, stores) == {}


async def test_given_run_ids_are_erased_too(world: Deployment) -> None:
    from tests.data._world import write_history

    stores = world.stores
    await write_history(stores.histories[0], "r-loose", marker(ALICE))
    assert "history" not in await verify_erased(ALICE, Stores(histories=stores.histories))
    left = await verify_erased(ALICE, stores, run_ids=["r-loose"])
    assert left["history"]["conversations"] == 4
    await erase_user(ALICE, stores, run_ids=["r-loose"])
    assert await verify_erased(ALICE, stores, run_ids=["r-loose"]) == {}


async def test_bad_arguments_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    for user in ("", None, 3, "a\x00b"):
        with pytest.raises(ConfigurationError):
            await erase_user(user, Stores())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await erase_user("u", object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await erase_user("u", Stores(), run_ids="r-1")
    with pytest.raises(ConfigurationError):
        await erase_user("u", Stores(), force="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="erase_scope_keys"):
        await erase_user("u", Stores(resources=object()))  # type: ignore[arg-type]
    empty = await erase_user("u", Stores())  # no store: nothing to erase, an empty receipt
    assert empty.counts == {}
    assert await verify_erased("u", Stores()) == {}


async def test_exported_from_touba() -> None:
    assert touba.erase_user is erase_user
    assert touba.verify_erased is verify_erased
