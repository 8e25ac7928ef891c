"""The backend contract of ToubaSessionService's stores (touba.integrations.adk._backend).

Every backend kind runs these; each test names the rule of the protocol it checks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError

from tests.integrations.adk.conftest import BackendOpener
from touba.errors import ConfigurationError, DecisionHistoryBusy, DecisionHistoryLimitExceeded
from touba.integrations.adk._backend import (
    AdkBackend,
    AdkLimits,
    AppendRequest,
    SessionKey,
    StoredEvent,
    busy_key,
)

T0 = 1_765_000_000.123456
KEY = SessionKey("app", "alice", "s1")


def event(event_id: str, timestamp: float, data: Any = None) -> StoredEvent:
    body = {"id": event_id, "timestamp": timestamp, "text": data}
    return StoredEvent(event_id, timestamp, json.dumps(body, ensure_ascii=False))


def req(
    ev: StoredEvent,
    *,
    now: float | None = None,
    revision: int | None = None,
    **kw: Any,
) -> AppendRequest:
    return AppendRequest(
        event=ev,
        update_time=ev.timestamp,
        now=ev.timestamp if now is None else now,
        expected_revision=revision,
        **kw,
    )


async def create(
    backend: AdkBackend, key: SessionKey = KEY, *, now: float = T0, **state: Any
) -> None:
    await backend.create(key, state=state, app_delta={}, user_delta={}, create_time=now, now=now)


async def fill(backend: AdkBackend, n: int, key: SessionKey = KEY, start: float = T0) -> None:
    for i in range(n):
        await backend.append(key, req(event(f"e{i:03d}", start + 1 + i), revision=i))


# --- create -----------------------------------------------------------------


async def test_create_returns_the_session_with_the_states_after_its_deltas(
    adk_backend: AdkBackend,
) -> None:
    await adk_backend.create(
        SessionKey("app", "bob", "x"),
        state={},
        app_delta={"shared": 1},
        user_delta={"lang": "fr"},
        create_time=T0 - 5,
        now=T0 - 5,
    )
    got = await adk_backend.create(
        KEY,
        state={"k": "v", "n": None},
        app_delta={"theme": "dark"},
        user_delta={"tier": 2},
        create_time=T0,
        now=T0,
    )
    assert got.session.key == KEY
    assert dict(got.session.state) == {"k": "v", "n": None}
    assert dict(got.app_state) == {"shared": 1, "theme": "dark"}
    assert dict(got.user_state) == {"tier": 2}
    assert got.events == () or list(got.events) == []
    assert got.session.create_time == T0
    assert got.session.update_time == T0
    assert got.session.revision == 0
    assert (got.session.event_count, got.session.byte_count) == (0, 0)
    assert got.session.holder is None


async def test_create_of_an_existing_key_raises_and_changes_nothing(
    adk_backend: AdkBackend,
) -> None:
    await adk_backend.create(
        KEY, state={"k": 1}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
    )
    with pytest.raises(AlreadyExistsError):
        await adk_backend.create(
            KEY,
            state={"k": 2},
            app_delta={"a": 2},
            user_delta={"u": 2},
            create_time=T0 + 1,
            now=T0 + 1,
        )
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert got is not None
    assert dict(got.session.state) == {"k": 1}
    assert dict(got.app_state) == {"a": 1}
    assert dict(got.user_state) == {"u": 1}
    assert got.session.create_time == T0


async def test_the_same_id_under_another_user_or_app_is_another_session(
    adk_backend: AdkBackend,
) -> None:
    await create(adk_backend, KEY, k="alice")
    await create(adk_backend, SessionKey("app", "bob", "s1"), k="bob")
    await create(adk_backend, SessionKey("other", "alice", "s1"), k="other")
    for key, value in [
        (KEY, "alice"),
        (SessionKey("app", "bob", "s1"), "bob"),
        (SessionKey("other", "alice", "s1"), "other"),
    ]:
        got = await adk_backend.read(key, recent=None, after=None, now=T0)
        assert got is not None
        assert got.session.state["k"] == value


async def test_ids_with_separators_never_collide(adk_backend: AdkBackend) -> None:
    keys = [
        SessionKey("a:b", "c", "d"),
        SessionKey("a", "b:c", "d"),
        SessionKey("a", "b", "c:d"),
        SessionKey("a/b", "c", "d"),
        SessionKey("a", "b/c", "d"),
        SessionKey("a", "", "b"),
        SessionKey("a", "b", "*"),
        SessionKey("ä{x}", "ü\n", "⚙ 1"),
    ]
    for i, key in enumerate(keys):
        await adk_backend.create(
            key,
            state={"i": i},
            app_delta={"app": i},
            user_delta={"user": i},
            create_time=T0,
            now=T0,
        )
        await adk_backend.append(key, req(event(f"e{i}", T0 + 1), revision=0))
    for i, key in enumerate(keys):
        got = await adk_backend.read(key, recent=None, after=None, now=T0 + 1)
        assert got is not None
        assert got.session.key == key
        assert dict(got.session.state) == {"i": i}
        assert [e.event_id for e in got.events] == [f"e{i}"]
        assert dict(await adk_backend.read_user_state(key.app_name, key.user_id))["user"] == max(
            j for j, k in enumerate(keys) if (k.app_name, k.user_id) == (key.app_name, key.user_id)
        )
    listed = await adk_backend.list_sessions("a", None, now=T0 + 1)
    assert sorted((s.key.user_id, s.key.session_id) for s in listed.sessions) == sorted(
        (k.user_id, k.session_id) for k in keys if k.app_name == "a"
    )
    assert [s.key for s in (await adk_backend.list_sessions("a", "b", now=T0 + 1)).sessions] == [
        SessionKey("a", "b", "*"),
        SessionKey("a", "b", "c:d"),
    ]
    await adk_backend.delete(SessionKey("a", "b", "*"))
    assert (
        await adk_backend.read(SessionKey("a", "b", "c:d"), recent=0, after=None, now=T0)
        is not None
    )


# --- append and read -----------------------------------------------------------


async def test_append_stores_the_event_exactly_and_updates_the_session(
    adk_backend: AdkBackend,
) -> None:
    await create(adk_backend)
    first = event("e1", T0 + 1.000001, "héllo ✓")
    result = await adk_backend.append(KEY, req(first, revision=0))
    assert result.appended
    assert result.revision == 1
    assert result.update_time == first.timestamp
    assert result.event_count == 1
    assert result.byte_count == len(first.data.encode())
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert got is not None
    assert list(got.events) == [first]
    assert got.events[0].timestamp == first.timestamp  # exact, not only within 1e-6
    assert got.session.revision == 1
    assert got.session.update_time == first.timestamp
    assert got.session.create_time == T0
    assert (got.session.event_count, got.session.byte_count) == (1, result.byte_count)


async def test_events_come_back_ordered_by_timestamp_then_id(adk_backend: AdkBackend) -> None:
    await create(adk_backend)
    appended = [
        event("b", T0 + 2),
        event("a", T0 + 2),  # tied timestamp: "a" sorts before "b"
        event("c", T0 + 1),  # an earlier timestamp appended later
        event("d", T0 + 3),
    ]
    for i, ev in enumerate(appended):
        await adk_backend.append(KEY, req(ev, revision=i))
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    assert [e.event_id for e in got.events] == ["c", "a", "b", "d"]


@pytest.mark.parametrize(
    ("recent", "after", "expected"),
    [
        (None, None, [f"e{i:03d}" for i in range(10)]),
        (3, None, ["e007", "e008", "e009"]),
        (0, None, []),
        (100, None, [f"e{i:03d}" for i in range(10)]),
        (None, T0 + 8, ["e007", "e008", "e009"]),  # inclusive: e007 is at T0 + 8
        (2, T0 + 5, ["e008", "e009"]),
        (5, T0 + 8, ["e007", "e008", "e009"]),
        (0, T0 + 8, []),
        (None, T0 + 100, []),
    ],
)
async def test_read_returns_only_the_events_asked(
    adk_backend: AdkBackend, recent: int | None, after: float | None, expected: list[str]
) -> None:
    await create(adk_backend)
    await fill(adk_backend, 10)
    got = await adk_backend.read(KEY, recent=recent, after=after, now=T0)
    assert got is not None
    assert [e.event_id for e in got.events] == expected
    assert got.session.event_count == 10


async def test_read_of_an_unknown_session_is_none(adk_backend: AdkBackend) -> None:
    await create(adk_backend)
    assert (
        await adk_backend.read(SessionKey("app", "alice", "nope"), recent=None, after=None, now=T0)
        is None
    )
    assert (
        await adk_backend.read(SessionKey("app", "bob", "s1"), recent=None, after=None, now=T0)
        is None
    )


async def test_deltas_replace_per_key_store_none_and_keep_types(adk_backend: AdkBackend) -> None:
    await adk_backend.create(
        KEY,
        state={"d": {"x": 1, "y": 2}, "keep": "k"},
        app_delta={"a": {"deep": [1, 2]}},
        user_delta={"u": 1},
        create_time=T0,
        now=T0,
    )
    values: dict[str, Any] = {
        "d": {"x": 9},  # replaces the dict whole, "y" gone
        "f": False,
        "z": 0,
        "fl": 1.0,
        "tiny": 0.1 + 0.2,
        "big": 2**70,
        "none": None,
        "s": "ünï",
        "l": [1, "a", None, {"b": True}],
    }
    await adk_backend.append(
        KEY,
        req(
            event("e1", T0 + 1),
            revision=0,
            session_delta=values,
            app_delta={"a": {"other": None}},
            user_delta={"u": None, "v": False},
        ),
    )
    got = await adk_backend.read(KEY, recent=0, after=None, now=T0 + 1)
    assert got is not None
    state = dict(got.session.state)
    assert state == {"keep": "k", **values}
    for name, value in values.items():
        assert type(state[name]) is type(value), name
    assert dict(got.app_state) == {"a": {"other": None}}
    assert dict(got.user_state) == {"u": None, "v": False}
    assert type(got.user_state["v"]) is bool


async def test_scopes_app_shared_by_users_user_by_sessions_session_by_none(
    adk_backend: AdkBackend,
) -> None:
    alice2 = SessionKey("app", "alice", "s2")
    bob = SessionKey("app", "bob", "s3")
    for key in (KEY, alice2, bob):
        await create(adk_backend, key)
    await adk_backend.append(
        KEY,
        req(
            event("e1", T0 + 1),
            revision=0,
            app_delta={"a": 1},
            user_delta={"u": 1},
            session_delta={"s": 1},
        ),
    )
    a2 = await adk_backend.read(alice2, recent=None, after=None, now=T0 + 1)
    b = await adk_backend.read(bob, recent=None, after=None, now=T0 + 1)
    assert a2 is not None
    assert b is not None
    assert (dict(a2.app_state), dict(a2.user_state), dict(a2.session.state)) == (
        {"a": 1},
        {"u": 1},
        {},
    )
    assert (dict(b.app_state), dict(b.user_state), dict(b.session.state)) == ({"a": 1}, {}, {})
    assert dict(await adk_backend.read_user_state("app", "alice")) == {"u": 1}
    assert dict(await adk_backend.read_user_state("app", "bob")) == {}
    assert dict(await adk_backend.read_user_state("nope", "alice")) == {}
    other_app = await adk_backend.create(
        SessionKey("other", "alice", "s1"),
        state={},
        app_delta={},
        user_delta={},
        create_time=T0,
        now=T0,
    )
    assert dict(other_app.app_state) == {}
    assert dict(other_app.user_state) == {}


async def test_read_returns_a_detached_copy(adk_backend: AdkBackend) -> None:
    await adk_backend.create(
        KEY,
        state={"d": {"x": [1]}},
        app_delta={"a": {"y": 1}},
        user_delta={},
        create_time=T0,
        now=T0,
    )
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    got.session.state["d"]["x"].append(2)
    got.app_state["a"]["y"] = 5
    again = await adk_backend.read(KEY, recent=None, after=None, now=T0)
    assert again is not None
    assert dict(again.session.state) == {"d": {"x": [1]}}
    assert dict(again.app_state) == {"a": {"y": 1}}


# --- append's checks, in their order ------------------------------------------------


async def test_append_to_an_unknown_or_deleted_session_raises_and_creates_nothing(
    adk_backend: AdkBackend,
) -> None:
    with pytest.raises(SessionNotFoundError):
        await adk_backend.append(KEY, req(event("e1", T0), app_delta={"a": 1}, user_delta={"u": 1}))
    assert await adk_backend.read(KEY, recent=None, after=None, now=T0) is None
    assert list((await adk_backend.list_sessions("app", None, now=T0)).sessions) == []
    assert dict(await adk_backend.read_user_state("app", "alice")) == {}
    await create(adk_backend)
    await adk_backend.delete(KEY)
    with pytest.raises(SessionNotFoundError):
        await adk_backend.append(KEY, req(event("e2", T0 + 1)))
    assert await adk_backend.read(KEY, recent=None, after=None, now=T0) is None


async def test_an_event_id_already_stored_is_not_appended_again(adk_backend: AdkBackend) -> None:
    await create(adk_backend)
    first = event("e1", T0 + 1, "first")
    await adk_backend.append(KEY, req(first, revision=0, session_delta={"k": 1}))
    again = await adk_backend.append(
        KEY, req(event("e1", T0 + 2, "other"), revision=0, session_delta={"k": 2})
    )
    assert not again.appended
    assert again.revision == 1
    assert again.event_count == 1
    assert again.update_time == first.timestamp
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert got is not None
    assert list(got.events) == [first]
    assert dict(got.session.state) == {"k": 1}


async def test_a_stale_revision_raises_and_writes_nothing(adk_backend: AdkBackend) -> None:
    await create(adk_backend)
    await adk_backend.append(KEY, req(event("e1", T0 + 1), revision=0))
    with pytest.raises(StaleSessionError, match="modified in storage"):
        await adk_backend.append(
            KEY,
            req(
                event("e2", T0 + 2),
                revision=0,
                app_delta={"a": 1},
                user_delta={"u": 1},
                session_delta={"s": 1},
            ),
        )
    got = await adk_backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert got is not None
    assert [e.event_id for e in got.events] == ["e1"]
    assert got.session.revision == 1
    assert got.session.update_time == T0 + 1
    assert (dict(got.app_state), dict(got.user_state), dict(got.session.state)) == ({}, {}, {})
    ok = await adk_backend.append(KEY, req(event("e2", T0 + 2), revision=1))
    assert ok.appended
    assert ok.revision == 2


async def test_without_a_revision_an_older_update_time_is_stale(adk_backend: AdkBackend) -> None:
    await create(adk_backend)
    await adk_backend.append(KEY, req(event("e1", T0 + 1), revision=0))
    stale = AppendRequest(
        event=event("e2", T0 + 2), update_time=T0 + 2, now=T0 + 2, expected_update_time=T0
    )
    with pytest.raises(StaleSessionError):
        await adk_backend.append(KEY, stale)
    current = AppendRequest(
        event=event("e2", T0 + 2), update_time=T0 + 2, now=T0 + 2, expected_update_time=T0 + 1
    )
    assert (await adk_backend.append(KEY, current)).revision == 2
    unchecked = AppendRequest(event=event("e3", T0 + 3), update_time=T0 + 3, now=T0 + 3)
    assert (await adk_backend.append(KEY, unchecked)).revision == 3


async def test_of_two_concurrent_appends_from_one_revision_exactly_one_wins(
    open_backend: BackendOpener,
) -> None:
    first = open_backend()
    second = open_backend() if open_backend.persistent else first
    await create(first)
    for round_ in range(5):
        outcomes = await asyncio.gather(
            first.append(KEY, req(event(f"a{round_}", T0 + 1 + round_), revision=round_)),
            second.append(KEY, req(event(f"b{round_}", T0 + 1 + round_), revision=round_)),
            return_exceptions=True,
        )
        wins = [o for o in outcomes if not isinstance(o, BaseException)]
        losses = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(wins) == 1, outcomes
        assert len(losses) == 1, outcomes
        assert isinstance(losses[0], StaleSessionError), outcomes
    got = await first.read(KEY, recent=None, after=None, now=T0 + 10)
    assert got is not None
    assert got.session.revision == 5
    assert got.session.event_count == 5 == len(got.events)


async def test_bounds_refuse_the_write_and_keep_everything(open_backend: BackendOpener) -> None:
    big = event("big", T0 + 1, "x" * 600)
    size = len(big.data.encode())
    backend = open_backend(limits=AdkLimits(max_event_bytes=size - 1, max_session_bytes=None))
    await create(backend)
    with pytest.raises(DecisionHistoryLimitExceeded) as error:
        await backend.append(KEY, req(big, revision=0, session_delta={"k": 1}))
    assert error.value.limit == "max_bytes"
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
    assert got is not None
    assert list(got.events) == []
    assert dict(got.session.state) == {}
    assert got.session.revision == 0

    e0, e1 = event("e0", T0 + 1, "x" * 600), event("e1", T0 + 2, "x" * 600)
    size = len(e0.data.encode())
    capped = open_backend("capped", AdkLimits(max_event_bytes=None, max_session_bytes=2 * size))
    await create(capped)
    await capped.append(KEY, req(e0, revision=0))
    await capped.append(KEY, req(e1, revision=1))
    with pytest.raises(DecisionHistoryLimitExceeded) as error:
        await capped.append(KEY, req(event("e2", T0 + 3, "x"), revision=2, app_delta={"a": 1}))
    assert error.value.limit == "max_retained_bytes"
    got = await capped.read(KEY, recent=None, after=None, now=T0 + 3)
    assert got is not None
    assert [e.event_id for e in got.events] == ["e0", "e1"]
    assert dict(got.app_state) == {}
    assert got.session.byte_count == 2 * size
    assert got.session.revision == 2


async def test_max_sessions_refuses_a_create_and_counts_only_unexpired_sessions(
    open_backend: BackendOpener,
) -> None:
    backend = open_backend(limits=AdkLimits(max_sessions=2, ttl_seconds=100))
    await create(backend, SessionKey("app", "a", "1"), now=T0)
    await create(backend, SessionKey("app", "b", "2"), now=T0 + 50)
    with pytest.raises(DecisionHistoryLimitExceeded) as error:
        await backend.create(
            SessionKey("app", "c", "3"),
            state={},
            app_delta={"a": 1},
            user_delta={},
            create_time=T0 + 60,
            now=T0 + 60,
        )
    assert error.value.limit == "max_sessions"
    assert (
        await backend.read(SessionKey("app", "c", "3"), recent=None, after=None, now=T0 + 60)
        is None
    )
    assert (await backend.list_sessions("app", None, now=T0 + 60)).app_state == {}
    # the first one expires at T0 + 100: its place is free again
    await create(backend, SessionKey("app", "c", "3"), now=T0 + 101)
    listed = await backend.list_sessions("app", None, now=T0 + 101)
    assert [s.key.session_id for s in listed.sessions] == ["2", "3"]


# --- list -------------------------------------------------------------------------


async def test_list_orders_least_recently_updated_first_ties_by_id_with_states(
    adk_backend: AdkBackend,
) -> None:
    keys = [SessionKey("app", u, s) for u, s in [("alice", "c"), ("bob", "a"), ("alice", "b")]]
    for key in keys:
        await adk_backend.create(
            key, state={"own": key.session_id}, app_delta={}, user_delta={}, create_time=T0, now=T0
        )
    await adk_backend.append(
        keys[0], req(event("e", T0 + 5), revision=0, app_delta={"x": 1}, user_delta={"u": "a"})
    )
    await adk_backend.create(
        SessionKey("other", "alice", "z"),
        state={},
        app_delta={},
        user_delta={},
        create_time=T0,
        now=T0,
    )
    listed = await adk_backend.list_sessions("app", None, now=T0 + 5)
    # ties by user id, then session id
    assert [s.key.session_id for s in listed.sessions] == ["b", "a", "c"]
    assert [s.update_time for s in listed.sessions] == [T0, T0, T0 + 5]
    assert [dict(s.state) for s in listed.sessions] == [{"own": "b"}, {"own": "a"}, {"own": "c"}]
    assert dict(listed.app_state) == {"x": 1}
    assert dict(listed.user_states.get("alice", {})) == {"u": "a"}
    assert dict(listed.user_states.get("bob", {})) == {}
    mine = await adk_backend.list_sessions("app", "alice", now=T0 + 5)
    assert [s.key.session_id for s in mine.sessions] == ["b", "c"]
    assert all(s.event_count == (1 if s.key.session_id == "c" else 0) for s in mine.sessions)
    assert list((await adk_backend.list_sessions("app", "carol", now=T0)).sessions) == []
    assert list((await adk_backend.list_sessions("nope", None, now=T0)).sessions) == []


# --- delete -------------------------------------------------------------------------


async def test_delete_is_scoped_and_takes_the_events_along(adk_backend: AdkBackend) -> None:
    bob = SessionKey("app", "bob", "s1")
    await create(adk_backend)
    await create(adk_backend, bob)
    await adk_backend.append(KEY, req(event("e1", T0 + 1), revision=0, user_delta={"u": 1}))
    await adk_backend.append(bob, req(event("e1", T0 + 1), revision=0))
    await adk_backend.delete(SessionKey("app", "alice", "unknown"))  # a no-op
    await adk_backend.delete(KEY)
    assert await adk_backend.read(KEY, recent=None, after=None, now=T0 + 1) is None
    kept = await adk_backend.read(bob, recent=None, after=None, now=T0 + 1)
    assert kept is not None
    assert [e.event_id for e in kept.events] == ["e1"]
    assert dict(await adk_backend.read_user_state("app", "alice")) == {"u": 1}
    await create(adk_backend, now=T0 + 2)
    fresh = await adk_backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert fresh is not None
    assert list(fresh.events) == []
    assert fresh.session.revision == 0
    await adk_backend.delete(KEY)
    await adk_backend.delete(KEY)


# --- TTL ----------------------------------------------------------------------------


async def test_an_expired_session_is_invisible_then_purged(open_backend: BackendOpener) -> None:
    backend = open_backend(limits=AdkLimits(ttl_seconds=60))
    await create(backend, now=T0)
    other = SessionKey("app", "alice", "s2")
    await create(backend, other, now=T0)
    await backend.append(other, req(event("e1", T0 + 30), revision=0))  # other now lives to T0 + 90
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 59)
    assert got is not None
    assert got.session.expires_at == T0 + 60
    assert await backend.read(KEY, recent=None, after=None, now=T0 + 60) is None
    assert [s.key for s in (await backend.list_sessions("app", None, now=T0 + 61)).sessions] == [
        other
    ]
    with pytest.raises(SessionNotFoundError):
        await backend.append(KEY, req(event("late", T0 + 61), now=T0 + 61))
    assert await backend.purge_expired(now=T0 + 61) == 1
    assert await backend.purge_expired(now=T0 + 61) == 0
    kept = await backend.read(other, recent=None, after=None, now=T0 + 89)
    assert kept is not None
    assert len(kept.events) == 1
    assert await backend.purge_expired(now=T0 + 90) == 1


async def test_an_expired_key_can_be_created_again_without_its_old_events(
    open_backend: BackendOpener,
) -> None:
    backend = open_backend(limits=AdkLimits(ttl_seconds=10))
    await create(backend, now=T0, old=True)
    await backend.append(KEY, req(event("e1", T0 + 1), revision=0))
    with pytest.raises(AlreadyExistsError):
        await create(backend, now=T0 + 5)
    await create(backend, now=T0 + 20)
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 20)
    assert got is not None
    assert list(got.events) == []
    assert dict(got.session.state) == {}
    assert got.session.revision == 0


# --- one writer -----------------------------------------------------------------------


async def test_a_hold_refuses_other_writers_until_released_expired_or_recovered(
    open_backend: BackendOpener,
) -> None:
    backend = open_backend(limits=AdkLimits(hold_seconds=30))
    await create(backend)
    await backend.append(KEY, req(event("a1", T0 + 1), revision=0, owner="run-a"))
    held = await backend.read(KEY, recent=0, after=None, now=T0 + 2)
    assert held is not None
    assert held.session.holder == "run-a"
    for owner in ("run-b", None):
        with pytest.raises(DecisionHistoryBusy) as error:
            await backend.append(
                KEY, req(event("b1", T0 + 2), revision=1, owner=owner, session_delta={"k": 1})
            )
        assert error.value.session_key == busy_key(KEY)
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 2)
    assert got is not None
    assert [e.event_id for e in got.events] == ["a1"]
    assert dict(got.session.state) == {}
    # the holder goes on, and its hold lasts hold_seconds after its last append
    await backend.append(KEY, req(event("a2", T0 + 20), revision=1, owner="run-a"))
    with pytest.raises(DecisionHistoryBusy):
        await backend.append(KEY, req(event("b1", T0 + 49), revision=2, owner="run-b"))
    # expired: another owner may take it
    await backend.append(KEY, req(event("b1", T0 + 50), revision=2, owner="run-b"))
    # released by its holder's last append
    await backend.append(KEY, req(event("b2", T0 + 51), revision=3, owner="run-b", release=True))
    free = await backend.read(KEY, recent=0, after=None, now=T0 + 51)
    assert free is not None
    assert free.session.holder is None
    await backend.append(KEY, req(event("c1", T0 + 52), revision=4, owner="run-c"))
    assert await backend.recover(KEY)
    assert not await backend.recover(KEY)
    await backend.append(KEY, req(event("d1", T0 + 53), revision=5))
    assert not await backend.recover(SessionKey("app", "alice", "unknown"))


async def test_hold_takes_the_session_for_an_owner_and_release_gives_it_back(
    open_backend: BackendOpener,
) -> None:
    backend = open_backend(limits=AdkLimits(hold_seconds=30))
    with pytest.raises(SessionNotFoundError):
        await backend.hold(KEY, "run-a", now=T0)
    await create(backend)
    await backend.hold(KEY, "run-a", now=T0 + 1)
    before = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
    assert before is not None
    assert before.session.holder == "run-a"
    assert (before.session.revision, before.session.update_time) == (0, T0)  # nothing else moved
    await backend.hold(KEY, "run-a", now=T0 + 2)  # refreshed by its owner: until T0 + 32
    with pytest.raises(DecisionHistoryBusy):
        await backend.hold(KEY, "run-b", now=T0 + 31)
    with pytest.raises(DecisionHistoryBusy):
        await backend.append(KEY, req(event("b1", T0 + 31), revision=0))
    await backend.append(KEY, req(event("a1", T0 + 31), revision=0, owner="run-a"))
    assert not await backend.release(KEY, "run-b")
    assert await backend.release(KEY, "run-a")
    assert not await backend.release(KEY, "run-a")
    await backend.append(KEY, req(event("b1", T0 + 32), revision=1))
    await backend.hold(KEY, "run-b", now=T0 + 33)
    assert not await backend.release(SessionKey("app", "alice", "nope"), "run-b")
    expired = open_backend("ttl", AdkLimits(ttl_seconds=5))
    await create(expired, now=T0)
    with pytest.raises(SessionNotFoundError):
        await expired.hold(KEY, "run-a", now=T0 + 5)


# --- namespaces, persistence, lifecycle --------------------------------------------------


async def test_namespaces_never_see_each_other(open_backend: BackendOpener) -> None:
    one = open_backend("one")
    two = open_backend("two")
    await one.create(
        KEY, state={"k": 1}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
    )
    await one.append(KEY, req(event("e1", T0 + 1), revision=0))
    assert await two.read(KEY, recent=None, after=None, now=T0) is None
    assert list((await two.list_sessions("app", None, now=T0)).sessions) == []
    assert dict((await two.list_sessions("app", None, now=T0)).app_state) == {}
    assert dict(await two.read_user_state("app", "alice")) == {}
    with pytest.raises(SessionNotFoundError):
        await two.append(KEY, req(event("e2", T0 + 2)))
    await create(two)  # no AlreadyExistsError: another namespace
    await two.delete(KEY)
    assert await two.purge_expired(now=T0 + 10**9) == 0
    got = await one.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    assert len(got.events) == 1


async def test_a_reopened_store_has_everything(open_backend: BackendOpener) -> None:
    if not open_backend.persistent:
        pytest.skip(f"{open_backend.kind} keeps nothing once closed")
    first = open_backend()
    await first.create(
        KEY, state={"k": 1}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
    )
    await fill(first, 3)
    await first.close()
    second = open_backend()
    got = await second.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    assert [e.event_id for e in got.events] == ["e000", "e001", "e002"]
    assert (dict(got.session.state), dict(got.app_state), dict(got.user_state)) == (
        {"k": 1},
        {"a": 1},
        {"u": 1},
    )
    assert got.session.revision == 3


async def test_a_closed_backend_refuses_calls(open_backend: BackendOpener) -> None:
    backend = open_backend()
    await create(backend)
    await backend.close()
    await backend.close()  # idempotent
    with pytest.raises(ConfigurationError):
        await backend.read(KEY, recent=None, after=None, now=T0)
