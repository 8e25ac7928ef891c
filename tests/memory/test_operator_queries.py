"""The operator's reads (the memory panel's): key events across owners, sessions by mode,
turns newest first. On SQLite and on PostgreSQL (the ``store`` fixture runs both)."""

from __future__ import annotations

import pytest

from tests.memory.conftest import FakeClock
from touba.errors import ConfigurationError
from touba.memory import KeyEvent, KeyEventsConfig, KeyEventService
from touba.memory._model import SessionMode
from touba.memory._sql import SqlMemoryStore

TYPES = ("refund", "bug")


async def _events(store: SqlMemoryStore, clock: FakeClock) -> dict[str, KeyEvent]:
    """Events of three owners, one second apart, in the order written here."""
    service = KeyEventService(store, KeyEventsConfig(enabled=True, types=TYPES))
    made = {}
    for name, owner, type_, title, details in (
        ("a1", "user:alice", "refund", "Refund order A1", "asked twice"),
        ("b1", "user:bob", "refund", "REFUND for B7", ""),
        ("c1", "session:anon-1", "bug", "App crashes", "on refund screen"),
        ("a2", "user:alice", "bug", "Login loop", "Élodie's account"),
        ("b2", "user:bob", "bug", "Closed matter", "refund done"),
    ):
        clock.advance(1)
        made[name] = await service.create(owner, type_, title, details, "s-1")
    clock.advance(1)
    await service.update("user:bob", made["b2"].id, status="closed", session_id="s-1")
    clock.advance(1)
    # An update moves an older event of alice before everyone's newer ones.
    await service.update("user:alice", made["a1"].id, status="in_progress", session_id="s-1")
    return made


def _ids(found: list[KeyEvent]) -> list[str]:
    return [e.id for e in found]


