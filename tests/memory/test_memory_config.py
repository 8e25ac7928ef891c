"""Per-agent memory settings in both memory stores, and the migrations of older schemas."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Protocol

import pytest

from tests.memory.conftest import FakeClock, MakeStore
from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.memory import (
    KeyEventsConfig,
    KeyEventService,
    MemoryConfig,
    MemoryConfigChange,
    MemoryStore,
    SavedMemoryConfig,
    SqliteMemoryStore,
)
from touba.memory._config import config_from_data, config_to_data
from touba.memory._store import MemoryConfigStore, resolve_memory_config

CONFIG = MemoryConfig(
    short_term_turns=12,
    full_context_turns=0,
    key_events=KeyEventsConfig(enabled=True, types=("refund", " Account issue ")),
)


async def test_settings_round_trip_per_agent_and_survive_a_reopen(make_store: MakeStore) -> None:
    store = make_store()
    assert isinstance(store, MemoryConfigStore)
    assert await store.load_memory_config("support") is None
    await store.save_memory_config("support", CONFIG)
    await store.save_memory_config("other", MemoryConfig())
    assert await store.load_memory_config("support") == CONFIG
    changed = MemoryConfig(short_term_turns=0, full_context_turns=5)
    await store.save_memory_config("support", changed)  # replaces
    again = make_store()
    assert await again.load_memory_config("support") == changed
    assert await again.load_memory_config("other") == MemoryConfig()


async def test_saving_refuses_what_is_not_a_memory_config(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(ConfigurationError, match=r"touba\.MemoryConfig"):
        await store.save_memory_config("support", {"short_term_turns": 3})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="agent_ref"):
        await store.save_memory_config("", CONFIG)


async def test_saved_settings_win_over_the_programs(make_store: MakeStore) -> None:
    store = make_store()
    program = MemoryConfig(short_term_turns=3)
    assert await resolve_memory_config(store, "support", program) == program
    assert await resolve_memory_config(store, "support", None) == MemoryConfig()
    await store.save_memory_config("support", CONFIG)
    assert await resolve_memory_config(store, "support", program) == CONFIG
    assert await resolve_memory_config(object(), "support", program) == program


def test_the_stored_shape_is_plain_json_and_validated_on_the_way_back() -> None:
    data = config_to_data(CONFIG)
    assert data == {
        "short_term_turns": 12,
        "full_context_turns": 0,
        "key_events": {"enabled": True, "types": ["refund", " Account issue "]},
    }
    assert config_from_data(data) == CONFIG
    with pytest.raises(ConfigurationError, match="from 0 to 5"):
        config_from_data({**data, "full_context_turns": 9})
    with pytest.raises(ValueError, match="JSON object"):
        config_from_data([1])


async def test_unreadable_saved_settings_are_a_typed_error(
    private_dir: Path, clock: FakeClock
) -> None:
    path = private_dir / "memory.db"
    async with SqliteMemoryStore(path, clock=clock) as store:
        await store.save_memory_config("support", CONFIG)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE touba_memory_configs SET config = '{\"full_context_turns\": 9}'")
    conn.commit()
    conn.close()
    async with SqliteMemoryStore(path, clock=clock) as store:
        with pytest.raises(MemoryStoreUnavailable, match="save them again"):
            await store.load_memory_config("support")


async def test_the_update_history_names_its_actor(make_store: MakeStore) -> None:
    store = make_store()
    service = KeyEventService(store, KeyEventsConfig(enabled=True, types=("refund",)))
    event = await service.create("user:u", "refund", "Refund D4", "", "s-1")
    await service.update("user:u", event.id, status="in_progress", session_id="s-1")
    await service.update(
        "user:u", event.id, title="Refund D4 (ok)", session_id="panel", actor="operator"
    )
    found = await store.get_event("user:u", event.id)
    assert found is not None
    assert found.history is not None
    assert [(u.actor, u.session_id) for u in found.history] == [
        ("model", "s-1"),
        ("operator", "panel"),
    ]
    with pytest.raises(ConfigurationError, match="actor"):
        await service.update("user:u", event.id, status="closed", session_id="s", actor="x")


# -- version 1 and 2 files and tables -------------------------------------------------------


def _downgrade_sqlite(path: Path, version: int) -> None:
    """Make the file exactly what touba's schema ``version`` (1 or 2) wrote."""
    conn = sqlite3.connect(path)
    for index in ("turns_created", "turns_traced", "sessions_ended", "events_closed"):
        conn.execute(f"DROP INDEX touba_memory_{index}")  # version 4's
    conn.execute("DROP TABLE touba_memory_config_changes")  # its index goes with it
    conn.execute("ALTER TABLE touba_memory_turns DROP COLUMN context")
    conn.execute("ALTER TABLE touba_memory_configs DROP COLUMN saved_by")
    if version == 1:
        conn.execute("DROP TABLE touba_memory_configs")
        conn.execute("DROP INDEX touba_memory_sessions_created")
        conn.execute("DROP INDEX touba_memory_jobs_updated")
        conn.execute("ALTER TABLE touba_memory_history DROP COLUMN actor")
    conn.execute(
        "UPDATE touba_meta SET value = ? WHERE name = 'memory_schema_version'", (str(version),)
    )
    conn.commit()
    conn.close()


