"""Retention on stores encrypted at rest (SQLite and PostgreSQL).

SQL cannot read a sealed turn's trace or context, nor a sealed checkpoint's status:
an encrypted memory store selects the turns whose trace goes in Python (a page per
transaction) and writes a sealed ``[]`` and a sealed ``null`` in their place, so that
every turn still opens afterwards; an encrypted SQLite checkpoint store opens each old
body to keep the running ones.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import touba
from tests._services import postgres_dsn
from tests.memory.conftest import drop_postgres_tables
from touba.data import Retention, Stores, apply_retention
from touba.memory import SqliteMemoryStore
from touba.providers._types import TraceCall
from touba.runtime import SqliteCheckpointStore

MARKER = "WombatTrace5521"


def sealing() -> touba.Encryption:
    return touba.Encryption(keys={"k1": bytes(32)}, current="k1")


class Place:
    def __init__(self, kind: str, directory: Path) -> None:
        self.kind, self.directory = kind, directory
        self.pg = (postgres_dsn(), f"tr_{uuid.uuid4().hex[:10]}") if kind == "postgres" else None

    def memory(self, encryption: touba.Encryption | None = None) -> Any:
        sealed = encryption or sealing()
        if self.pg is None:
            return SqliteMemoryStore(self.directory / "memory.db", encryption=sealed)
        from touba.memory.postgres import PostgresMemoryStore

        return PostgresMemoryStore(self.pg[0], prefix=self.pg[1], encryption=sealed)

    def checkpoints(self) -> SqliteCheckpointStore:
        if self.pg is None:
            return SqliteCheckpointStore(self.directory / "cp.db", encryption=sealing())
        from touba.runtime import PostgresCheckpointStore

        return PostgresCheckpointStore(  # type: ignore[return-value]
            self.pg[0], table=f"{self.pg[1]}_checkpoints", encryption=sealing()
        )

    def raw_turns(self) -> list[tuple[str, str]]:
        """Every turn's stored (trace, context), raw."""
        select = "SELECT trace, context FROM {} ORDER BY session_id, idx"
        if self.pg is None:
            with closing(sqlite3.connect(self.directory / "memory.db")) as conn:
                return conn.execute(select.format("touba_memory_turns")).fetchall()
        import psycopg

        with psycopg.connect(self.pg[0], autocommit=True) as conn:
            return conn.execute(select.format(f'"{self.pg[1]}_turns"')).fetchall()

    def cleanup(self) -> None:
        if self.pg is not None:
            drop_postgres_tables(*self.pg)
            import psycopg

            with psycopg.connect(self.pg[0], autocommit=True) as conn:
                conn.execute(f'DROP TABLE IF EXISTS "{self.pg[1]}_checkpoints"')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    made = Place(str(request.param), directory)
    yield made
    made.cleanup()


async def test_a_traces_purge_on_an_encrypted_store_keeps_every_turn_readable(
    place: Place,
) -> None:
    async with place.memory() as store:
        traced = 0
        for sid in ("s-a", "s-b"):
            await store.open_session(sid, owner="user:u", agent_ref="support", mode="live")
            for n in range(5):
                call = TraceCall("c1", "lookup", {"q": MARKER}, "ok", {"r": MARKER}, None)
                trace = [[call]] if n % 2 else []
                context = {"note": MARKER} if n % 3 == 0 else None
                traced += bool(trace or context)
                await store.append_turn(
                    sid,
                    user=f"{MARKER} q{n}",
                    replies=[f"r{n}"],
                    trace=trace,
                    context=context,
                )
        assert traced == 6  # turns 0, 1 and 3 of each session
        before = {sid: await store.list_turns(sid) for sid in ("s-a", "s-b")}
        later = datetime.now(UTC) + timedelta(days=2)

        dry = await store.purge_before(traces=later, dry_run=True, batch_size=3)
        assert dry == {"traces": traced}
        assert {sid: await store.list_turns(sid) for sid in before} == before
        # With the turns going too, their traces are not counted twice.
        both = await store.purge_before(turns=later, traces=later, dry_run=True)
        assert both["traces"] == 0

        done = await store.purge_before(traces=later, batch_size=3)  # several pages

        assert done == {"traces": traced}
        for sid, turns in before.items():
            after = await store.list_turns(sid)  # every turn opens
            assert [(t.index, t.user, t.replies, t.created_at) for t in after] == [
                (t.index, t.user, t.replies, t.created_at) for t in turns
            ]
            assert all(t.trace == () and t.context is None for t in after)
        raw = place.raw_turns()
        assert len(raw) == 10
        assert all(
            trace.startswith("tbe1.k1.") and context.startswith("tbe1.k1.")
            for trace, context in raw
        )
        assert await store.purge_before(traces=later) == {"traces": 0}
        # The same through apply_retention.
        report = await apply_retention(Stores(memory=store), Retention(traces_days=1), now=later)
        assert report.counts == {"memory": {"traces": 0}}


