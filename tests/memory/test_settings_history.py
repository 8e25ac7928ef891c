"""Settings with a history (schema 3): every change of an agent's saved memory settings
is recorded with its time and actor, a reset goes back to the program's, and
``resolve_memory_settings`` says where the settings in effect come from."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
from pathlib import Path

import pytest

from tests.memory.conftest import FakeClock, MakeStore
from touba.errors import ConfigurationError
from touba.memory import (
    EffectiveMemoryConfig,
    KeyEventsConfig,
    MemoryConfig,
    MemoryConfigChange,
    SavedMemoryConfig,
    SqliteMemoryStore,
    resolve_memory_settings,
)
from touba.memory._sql import SqlMemoryStore

ONE = MemoryConfig(short_term_turns=1)
FIVE = MemoryConfig(short_term_turns=5, key_events=KeyEventsConfig(enabled=True, types=("a",)))


async def test_each_save_records_before_after_time_and_actor(
    make_store: MakeStore, clock: FakeClock
) -> None:
    store = make_store()
    assert await store.memory_config_history("support") == []
    await store.save_memory_config("support", ONE)
    first = clock.now
    clock.advance(60)
    await store.save_memory_config("support", FIVE, actor="operator")
    assert await store.memory_config_history("support") == [
        MemoryConfigChange("support", ONE, FIVE, clock.now, "operator"),
        MemoryConfigChange("support", None, ONE, first, "api"),
    ]
    assert await store.load_saved_memory_config("support") == SavedMemoryConfig(
        FIVE, clock.now, "operator"
    )
    assert await store.load_memory_config("support") == FIVE
    assert await make_store().memory_config_history("support", limit=1) == [
        MemoryConfigChange("support", ONE, FIVE, clock.now, "operator")
    ]


async def test_saving_the_saved_settings_again_records_and_changes_nothing(
    make_store: MakeStore, clock: FakeClock
) -> None:
    store = make_store()
    await store.save_memory_config("support", FIVE, actor="operator")
    saved_at = clock.now
    clock.advance(30)
    same = MemoryConfig(short_term_turns=5, key_events=KeyEventsConfig(enabled=True, types=("a",)))
    await store.save_memory_config("support", same, actor="cli")
    assert len(await store.memory_config_history("support")) == 1
    assert await store.load_saved_memory_config("support") == SavedMemoryConfig(
        FIVE, saved_at, "operator"
    )


async def test_a_reset_deletes_the_saved_settings_and_is_recorded(
    make_store: MakeStore, clock: FakeClock
) -> None:
    store = make_store()
    assert await store.reset_memory_config("support") is False  # none saved: nothing
    assert await store.memory_config_history("support") == []
    await store.save_memory_config("support", ONE, actor="operator")
    clock.advance(5)
    assert await store.reset_memory_config("support", actor="operator") is True
    assert await store.load_saved_memory_config("support") is None
    assert await store.load_memory_config("support") is None
    [reset, _] = await store.memory_config_history("support")
    assert reset == MemoryConfigChange("support", ONE, None, clock.now, "operator")
    assert await store.reset_memory_config("support", actor="operator") is False
    assert len(await store.memory_config_history("support")) == 2
    await store.save_memory_config("support", FIVE)  # saved again after a reset
    newest = (await store.memory_config_history("support"))[0]
    assert (newest.before, newest.after) == (None, FIVE)


async def test_history_is_per_agent_newest_first_even_when_the_clock_stands_still(
    make_store: MakeStore,
) -> None:
    store = make_store()
    configs = [MemoryConfig(short_term_turns=n) for n in range(1, 6)]
    for config in configs:
        await store.save_memory_config("support", config)
    await store.save_memory_config("other", ONE)
    history = await store.memory_config_history("support")
    assert [c.after for c in history] == configs[::-1]
    assert [c.before for c in history] == [*configs[::-1][1:], None]
    assert len(await store.memory_config_history("support", limit=2)) == 2
    assert await store.memory_config_history("support", limit=0) == []
    assert [c.agent_ref for c in await store.memory_config_history("other")] == ["other"]


@pytest.mark.parametrize("actor", ["", "x" * 65, "oper\nator", "\x1b[31m", 7, None])
async def test_a_bad_actor_is_refused_and_nothing_is_written(
    make_store: MakeStore, actor: object
) -> None:
    store = make_store()
    await store.save_memory_config("support", ONE, actor="operator")
    before = await store.load_saved_memory_config("support")
    with pytest.raises(ConfigurationError, match="actor"):
        await store.save_memory_config("support", FIVE, actor=actor)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="actor"):
        await store.reset_memory_config("support", actor=actor)  # type: ignore[arg-type]
    assert await store.load_saved_memory_config("support") == before
    assert len(await store.memory_config_history("support")) == 1


async def test_an_actor_of_64_printable_characters_is_kept_whole(make_store: MakeStore) -> None:
    store = make_store()
    actor = "é" + "x" * 62 + "!"
    await store.save_memory_config("support", ONE, actor=actor)
    [change] = await store.memory_config_history("support")
    assert change.actor == actor
    saved = await store.load_saved_memory_config("support")
    assert saved is not None
    assert saved.saved_by == actor


async def test_refused_settings_or_agent_write_nothing(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(ConfigurationError, match="agent_ref"):
        await store.reset_memory_config("")
    with pytest.raises(ConfigurationError, match=r"touba\.MemoryConfig"):
        await store.save_memory_config("support", None)  # type: ignore[arg-type]
    assert await store.memory_config_history("support") == []
    assert await store.load_saved_memory_config("support") is None


async def test_concurrent_saves_chain_each_change_to_the_one_before(
    make_store: MakeStore,
) -> None:
    """Two stores on one place save at once: every change's ``before`` is the ``after`` of
    the change just before it, so the history tells what each save really replaced."""
    stores = [make_store(), make_store()]
    configs = [MemoryConfig(short_term_turns=n) for n in range(1, 13)]
    await asyncio.gather(
        *(stores[i % 2].save_memory_config("support", c) for i, c in enumerate(configs)),
        *(stores[i % 2].reset_memory_config("support") for i in range(3)),
    )
    history = (await stores[0].memory_config_history("support", limit=100))[::-1]
    assert history[0].before is None
    for earlier, later in itertools.pairwise(history):
        assert later.before == earlier.after
    saved = await stores[0].load_memory_config("support")
    assert saved == history[-1].after


async def test_resolve_memory_settings_says_where_the_settings_come_from(
    make_store: MakeStore, clock: FakeClock
) -> None:
    store = make_store()
    program = MemoryConfig(short_term_turns=3)
    assert await resolve_memory_settings(store, "support", None) == EffectiveMemoryConfig(
        MemoryConfig(), "defaults"
    )
    assert await resolve_memory_settings(store, "support", program) == EffectiveMemoryConfig(
        program, "program"
    )
    await store.save_memory_config("support", ONE, actor="operator")
    assert await resolve_memory_settings(store, "support", program) == EffectiveMemoryConfig(
        ONE, "saved", clock.now, "operator"
    )
    await store.reset_memory_config("support", actor="operator")
    found = await resolve_memory_settings(store, "support", program)
    assert (found.config, found.source) == (program, "program")
    assert await resolve_memory_settings(object(), "support", None) == EffectiveMemoryConfig(
        MemoryConfig(), "defaults"
    )


async def test_a_store_that_only_loads_settings_still_has_them_applied() -> None:
    """A store of the user's written before settings had a history (``save`` and
    ``load_memory_config`` only): its saved settings still win over the program's."""

    class OldStore:
        async def save_memory_config(self, agent_ref: str, config: MemoryConfig) -> None:
            raise AssertionError("not called")

        async def load_memory_config(self, agent_ref: str) -> MemoryConfig | None:
            return ONE if agent_ref == "support" else None

    program = MemoryConfig(short_term_turns=3)
    found = await resolve_memory_settings(OldStore(), "support", program)
    assert found == EffectiveMemoryConfig(ONE, "saved")  # when and by whom: not known
    other = await resolve_memory_settings(OldStore(), "billing", program)
    assert (other.config, other.source) == (program, "program")


async def test_unreadable_saved_settings_are_replaced_and_the_change_recorded(
    private_dir: Path, clock: FakeClock
) -> None:
    path = private_dir / "memory.db"
    store: SqlMemoryStore
    async with SqliteMemoryStore(path, clock=clock) as store:
        await store.save_memory_config("support", ONE)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE touba_memory_configs SET config = '{\"full_context_turns\": 9}'")
    conn.commit()
    conn.close()
    async with SqliteMemoryStore(path, clock=clock) as store:
        await store.save_memory_config("support", ONE)  # not "equal": it repairs them
        assert await store.load_memory_config("support") == ONE
        [repair, _] = await store.memory_config_history("support")
        assert (repair.before, repair.after) == (None, ONE)
