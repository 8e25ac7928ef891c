"""PostgresMemoryStore under a network that goes silent, cuts or lags (issue 29, item 2).

Through a loopback proxy (tests/_pg_deadlines.py), with ``deadline_seconds=1``: a chat
turn and a key-event update under a black hole fail with the retryable
``MemoryStoreUnavailable`` within the deadline + 1 s, the next ones succeed once the
network is back and every acknowledged turn and update is stored; a key-event update
cut in the middle of its transaction is whole or absent; 50 ms of added round-trip
time slows turns without failing them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._pg_deadlines import DEADLINE, Behind, behind_proxy, fails_in_time, timed_out
from touba import ChatSession, MemoryConfig
from touba.errors import MemoryStoreUnavailable
from touba.memory import owner_for
from touba.memory.postgres import PostgresMemoryStore
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

pytestmark = pytest.mark.postgres
OWNER = owner_for("u-1", "s-1")


@pytest.fixture
def pg() -> Iterator[Behind]:
    with behind_proxy() as behind:
        yield behind


def store_of(pg: Behind, dsn: str | None = None) -> PostgresMemoryStore:
    return PostgresMemoryStore(dsn or pg.dsn, prefix=pg.table("m"), deadline_seconds=DEADLINE)


def runtime_of(*answers: str) -> Runtime:
    program = Program()
    provider = ScriptedProvider(*(ScriptedProvider.final(a) for a in answers))
    program.agent("assistant", provider=provider, kind="agent", memory=MemoryConfig())
    return Runtime(program)


async def test_a_chat_turn_and_a_key_event_update_under_a_black_hole_fail_typed_in_time(
    pg: Behind,
) -> None:
    runtime = runtime_of("one", "two", "three")
    async with store_of(pg) as store:
        session = ChatSession(runtime, "assistant", "u-1", "s-1", store=store)
        assert (await session.send("hello")).status == "completed"
        event = await store.create_event(
            owner=OWNER, type="refund", title="Refund A1", details="broken", session_id="s-1"
        )

        pg.proxy.black_hole()
        turn_error = await fails_in_time(session.send("are you there?"), MemoryStoreUnavailable)
        update_error = await fails_in_time(
            store.update_event(OWNER, event.id, {"title": "Refund A2"}, session_id="s-1"),
            MemoryStoreUnavailable,
        )
        assert timed_out(turn_error)
        assert timed_out(update_error)

        pg.proxy.restore()
        await session.close()
        again = ChatSession(runtime, "assistant", "u-1", "s-1", store=store)
        assert (await again.send("back again")).status == "completed"
        await again.close()
        updated = await store.update_event(OWNER, event.id, {"status": "closed"}, session_id="s-1")
        assert updated is not None
    async with store_of(pg, pg.direct) as direct:
        turns = await direct.recent_turns("s-1", 10)
        stored = await direct.get_event(OWNER, event.id)
    users = [t.user for t in turns]
    assert users[0] == "hello"
    assert users[-1] == "back again"
    assert stored is not None
    assert (stored.title, stored.status) == ("Refund A1", "closed")
    assert stored.history is not None
    assert len(stored.history) == 1


async def test_a_key_event_update_cut_mid_transaction_is_whole_or_absent(pg: Behind) -> None:
    async with store_of(pg) as store, store_of(pg, pg.direct) as direct:
        event = await store.create_event(
            owner=OWNER, type="refund", title="t0", details="broken", session_id="s-1"
        )
        title, updates, failures = "t0", 0, 0
        for nth in range(1, 7):
            pg.proxy.cut_on(nth)
            try:
                await store.update_event(
                    OWNER, event.id, {"title": f"t{nth}"}, session_id="s-1", op_id=f"op-{nth}"
                )
                title, updates = f"t{nth}", updates + 1
            except MemoryStoreUnavailable:
                failures += 1
            pg.proxy.cut_on(0)
            stored = await direct.get_event(OWNER, event.id)
            assert stored is not None
            assert stored.history is not None
            assert (stored.title, len(stored.history)) == (title, updates)
        assert failures >= 2
        assert await store.update_event(OWNER, event.id, {"title": "last"}, session_id="s-1")


async def test_added_latency_slows_a_chat_turn_without_failing_it(pg: Behind) -> None:
    async with store_of(pg) as store:
        pg.proxy.delay(50)
        session = ChatSession(runtime_of("one"), "assistant", "u-1", "s-1", store=store)
        assert (await session.send("hello")).status == "completed"
        await session.close()
        assert [t.user for t in await store.recent_turns("s-1", 5)] == ["hello"]