async def test_turns_younger_than_the_bound_keep_their_trace(place: Place) -> None:
    async with place.memory() as store:
        await store.open_session("s", owner="user:u", agent_ref="support", mode="live")
        call = TraceCall("c1", "lookup", {}, "ok", 1, None)
        await store.append_turn("s", user="q", replies=["r"], trace=[[call]], context={"n": 1})
        earlier = datetime.now(UTC) - timedelta(days=1)
        assert await store.purge_before(traces=earlier) == {"traces": 0}
        (turn,) = await store.list_turns("s")
        assert turn.trace == ((call,),)
        assert turn.context == {"n": 1}


async def test_abandoned_encrypted_checkpoints_go_and_running_ones_stay(place: Place) -> None:
    async with place.checkpoints() as store:
        await store.save("awaiting", {"agent_ref": "a", "input": MARKER})
        await store.save("failed", {"status": "failed", "revision": 2})
        await store.save("running", {"status": "running", "revision": 1})
        later = datetime.now(UTC) + timedelta(days=2)
        assert await store.purge_before(later, dry_run=True, batch_size=1) == 2
        assert len(await store.list()) == 3
        assert await store.purge_before(later, batch_size=1) == 2
        assert [i.checkpoint_id for i in await store.list()] == ["running"]
        assert (await store.get("running")) == {"status": "running", "revision": 1}
        assert await store.purge_before(later) == 0


async def test_a_traces_purge_reads_each_turn_by_its_plaintext_whatever_its_key(
    place: Place,
) -> None:
    """An empty context (``{}``) is a context and goes (its token is shorter than a sealed
    ``null``'s); turns sealed with an older key are read and the
    ones with something to drop re-sealed with the current key."""
    async with place.memory() as store:
        await store.open_session("s", owner="user:u", agent_ref="support", mode="live")
        await store.append_turn("s", user="q0", replies=["r"], trace=[], context={})
        call = TraceCall("c1", "lookup", {}, "ok", 1, None)
        await store.append_turn("s", user="q1", replies=["r"], trace=[[call]])
        await store.append_turn("s", user="q2", replies=["r"])  # nothing to drop
    later = datetime.now(UTC) + timedelta(days=2)
    rotated = touba.Encryption(keys={"k1": bytes(32), "k2": b"2" * 32}, current="k2")
    async with place.memory(rotated) as store:
        assert await store.purge_before(traces=later, dry_run=True) == {"traces": 2}
        assert await store.purge_before(traces=later) == {"traces": 2}
        turns = await store.list_turns("s")
        assert [(t.user, t.trace, t.context) for t in turns] == [
            ("q0", (), None),
            ("q1", (), None),
            ("q2", (), None),
        ]
        raw = place.raw_turns()
        assert [trace[:8] for trace, _ in raw[:2]] == ["tbe1.k2.", "tbe1.k2."]
        assert raw[2][0].startswith("tbe1.k1.")  # not rewritten: it had nothing
        assert await store.purge_before(traces=later) == {"traces": 0}
