"""PostgresHistoryStore with many workers on one conversation (issue 29, item 7b).

A reservation reads the conversation's tail in the statement that claims it. Under
READ COMMITTED, that statement's UPDATE may wait for the row and then claim the row
as another worker's decision left it (the newest version), while its read of the
messages sees the statement's snapshot, taken before that decision's save: an
exchange the row counts and the read lacks made a healthy conversation look damaged
("in exchange N, it holds no message"). Here a test-only statement trigger holds one
store's statements back right after their snapshot (as a loaded machine does when it
deschedules the backend), so the race happens every time; then processes hammer one
key as real workers do. Each test works in a schema of its own.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests._services import postgres_dsn
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    check_record,
)
from touba.history.postgres import PostgresHistoryStore

pytestmark = pytest.mark.postgres

WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")
HELD_BACK = "touba_held_back"  # the application_name whose statements wait at the gate


@pytest.fixture
def schema() -> Iterator[str]:
    name = f"t{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
async def made(schema: str) -> AsyncIterator[list[PostgresHistoryStore]]:
    stores: list[PostgresHistoryStore] = []
    yield stores
    for store in stores:
        await store.close()


def _store(
    made: list[PostgresHistoryStore], schema: str, dsn: str | None = None
) -> PostgresHistoryStore:
    store = PostgresHistoryStore(dsn or postgres_dsn(), table=f"{schema}.h")
    made.append(store)
    return store


def _history(store: PostgresHistoryStore) -> DecisionHistory:
    return DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))


async def _decide(history: DecisionHistory, text: str) -> list[str | None]:
    """One final decision saying ``text``; the texts of the decisions it was shown."""
    shown: list[str | None] = []

    async def generate(window: HistoryWindow) -> DecisionMessage:
        shown.extend(
            m.text for ex in window.exchanges for m in ex if isinstance(m, DecisionMessage)
        )
        return DecisionMessage(text=text, final=True)

    await history.step(WHO, [], generate)
    return shown


async def test_a_claim_held_back_past_another_workers_decision_reads_what_it_claimed(
    made: list[PostgresHistoryStore], schema: str
) -> None:
    """Worker B's claim takes its snapshot, is held back, and meanwhile worker A
    reserves, decides and saves: B then claims the row A left. B must be shown A's
    decision (or be refused busy), never a conversation short of it ("damaged")."""
    gate = random.randrange(1, 2**31)
    a = _history(_store(made, schema))
    b = _history(_store(made, schema, make_conninfo(postgres_dsn(), application_name=HELD_BACK)))
    for step in range(3):  # B reads ahead (its hints) and caches the tail it saved
        await _decide(b, f"b{step}")
    await _decide(a, "a0")  # B's cached tail is stale: its next claim reads the rows
    t = sql.Identifier(schema, "h")
    hold = sql.Identifier(schema, "held_back")
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        # Test-only: a statement trigger that makes B's UPDATEs of the row table wait at
        # the gate after their snapshot was taken, before they reach the row.
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF current_setting('application_name') = {name} THEN"
                "  PERFORM pg_advisory_lock({gate}); PERFORM pg_advisory_unlock({gate});"
                " END IF; RETURN NULL; END $$"
            ).format(f=hold, name=sql.Literal(HELD_BACK), gate=sql.Literal(gate))
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER held_back BEFORE UPDATE ON {t}"
                " FOR EACH STATEMENT EXECUTE FUNCTION {f}()"
            ).format(t=t, f=hold)
        )
        conn.execute("SELECT pg_advisory_lock(%s)", (gate,))
        try:
            b_decides = asyncio.create_task(_decide(b, "b3"))
            await _waiting_at_the_gate(conn, b_decides)
            assert await _decide(a, "a1") == ["b0", "b1", "b2", "a0"]  # A is not held back
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (gate,))
        shown = await b_decides
    assert shown == ["b0", "b1", "b2", "a0", "a1"]
    raw = await made[0].read_raw(WHO.key)
    assert raw is not None
    assert check_record(raw) == []
    assert raw.exchanges == 6


async def _waiting_at_the_gate(conn: psycopg.Connection[Any], task: asyncio.Task[Any]) -> None:
    """Returns once a backend of B waits for the gate's advisory lock."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert not task.done(), task.result()
        [(waiting,)] = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            (HELD_BACK,),
        ).fetchall()
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("B's claim never reached the gate")


WORKERS = 6
ATTEMPTS = 40  # per worker


async def test_workers_hammering_one_conversation_never_find_it_damaged(
    made: list[PostgresHistoryStore], schema: str
) -> None:
    """Six processes decide on one key at once: each attempt is saved or refused busy
    (DecisionHistoryBusy, retryable), none is called damaged, every saved decision is
    in the record, and the record verifies at the end."""
    table = f"{schema}.h"
    await _store(made, schema).open()  # the tables exist before the workers race
    children = [
        await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "tests.history._pg_hammer", postgres_dsn(), table],
            str(ATTEMPTS),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=Path(__file__).parents[2],
        )
        for _ in range(WORKERS)
    ]
    try:
        outputs = [await asyncio.wait_for(child.communicate(), 120) for child in children]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    totals: dict[str, int] = {}
    for child, (out, errors) in zip(children, outputs, strict=True):
        assert child.returncode == 0, errors.decode()
        counts = json.loads(out.decode().strip().splitlines()[-1])
        assert counts.pop("others") == {}, counts
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
    assert totals.get("damaged", 0) == 0, totals
    assert totals.get("invalid", 0) == 0, totals
    assert totals["saved"] + totals.get("busy", 0) == WORKERS * ATTEMPTS, totals
    assert totals.get("busy", 0) > 0, totals  # the workers did contend for the key
    raw = await made[0].read_raw(WHO.key)
    assert raw is not None
    assert check_record(raw) == []
    assert raw.exchanges == totals["saved"]  # no acknowledged decision lost
    assert not raw.active
