"""SqliteMemoryStore: file safety, durability, sessions and turns on a real file."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from tests._sqlite import set_schema_version
from tests.memory.conftest import FakeClock
from touba.errors import ConfigurationError, DecisionHistoryStorageUnsafe, MemoryStoreUnavailable
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventsConfig, KeyEventService, MemoryStore, owner_for
from touba.memory.sqlite import SqliteMemoryStore
from touba.providers import TraceCall

CALL = TraceCall("c1", "lookup_order", {"order_id": "A1"}, "ok", {"state": "shipped"})


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_the_file_and_its_companions_are_private(private_dir: Path) -> None:
    path = private_dir / "memory.db"
    async with SqliteMemoryStore(path) as store:
        contract: MemoryStore = store  # checked by mypy too
        assert isinstance(contract, MemoryStore)
        await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
        files = [path.with_name(path.name + suffix) for suffix in ("", "-wal", "-shm")]
        assert [mode(f) for f in files] == [0o600] * 3  # created 0600 before SQLite opened them


async def test_an_existing_file_is_reset_to_0600(private_dir: Path) -> None:
    path = private_dir / "memory.db"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    await SqliteMemoryStore(path).close()
    assert mode(path) == 0o600


def test_unsafe_locations_are_refused_before_anything_is_created(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # noqa: S103 - the unsafe directory under test
    with pytest.raises(DecisionHistoryStorageUnsafe):
        SqliteMemoryStore(shared / "memory.db")
    assert not (shared / "memory.db").exists()


def test_a_symbolic_link_is_refused(private_dir: Path) -> None:
    target = private_dir / "elsewhere.db"
    target.touch()
    (private_dir / "memory.db").symlink_to(target)
    with pytest.raises(DecisionHistoryStorageUnsafe):
        SqliteMemoryStore(private_dir / "memory.db")


async def test_everything_survives_a_reopen(private_dir: Path, clock: FakeClock) -> None:
    path = private_dir / "memory.db"
    owner = owner_for("u-42", "s-1")
    async with SqliteMemoryStore(path, clock=clock) as store:
        await store.open_session("s-1", owner=owner, agent_ref="support", mode="live")
        await store.append_turn("s-1", user="où est A1 ?", replies=["en route"], trace=[[CALL]])
        events = KeyEventService(store, KeyEventsConfig(enabled=True, types=("refund",)))
        event = await events.create(owner, "refund", "Refund A1", "", "s-1")
        await store.end_session("s-1")
    async with SqliteMemoryStore(path, clock=clock) as store:
        meta = await store.get_session("s-1")
        assert meta is not None
        assert (meta.owner, meta.turns, meta.ended_at) == (owner, 1, clock.now)
        (turn,) = await store.recent_turns("s-1", 30)
        assert (turn.user, turn.replies, turn.trace, turn.index) == (
            "où est A1 ?",
            ("en route",),
            ((CALL,),),
            0,
        )
        assert turn.created_at == clock.now
        assert turn.created_at.tzinfo is not None
        found = await store.get_event(owner, event.id)
        assert found is not None
        assert found.title == "Refund A1"


async def test_it_can_share_a_file_with_the_history_store(private_dir: Path) -> None:
    path = private_dir / "touba.db"
    history = SqliteHistoryStore(path)
    try:
        async with SqliteMemoryStore(path) as memory:
            await memory.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
        assert await history.list() == []
    finally:
        await history.close()
    async with SqliteMemoryStore(path) as memory:
        assert await memory.get_session("s-1") is not None


async def test_a_file_of_another_schema_version_is_refused_untouched(private_dir: Path) -> None:
    path = private_dir / "memory.db"
    await SqliteMemoryStore(path).close()
    set_schema_version(path, "memory_schema_version", "99")
    before = path.read_bytes()
    with pytest.raises(ConfigurationError, match="version '99'"):
        SqliteMemoryStore(path)
    assert path.read_bytes() == before


async def test_a_file_that_is_not_a_database_is_a_typed_error(private_dir: Path) -> None:
    path = private_dir / "memory.db"
    path.write_bytes(b"not a database" * 100)
    os.chmod(path, 0o600)
    with pytest.raises(MemoryStoreUnavailable):
        SqliteMemoryStore(path)


async def test_a_closed_store_refuses_calls_and_closing_twice_is_fine(private_dir: Path) -> None:
    store = SqliteMemoryStore(private_dir / "memory.db")
    await store.close()
    await store.close()
    with pytest.raises(ConfigurationError, match="closed"):
        await store.get_session("s-1")


def test_misuse_is_refused_at_construction(private_dir: Path) -> None:
    with pytest.raises(ConfigurationError):
        SqliteMemoryStore(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        SqliteMemoryStore(private_dir / "missing" / "memory.db")
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        SqliteMemoryStore(
            private_dir / "memory.db", clock=lambda: __import__("datetime").datetime(2026, 1, 1)
        )


async def test_concurrent_turns_get_distinct_indices_in_order(private_dir: Path) -> None:
    async with SqliteMemoryStore(private_dir / "memory.db") as store:
        await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
        await asyncio.gather(
            *(store.append_turn("s-1", user=f"q{i}", replies=[f"a{i}"]) for i in range(20))
        )
        turns = await store.recent_turns("s-1", 100)
        assert [t.index for t in turns] == list(range(20))
        assert sorted(t.user for t in turns) == sorted(f"q{i}" for i in range(20))


async def test_a_cancelled_call_still_commits_or_rolls_back_whole(private_dir: Path) -> None:
    async with SqliteMemoryStore(private_dir / "memory.db") as store:
        await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
        task = asyncio.ensure_future(store.append_turn("s-1", user="q", replies=["a"]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        meta = await store.get_session("s-1")
        assert meta is not None
        assert len(await store.recent_turns("s-1", 10)) == meta.turns


async def test_sessions_refuse_an_unknown_mode_and_a_foreign_reopen(private_dir: Path) -> None:
    async with SqliteMemoryStore(private_dir / "memory.db") as store:
        with pytest.raises(ConfigurationError, match="mode"):
            await store.open_session("s-1", owner="user:u", agent_ref="a", mode="debug")  # type: ignore[arg-type]
        first = await store.open_session("s-1", owner="user:u", agent_ref="a", mode="live")
        assert await store.open_session("s-1", owner="user:u", agent_ref="a", mode="live") == first
        for owner, agent, mode, differ in (
            ("user:v", "a", "live", "with another owner; "),
            ("user:u", "b", "live", "with another agent (it is agent 'a''s, not 'b'); "),
            ("user:u", "a", "preview", "with another mode (it is a live session, not preview)"),
            ("user:v", "b", "preview", "another owner, another agent (it is agent 'a''s, not"),
        ):
            with pytest.raises(ConfigurationError, match="already exists") as refused:
                await store.open_session("s-1", owner=owner, agent_ref=agent, mode=mode)  # type: ignore[arg-type]
            assert differ in str(refused.value)  # names what differs ...
            assert "user:u" not in str(refused.value)  # ... never the session's owner
        with pytest.raises(ConfigurationError, match="never opened"):
            await store.end_session("s-404")
        assert await store.list_sessions(limit=-1) == []


async def test_nan_in_a_turn_or_a_job_result_is_refused_by_path(tmp_path: Path) -> None:
    import math

    from touba.errors import ConfigurationError
    from touba.providers import TraceCall

    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    async with SqliteMemoryStore(directory / "memory.sqlite") as store:
        await store.open_session("s1", owner="user:u", agent_ref="a", mode="live")
        call = TraceCall("c1", "measure", {"item": "A1"}, "ok", {"value": math.nan})
        with pytest.raises(ConfigurationError, match=r'trace\[0\]\[0\]\["result"\]\[key 0\]'):
            await store.append_turn("s1", user="hi", replies=["ok"], trace=[[call]])
        assert await store.recent_turns("s1", 5) == ()
