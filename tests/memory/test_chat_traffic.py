"""Chat traffic on default settings never fills the history store (issue 8, section 1).

``bench/chat_traffic.py`` runs the full target (10,000 turns, 500 users, 50
sessions at a time); this runs the same driver smaller, but well past the
default ``max_sessions`` of 128, on the RAM, SQLite and PostgreSQL history
stores.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from bench.chat_traffic import NAMESPACE, drop_history_tables, run_traffic

from tests._services import postgres_dsn
from touba.errors import DecisionHistoryLimitExceeded
from touba.history import HistoryStore, MemoryHistoryStore
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def history_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[HistoryStore]:
    if request.param == "memory":
        yield MemoryHistoryStore()
    elif request.param == "sqlite":
        async with SqliteHistoryStore(tmp_path / "history.sqlite") as store:
            yield store
    else:
        from touba.history.postgres import PostgresHistoryStore

        dsn, table = postgres_dsn(), f"th_{uuid.uuid4().hex[:10]}"
        try:
            async with PostgresHistoryStore(dsn, table=table) as store:
                yield store
        finally:
            await drop_history_tables(dsn, table)


@pytest.fixture
async def memory_store(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    async with SqliteMemoryStore(tmp_path / "memory.sqlite") as store:
        yield store


async def test_chat_traffic_past_max_sessions_is_never_refused(
    history_store: HistoryStore, memory_store: SqliteMemoryStore
) -> None:
    report = await run_traffic(
        name="test",
        history_store=history_store,
        memory_store=memory_store,
        turns=600,
        users=60,
        concurrency=20,
    )
    assert (report.refusals, report.other_failures, report.retried) == (0, [], [])
    assert report.completed == report.turns == 600  # well over the default 128 conversations
    assert report.samples > 0
    assert report.over_running == 0  # never more conversations than turns running
    assert 0 < report.max_running <= 20
    assert report.max_conversations <= 20
    assert await history_store.list(NAMESPACE) == []  # type: ignore[attr-defined]


async def test_retained_chat_history_fills_the_default_store_and_says_why(
    memory_store: SqliteMemoryStore,
) -> None:
    """The seed's rule (keep finished conversations) on default bounds: turn 129 is
    refused, before the model is called, with an error that names the fix."""
    report = await run_traffic(
        name="retained",
        history_store=MemoryHistoryStore(),
        memory_store=memory_store,
        turns=140,
        users=7,
        concurrency=1,
        retain_decision_history=True,
    )
    assert report.completed == 128
    assert report.refusals == 12
    assert report.generations == 2 * 128  # the refused turns called no model


async def test_the_max_sessions_refusal_under_a_chat_session_names_chat_turns(
    tmp_path: Path, memory_store: SqliteMemoryStore
) -> None:
    from bench.chat_traffic import _program

    from touba import ChatSession
    from touba.history import HistoryConfig
    from touba.runtime import Runtime
    from touba.testing import ScriptedProvider

    history = HistoryConfig(store=MemoryHistoryStore(max_sessions=1), namespace="full")
    provider = ScriptedProvider(
        ScriptedProvider.final("one"), ScriptedProvider.final("two"), history=history
    )
    runtime = Runtime(_program(provider))
    async with ChatSession(
        runtime, "support", "u-1", store=memory_store, retain_decision_history=True
    ) as session:
        assert (await session.send("first")).status == "completed"
        refused = await session.send("second")
    assert refused.status == "failed"
    error = refused.result.error
    assert isinstance(error, DecisionHistoryLimitExceeded)
    assert error.limit == "max_sessions"
    assert "ChatSession" in error.message
    assert "retain_decision_history=False" in error.message
    assert "max_sessions" in error.message
    assert isinstance(error.__cause__, DecisionHistoryLimitExceeded)