async def test_key_events_are_found_across_owners_most_recently_updated_first(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    made = await _events(store, clock)
    every = await store.query_all_events()
    assert _ids(every) == [made[n].id for n in ("a1", "a2", "c1", "b1")]  # closed left out
    assert await store.count_all_events() == 4
    assert {e.owner for e in every} == {"user:alice", "user:bob", "session:anon-1"}
    assert all(e.history is None for e in every)  # not loaded
    with_closed = await store.query_all_events(include_closed=True)
    assert _ids(with_closed) == [made[n].id for n in ("a1", "b2", "a2", "c1", "b1")]
    assert await store.count_all_events(include_closed=True) == 5


async def test_the_search_filters_by_text_type_and_status(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    made = await _events(store, clock)
    # Text: a case-insensitive substring of the title or the details, every owner's.
    refund = await store.query_all_events(text="refund")
    assert _ids(refund) == [made[n].id for n in ("a1", "c1", "b1")]
    assert await store.count_all_events(text="refund") == 3
    assert _ids(await store.query_all_events(text="refund", include_closed=True)) == [
        made[n].id for n in ("a1", "b2", "c1", "b1")
    ]
    assert _ids(await store.query_all_events(text="éLODIE")) == [made["a2"].id]  # Unicode case
    # Type: exact.
    assert _ids(await store.query_all_events(type="bug")) == [made[n].id for n in ("a2", "c1")]
    assert await store.query_all_events(type="Bug") == []
    # Status: one of them (closed ones only when asked for with include_closed).
    in_progress = await store.query_all_events(status="in_progress")
    assert _ids(in_progress) == [made["a1"].id]
    closed = await store.query_all_events(status="closed", include_closed=True)
    assert _ids(closed) == [made["b2"].id]
    assert await store.count_all_events(status="closed", include_closed=True) == 1
    both = await store.query_all_events(type="bug", text="refund", include_closed=True)
    assert _ids(both) == [made[n].id for n in ("b2", "c1")]


async def test_the_search_takes_odd_text_literally(store: SqlMemoryStore, clock: FakeClock) -> None:
    service = KeyEventService(store, KeyEventsConfig(enabled=True, types=TYPES))
    titles = ("100% off", "a_b", "back\\slash", 'it\'s "quoted"', "plain ab", "tab;--")
    for index, title in enumerate(titles):
        clock.advance(1)
        await service.create(f"user:u{index}", "bug", title, "", "s-1")
    for text, expected in (
        ("%", ["100% off"]),
        ("_", ["a_b"]),
        ("\\", ["back\\slash"]),
        ("'", ['it\'s "quoted"']),
        ('"', ['it\'s "quoted"']),
        ("%off", []),
        ("a%b", []),
        (";--", ["tab;--"]),
        ("') OR 1=1 --", []),
    ):
        found = await store.query_all_events(text=text)
        assert [e.title for e in found] == expected, text
        assert await store.count_all_events(text=text) == len(expected)
    assert await store.query_all_events(type="bug' OR '1'='1") == []


async def test_the_search_pages_with_limit_and_offset(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    service = KeyEventService(store, KeyEventsConfig(enabled=True, types=TYPES))
    for index in range(25):
        clock.advance(1)
        await service.create(f"user:u{index % 3}", "bug", f"case {index}", "", "s-1")
    pages = [await store.query_all_events(limit=10, offset=offset) for offset in (0, 10, 20, 30)]
    titles = [[e.title for e in page] for page in pages]
    assert titles[0] == [f"case {i}" for i in range(24, 14, -1)]
    assert titles[1] == [f"case {i}" for i in range(14, 4, -1)]
    assert titles[2] == [f"case {i}" for i in range(4, -1, -1)]
    assert titles[3] == []
    assert await store.query_all_events(limit=-1) == []
    assert await store.count_all_events() == 25


@pytest.mark.parametrize(
    "filters",
    [
        {"text": "a\x00b"},
        {"type": "bu\x00g"},
        {"status": "done"},
        {"text": 5},
        {"type": ["bug"]},
    ],
)
async def test_a_filter_no_store_can_match_is_a_configuration_error(
    store: SqlMemoryStore, filters: dict[str, object]
) -> None:
    with pytest.raises(ConfigurationError):
        await store.query_all_events(**filters)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await store.count_all_events(**filters)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await store.query_events("user:alice", **filters)  # type: ignore[arg-type]


async def test_sessions_and_owners_are_listed_by_mode(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    sessions: tuple[tuple[str, str, SessionMode], ...] = (
        ("s-1", "user:alice", "live"),
        ("s-2", "user:bob", "live"),
        ("p-1", "session:p-1", "preview"),
        ("p-2", "user:alice", "preview"),
    )
    for session_id, owner, mode in sessions:
        clock.advance(1)
        await store.open_session(session_id, owner=owner, agent_ref="support", mode=mode)
        await store.append_turn(session_id, user="hi", replies=["hello"])
    live = await store.list_owners(mode="live")
    assert [(o.owner, o.sessions, o.turns, o.preview_sessions) for o in live] == [
        ("user:bob", 1, 1, 0),
        ("user:alice", 1, 1, 0),
    ]
    preview = await store.list_owners(mode="preview")
    assert [(o.owner, o.sessions, o.preview_sessions) for o in preview] == [
        ("user:alice", 1, 1),
        ("session:p-1", 1, 1),
    ]
    every = await store.list_owners()
    assert [(o.owner, o.sessions, o.preview_sessions) for o in every] == [
        ("user:alice", 2, 1),
        ("session:p-1", 1, 1),
        ("user:bob", 1, 0),
    ]
    assert (await store.count_owners(mode="live"), await store.count_owners(mode="preview")) == (
        2,
        2,
    )
    assert await store.count_owners() == 3
    alice_live = await store.list_sessions(owner="user:alice", mode="live")
    assert [s.session_id for s in alice_live] == ["s-1"]
    assert [s.session_id for s in await store.list_sessions(mode="preview")] == ["p-2", "p-1"]
    assert await store.count_sessions(owner="user:alice", mode="preview") == 1
    assert await store.count_sessions(mode="live") == 2
    assert await store.count_sessions() == 4
    with pytest.raises(ConfigurationError, match="mode"):
        await store.list_owners(mode="draft")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="mode"):
        await store.count_sessions(mode="Live")  # type: ignore[arg-type]


async def test_turns_are_paged_newest_first(store: SqlMemoryStore) -> None:
    await store.open_session("s-1", owner="user:alice", agent_ref="support", mode="live")
    for index in range(7):
        await store.append_turn("s-1", user=f"message {index}", replies=[])
    newest = await store.list_turns("s-1", limit=3, newest_first=True)
    assert [t.index for t in newest] == [6, 5, 4]
    older = await store.list_turns("s-1", limit=3, offset=6, newest_first=True)
    assert [t.index for t in older] == [0]
    assert [t.index for t in await store.list_turns("s-1", limit=3)] == [0, 1, 2]  # unchanged
