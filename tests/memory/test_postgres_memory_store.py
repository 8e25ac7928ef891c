"""PostgresMemoryStore against the real server of TOUBA_POSTGRES_DSN.

Each test uses tables of its own (``tm_<random>_*``) dropped at teardown. The
behaviour shared with SQLite runs in test_key_events.py and test_extraction.py
on both stores; this file covers what is PostgreSQL's own.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from tests.memory.conftest import FakeClock
from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.memory import MemoryStore, owner_for
from touba.memory.postgres import PostgresMemoryStore
from touba.providers import TraceCall

pytestmark = pytest.mark.postgres


def test_the_store_is_imported_lazily_and_needs_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import touba.memory

    assert touba.memory.PostgresMemoryStore is PostgresMemoryStore
    assert "PostgresMemoryStore" in touba.memory.__all__
    monkeypatch.delitem(sys.modules, "touba.memory.postgres")
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ImportError, match=r'pip install "touba\[postgres\]"'):
        importlib.import_module("touba.memory.postgres")


@pytest.mark.parametrize(
    "options",
    [{}, {"dsn": "postgresql://x", "pool": object()}, {"pool": object()}, {"dsn": 5}],
)
def test_exactly_one_of_dsn_or_pool(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        PostgresMemoryStore(**options)


@pytest.mark.parametrize("prefix", ["", "a-b", "x;drop", "a.b.c", "1abc", "p" * 41])
def test_prefix_must_be_a_plain_identifier(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="prefix"):
        PostgresMemoryStore("postgresql://postgres@127.0.0.1/test", prefix=prefix)


async def test_turns_and_sessions_round_trip(pg_prefix: tuple[str, str], clock: FakeClock) -> None:
    dsn, prefix = pg_prefix
    call = TraceCall("c1", "lookup_order", {"order_id": "A1"}, "error", None, "timeout")
    async with PostgresMemoryStore(dsn, prefix=prefix, clock=clock) as store:
        contract: MemoryStore = store  # checked by mypy too
        assert isinstance(contract, MemoryStore)
        owner = owner_for(None, "s-1")
        await store.open_session("s-1", owner=owner, agent_ref="support", mode="preview")
        await store.append_turn(
            "s-1", user="nul \x00 ok", replies=["a", "b"], trace=[[call], [call]], invocation_id="i"
        )
        (turn,) = await store.recent_turns("s-1", 5)
        assert (turn.user, turn.replies, turn.trace) == (
            "nul \x00 ok",
            ("a", "b"),
            ((call,), (call,)),
        )
        assert turn.created_at == clock.now
        with pytest.raises(ConfigurationError, match="another owner"):
            await store.open_session("s-1", owner="user:mallory", agent_ref="support", mode="live")
        await store.end_session("s-1")
        with pytest.raises(ConfigurationError, match="ended"):
            await store.append_turn("s-1", user="late", replies=[])
        with pytest.raises(ConfigurationError, match="never opened"):
            await store.append_turn("s-404", user="q", replies=[])
        assert [m.session_id for m in await store.list_sessions(owner=owner)] == ["s-1"]
        assert await store.delete_session("s-1") is True
        assert await store.recent_turns("s-1", 5) == ()


async def test_tables_survive_a_new_store_and_a_given_pool_stays_open(
    pg_prefix: tuple[str, str],
) -> None:
    dsn, prefix = pg_prefix
    async with PostgresMemoryStore(dsn, prefix=prefix) as store:
        await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        store = PostgresMemoryStore(pool=pool, prefix=prefix)
        meta = await store.get_session("s-1")
        assert meta is not None
        assert meta.created_at.tzinfo is not None
        await store.close()
        assert not pool.closed
        with pytest.raises(ConfigurationError, match="closed"):
            await store.get_session("s-1")


async def test_concurrent_writers_keep_turns_and_claims_apart(
    pg_prefix: tuple[str, str],
) -> None:
    dsn, prefix = pg_prefix
    async with (
        PostgresMemoryStore(dsn, prefix=prefix) as one,
        PostgresMemoryStore(dsn, prefix=prefix) as two,
    ):
        await one.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
        await asyncio.gather(
            *(
                (one if i % 2 else two).append_turn("s-1", user=f"q{i}", replies=[])
                for i in range(12)
            )
        )
        assert [t.index for t in await one.recent_turns("s-1", 50)] == list(range(12))
        for i in range(4):
            await one.enqueue_job(
                session_id=f"s-{i}",
                owner="user:u",
                agent_ref="a",
                transcript_ref="t",
                max_attempts=3,
            )
        claims = await asyncio.gather(
            *((one if i % 2 else two).claim_job(f"w{i}", 60) for i in range(6))
        )
        claimed = [c.id for c in claims if c is not None]
        assert len(claimed) == 4
        assert len(set(claimed)) == 4  # SKIP LOCKED: no job leased twice


async def test_a_foreign_table_is_refused_untouched(pg_prefix: tuple[str, str]) -> None:
    dsn, prefix = pg_prefix
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier(f"{prefix}_sessions"))
        )
    store = PostgresMemoryStore(dsn, prefix=prefix)
    with pytest.raises(ConfigurationError, match="not touba's"):
        await store.open()
    await store.close()


async def test_another_schema_version_is_refused(pg_prefix: tuple[str, str]) -> None:
    dsn, prefix = pg_prefix
    await PostgresMemoryStore(dsn, prefix=prefix).close()
    async with PostgresMemoryStore(dsn, prefix=prefix) as store:
        await store.get_session("x")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET value = '99'").format(sql.Identifier(f"{prefix}_meta")))
    store = PostgresMemoryStore(dsn, prefix=prefix)
    with pytest.raises(ConfigurationError, match="version '99'"):
        await store.open()
    await store.close()


async def test_an_unreachable_server_is_a_configuration_error_at_open() -> None:
    store = PostgresMemoryStore("postgresql://postgres@127.0.0.1:1/test?connect_timeout=1")
    with pytest.raises(ConfigurationError, match="could not open"):
        await store.get_session("s-1")
    await store.close()


async def test_a_server_lost_during_use_is_memory_store_unavailable(
    pg_prefix: tuple[str, str],
) -> None:
    dsn, prefix = pg_prefix
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        store = PostgresMemoryStore(pool=pool, prefix=prefix)
        await store.open()
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(MemoryStoreUnavailable):
            await store.get_session("s-1")
        await store.close()
