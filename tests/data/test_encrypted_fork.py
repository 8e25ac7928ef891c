"""Fork and rewind of chat sessions kept in memory stores encrypted at rest (SQLite and
PostgreSQL).

A sealed turn is bound to its session id and index, so a fork cannot copy the sealed
values as they are (the copy would not open): ``fork_session`` opens each turn and
seals it again for the new session. The fork's turns read back equal to the
original's, the next turn of the fork is sent them, the original is unchanged, and
nothing the fork wrote is plaintext.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import touba
from tests._services import postgres_dsn
from tests.memory._chat import Scripted, build_runtime, memory
from tests.memory.conftest import drop_postgres_tables
from touba import ChatSession
from touba.memory import SqliteMemoryStore, StoredTurn

MARKER = "QuokkaFork4412"


def sealing() -> touba.Encryption:
    return touba.Encryption(keys={"k1": bytes(32)}, current="k1")


class Place:
    """An encrypted memory store on a SQLite file or PostgreSQL tables, and raw reads."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind, self.directory = kind, directory
        self.pg = (postgres_dsn(), f"tf_{uuid.uuid4().hex[:10]}") if kind == "postgres" else None

    def open(self) -> Any:
        if self.pg is None:
            return SqliteMemoryStore(self.directory / "memory.db", encryption=sealing())
        from touba.memory.postgres import PostgresMemoryStore

        return PostgresMemoryStore(self.pg[0], prefix=self.pg[1], encryption=sealing())

    def turn_rows(self, session_id: str) -> list[tuple[Any, ...]]:
        """The session's stored turn rows, raw: (idx, user_text, replies, trace, context)."""
        select = "SELECT idx, user_text, replies, trace, context FROM {} WHERE session_id = "
        if self.pg is None:
            with closing(sqlite3.connect(self.directory / "memory.db")) as conn:
                query = select.format("touba_memory_turns") + "? ORDER BY idx"
                return [tuple(r) for r in conn.execute(query, (session_id,)).fetchall()]
        import psycopg

        with psycopg.connect(self.pg[0], autocommit=True) as conn:
            query = select.format(f'"{self.pg[1]}_turns"') + "%s ORDER BY idx"
            return [tuple(r) for r in conn.execute(query, (session_id,)).fetchall()]

    def cleanup(self) -> None:
        if self.pg is not None:
            drop_postgres_tables(*self.pg)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    made = Place(str(request.param), directory)
    yield made
    made.cleanup()


def _whole(turns: tuple[StoredTurn, ...]) -> list[tuple[Any, ...]]:
    return [
        (t.index, t.user, t.replies, t.trace, t.invocation_id, t.created_at, t.context)
        for t in turns
    ]


def _sent(model: Scripted) -> list[tuple[str, tuple[str, ...], Any]]:
    return [(t.user, t.replies, t.trace) for t in model.requests[-1].prior_turns]


async def test_a_fork_of_an_encrypted_session_reads_back_and_continues(place: Place) -> None:
    model = Scripted()
    runtime = build_runtime(model, config=memory(short_term_turns=30, full_context_turns=5))
    async with place.open() as store:
        original = ChatSession(runtime, "support", "u-1", f"s-{uuid.uuid4().hex}", store=store)
        async with original:
            for number in range(3):
                model.calls(("lookup_order", {"order_id": f"A{number}"}))
                model.say(f"{MARKER} answer {number}")
                await original.send(f"{MARKER} question {number}")
            stored = await store.list_turns(original.session_id, limit=100)
            raw_before = place.turn_rows(original.session_id)
            assert all(str(v).startswith("tbe1.k1.") for r in raw_before for v in r[1:])
            for k in range(1, 4):
                async with await original.fork(k) as fork:
                    copied = await store.list_turns(fork.session_id, limit=100)
                    assert _whole(copied) == _whole(stored[:k])
                    assert all(t.session_id == fork.session_id for t in copied)
                    raw = place.turn_rows(fork.session_id)
                    assert len(raw) == k
                    assert all(str(v).startswith("tbe1.k1.") for r in raw for v in r[1:])
                    assert MARKER not in repr(raw)
                    # sealed again for the fork's place, not the original's tokens copied
                    assert not {v for r in raw for v in r[1:]} & {
                        v for r in raw_before for v in r[1:]
                    }
                    model.say("continued")
                    turn = await fork.send("and now?")
                    assert turn.stored is not None
                    assert turn.stored.index == k
                    assert _sent(model) == [(t.user, t.replies, t.trace) for t in stored[:k]]
                    # rewinding the encrypted fork keeps whole, readable turns
                    await fork.rewind(k - 1)
                    kept = await store.list_turns(fork.session_id, limit=100)
                    assert _whole(kept) == _whole(stored[: k - 1])
            assert await store.list_turns(original.session_id, limit=100) == stored
            assert place.turn_rows(original.session_id) == raw_before


async def test_a_fork_refuses_a_turn_that_does_not_open_and_writes_nothing(
    place: Place,
) -> None:
    from touba.errors import DecisionHistoryRecordInvalid

    async with place.open() as store:
        await store.open_session("s", owner="user:u", agent_ref="support", mode="live")
        for n in range(2):
            await store.append_turn("s", user=f"q{n}", replies=[f"r{n}"])
        first, second = place.turn_rows("s")
        # turn 1's user text swapped with turn 0's: each is a valid token, in the wrong place
        _swap_user_text(place, "s", 1, first[1])
        with pytest.raises(DecisionHistoryRecordInvalid):
            await store.fork_session("s", "s-fork", at_turn=2, owner="user:u")
        assert await store.get_session("s-fork") is None
        assert place.turn_rows("s-fork") == []
        _swap_user_text(place, "s", 1, second[1])
        await store.fork_session("s", "s-fork", at_turn=2, owner="user:u")
        assert [t.user for t in await store.list_turns("s-fork")] == ["q0", "q1"]


def _swap_user_text(place: Place, session_id: str, idx: int, value: str) -> None:
    update = "UPDATE {} SET user_text = "
    if place.pg is None:
        with closing(sqlite3.connect(place.directory / "memory.db")) as conn:
            query = update.format("touba_memory_turns") + "? WHERE session_id = ? AND idx = ?"
            conn.execute(query, (value, session_id, idx))
            conn.commit()
        return
    import psycopg

    with psycopg.connect(place.pg[0], autocommit=True) as conn:
        query = update.format(f'"{place.pg[1]}_turns"') + "%s WHERE session_id = %s AND idx = %s"
        conn.execute(query, (value, session_id, idx))