@pytest.mark.parametrize("version", [1, 2])
async def test_an_older_sqlite_file_is_migrated_in_place_and_keeps_its_data(
    private_dir: Path, clock: FakeClock, version: int
) -> None:
    path = private_dir / "memory.db"
    async with SqliteMemoryStore(path, clock=clock) as store:
        await _fill(store)
    saved_at = clock.now
    _downgrade_sqlite(path, version)
    clock.advance(60)
    async with SqliteMemoryStore(path, clock=clock) as store:
        await _assert_migrated(store, version, saved_at, clock)
    conn = sqlite3.connect(path)
    row = conn.execute(
        "SELECT value FROM touba_meta WHERE name = 'memory_schema_version'"
    ).fetchone()
    conn.close()
    assert row == ("4",)


class _ConfiguredStore(MemoryStore, MemoryConfigStore, Protocol):
    """A memory store that keeps memory configs too (the built-in ones)."""


async def _fill(store: _ConfiguredStore) -> None:
    """What an older store held: a turn, an event with its history, saved settings."""
    await store.open_session("s-1", owner="user:u", agent_ref="support", mode="live")
    await store.append_turn("s-1", user="hi", replies=["hello"])
    service = KeyEventService(store, KeyEventsConfig(enabled=True, types=("refund",)))
    event = await service.create("user:u", "refund", "Refund", "", "s-1")
    await service.update("user:u", event.id, status="closed", session_id="s-1")
    await store.save_memory_config("support", CONFIG)


async def _assert_migrated(
    store: _ConfiguredStore, version: int, saved_at: datetime, clock: FakeClock
) -> None:
    """The data is kept, and what versions 2 and 3 added works on a migrated store."""
    [turn] = await store.recent_turns("s-1", 5)
    assert (turn.user, turn.replies, turn.context) == ("hi", ("hello",), None)
    [event] = await store.query_events("user:u", include_closed=True)
    found = await store.get_event("user:u", event.id)
    assert found is not None
    assert found.history is not None
    assert [u.actor for u in found.history] == ["model"]
    if version == 2:  # saved settings are kept; who saved them was not recorded
        assert await store.load_saved_memory_config("support") == SavedMemoryConfig(
            CONFIG, saved_at, "unknown"
        )
    else:
        assert await store.load_saved_memory_config("support") is None
    assert await store.memory_config_history("support") == []
    await store.save_memory_config("support", MemoryConfig(), actor="operator")
    assert await store.memory_config_history("support") == [
        MemoryConfigChange(
            "support", CONFIG if version == 2 else None, MemoryConfig(), clock.now, "operator"
        )
    ]
    new = await store.append_turn("s-1", user="q", replies=[], context={"given_turns": [0]})
    assert [t.context for t in await store.recent_turns("s-1", 5)] == [
        None,
        {"given_turns": [0]},
    ]
    assert new.index == 1


@pytest.mark.postgres
@pytest.mark.parametrize("version", [1, 2])
async def test_older_postgresql_tables_are_migrated_in_place(
    pg_prefix: tuple[str, str], clock: FakeClock, version: int
) -> None:
    import psycopg
    from psycopg import sql

    from touba.memory.postgres import PostgresMemoryStore

    dsn, prefix = pg_prefix
    async with PostgresMemoryStore(dsn, prefix=prefix, clock=clock) as store:
        await _fill(store)
    saved_at = clock.now

    def name(table: str) -> sql.Identifier:
        return sql.Identifier(f"{prefix}_{table}")

    with psycopg.connect(dsn, autocommit=True) as conn:
        for index in ("turns_created", "turns_traced", "sessions_ended", "events_closed"):
            conn.execute(sql.SQL("DROP INDEX {}").format(name(f"{index}_idx")))  # version 4's
        conn.execute(sql.SQL("DROP TABLE {}").format(name("config_changes")))
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN context").format(name("turns")))
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN saved_by").format(name("configs")))
        if version == 1:
            conn.execute(sql.SQL("DROP TABLE {}").format(name("configs")))
            conn.execute(sql.SQL("DROP INDEX {}").format(name("sessions_created_idx")))
            conn.execute(sql.SQL("DROP INDEX {}").format(name("jobs_updated_idx")))
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN actor").format(name("history")))
        conn.execute(sql.SQL("UPDATE {} SET value = %s").format(name("meta")), (str(version),))
    clock.advance(60)
    async with PostgresMemoryStore(dsn, prefix=prefix, clock=clock) as store:
        await _assert_migrated(store, version, saved_at, clock)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT value FROM {}").format(name("meta"))).fetchone()
    assert row == ("4",)
