"""The SQLite stores overwrite what an erase deletes, even on a connection that would not.

SQLite leaves a deleted row's bytes in the file's free space unless ``secure_delete`` is
on; some builds turn it on by default, so the test gives the history, checkpoint and
resource stores connections of its own with ``PRAGMA secure_delete=OFF``. A plain
``delete`` on them leaves its bytes in the file (the control); the erase leaves none,
and hands the connection back with the pragma as it was.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.data._world import Deployment, marker, write_history
from touba.data import Stores, erase_user, verify_erased
from touba.history.sqlite import SqliteHistoryStore
from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding

ALICE, BOB, CAROL = "alice-7f3", "bob-2c1", "carol-9d0"


def _leaky(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA secure_delete=OFF")
    return conn


async def test_erase_overwrites_the_bytes_a_plain_delete_leaves(tmp_path: Path) -> None:
    world = Deployment("sqlite", tmp_path)
    directory = world.path("memory").parent
    conns = {name: _leaky(directory / f"{name}.db") for name in ("history", "cp", "res")}
    try:
        await world.open()
        await world.close()  # the memory store stays the world's; the others are ours
        from touba.memory import SqliteMemoryStore

        memory = SqliteMemoryStore(directory / "memory.db")
        history = SqliteHistoryStore(database=conns["history"])
        checkpoints = SqliteCheckpointStore(database=conns["cp"])
        resources = SqliteResourceBinding(database=conns["res"])
        world.stores = Stores(
            memory=memory, histories=(history,), checkpoints=checkpoints, resources=resources
        )
        world.closers = [memory, history, checkpoints, resources]
        await world.populate(ALICE)
        await world.populate(BOB)
        carol = await write_history(history, f"r-{CAROL}", marker(CAROL))
        assert await history.delete(carol)  # the control: a plain delete on this connection

        await erase_user(ALICE, world.stores)
        assert await verify_erased(ALICE, world.stores) == {}
        for conn in conns.values():
            assert conn.execute("PRAGMA secure_delete").fetchone()[0] == 0  # as it was
        await world.close()
    finally:
        for conn in conns.values():
            conn.close()
    data = world.file_bytes()
    assert marker(CAROL).encode() in data  # what a plain delete leaves
    assert marker(ALICE).encode() not in data
    assert ALICE.encode() not in data
    assert marker(BOB).encode() in data
