"""ToubaSessionService beyond ADK's contract suite: bad input, bounds, TTL, one writer, files."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from google.adk.errors import StaleSessionError
from google.adk.errors.session_not_found_error import SessionNotFoundError
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.adk.sessions import Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.genai import types

from tests.integrations.adk.conftest import BackendOpener
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStorageUnsafe,
    DecisionHistoryStoreUnavailable,
)
from touba.integrations.adk import ToubaSessionService
from touba.integrations.adk._backend import AdkLimits

ROOT = Path(__file__).resolve().parents[3]
APP = "app"


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_765_000_000.0

    def __call__(self) -> float:
        return self.now


def text_event(text: str = "hi", *, delta: dict[str, Any] | None = None, **fields: Any) -> Event:
    fields.setdefault("invocation_id", "inv")
    fields.setdefault("author", "agent")
    if delta is not None:
        fields["actions"] = EventActions(state_delta=delta)
    return Event(content=types.Content(role="model", parts=[types.Part(text=text)]), **fields)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(open_backend: BackendOpener, clock: Clock) -> ToubaSessionService:
    return ToubaSessionService(open_backend(), clock=clock)


async def reload(service: ToubaSessionService, session: Session, **kw: Any) -> Session:
    got = await service.get_session(
        app_name=session.app_name, user_id=session.user_id, session_id=session.id, **kw
    )
    assert got is not None
    return got


# --- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ((1, 2), "state['app:t']"),
        ({1, 2}, "state['app:t']"),
        (datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), "state['app:t']"),
        (float("nan"), "state['app:t']"),
        ({"ok": [1, object()]}, "state['app:t']['ok'][1]"),
        ({3: "int key"}, "state['app:t']"),
    ],
)
async def test_create_refuses_state_that_would_not_round_trip(
    service: ToubaSessionService, value: Any, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(named)):
        await service.create_session(
            app_name=APP, user_id="u", session_id="s", state={"app:t": value}
        )
    assert await service.get_session(app_name=APP, user_id="u", session_id="s") is None
    other = await service.create_session(app_name=APP, user_id="u")
    assert other.state == {}


async def test_append_refuses_a_delta_that_would_not_round_trip_and_touches_nothing(
    service: ToubaSessionService,
) -> None:
    session = await service.create_session(app_name=APP, user_id="u", state={"k": 1})
    before = session.model_copy(deep=True)
    event = text_event(delta={"temp:t": 1, "ok": 2, "bad": (1, 2)})
    with pytest.raises(ConfigurationError, match=r"event\.actions\.state_delta\['bad'\]"):
        await service.append_event(session, event)
    assert session == before
    assert event.actions.state_delta == {"temp:t": 1, "ok": 2, "bad": (1, 2)}
    stored = await reload(service, session)
    assert stored.events == []
    assert stored.state == {"k": 1}


async def test_append_refuses_an_event_field_that_would_not_round_trip(
    service: ToubaSessionService,
) -> None:
    session = await service.create_session(app_name=APP, user_id="u")
    with pytest.raises(ConfigurationError, match=r"event\.custom_metadata"):
        await service.append_event(session, text_event(custom_metadata={"t": (1, 2)}))
    with pytest.raises(ConfigurationError, match=r"event\.custom_metadata"):
        await service.append_event(session, text_event(custom_metadata={"o": object()}))
    assert (await reload(service, session)).events == []
    assert session.events == []


async def test_ids_and_arguments_of_the_wrong_type_are_refused(
    service: ToubaSessionService,
) -> None:
    with pytest.raises(ConfigurationError, match="user_id"):
        await service.create_session(app_name=APP, user_id=7)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="session_id"):
        await service.get_session(app_name=APP, user_id="u", session_id=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="state"):
        await service.create_session(app_name=APP, user_id="u", state=[("a", 1)])  # type: ignore[arg-type]
    session = await service.create_session(app_name=APP, user_id="u")
    with pytest.raises(ConfigurationError, match="event"):
        await service.append_event(session, {"author": "x"})  # type: ignore[arg-type]
    assert await service.list_sessions(app_name=APP) is not None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"max_sesions": 3}, "max_sesions"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"ttl_seconds": -1}, "ttl_seconds"),
        ({"max_event_bytes": 1.5}, "max_event_bytes"),
        ({"hold_seconds": None}, "hold_seconds"),
        ({"ttl_seconds": "1d"}, "ttl_seconds"),
    ],
)
def test_invalid_bounds_are_refused_at_construction(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        ToubaSessionService.memory(**options)


# --- scopes, config, markers -------------------------------------------------------------


async def test_temp_keys_are_applied_in_memory_and_never_stored(
    service: ToubaSessionService,
) -> None:
    session = await service.create_session(
        app_name=APP, user_id="u", state={"temp:c": 1, "app:a": 1, "s": 1}
    )
    assert session.state == {"app:a": 1, "s": 1}
    event = text_event(delta={"temp:t": "x", "user:u": 2})
    await service.append_event(session, event)
    assert event.actions.state_delta == {"user:u": 2}
    assert session.state == {"app:a": 1, "s": 1, "temp:t": "x", "user:u": 2}
    stored = await reload(service, session)
    assert stored.state == {"app:a": 1, "s": 1, "user:u": 2}
    assert stored.events[0].actions.state_delta == {"user:u": 2}


async def test_a_session_without_marker_falls_back_to_its_update_time(
    service: ToubaSessionService, clock: Clock
) -> None:
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    by_hand = Session(id="s", app_name=APP, user_id="u", last_update_time=session.last_update_time)
    await service.append_event(by_hand, text_event(timestamp=clock.now + 1))
    late = Session(id="s", app_name=APP, user_id="u", last_update_time=clock.now)
    with pytest.raises(StaleSessionError):
        await service.append_event(late, text_event(timestamp=clock.now + 2))
    assert len((await reload(service, session)).events) == 1


async def test_a_repeated_event_is_stored_once(service: ToubaSessionService) -> None:
    session = await service.create_session(app_name=APP, user_id="u")
    event = text_event()
    await service.append_event(session, event)
    copy = session.model_copy(deep=True)
    await service.append_event(copy, event)
    assert len(copy.events) == 1
    assert len((await reload(service, session)).events) == 1


async def test_get_session_returns_exactly_the_events_asked(service: ToubaSessionService) -> None:
    session = await service.create_session(app_name=APP, user_id="u")
    base = session.last_update_time
    for i in range(30):
        await service.append_event(session, text_event(f"m{i}", timestamp=base + 1 + i))
    last = await reload(service, session, config=GetSessionConfig(num_recent_events=4))
    assert [e.content.parts[0].text for e in last.events if e.content and e.content.parts] == [
        "m26",
        "m27",
        "m28",
        "m29",
    ]
    assert last.state == session.state
    recent = await reload(
        service, session, config=GetSessionConfig(num_recent_events=2, after_timestamp=base + 5)
    )
    assert [e.timestamp for e in recent.events] == [base + 29, base + 30]
    # a copy read with a window is current: it can append
    await service.append_event(last, text_event("after", timestamp=base + 40))
    assert len((await reload(service, session)).events) == 31


async def test_events_read_are_detached_copies(service: ToubaSessionService) -> None:
    session = await service.create_session(app_name=APP, user_id="u")
    await service.append_event(session, text_event("original", custom_metadata={"k": [1]}))
    for _ in range(2):
        got = await reload(service, session)
        assert got.events[0].content is not None
        assert got.events[0].content.parts is not None
        assert got.events[0].content.parts[0].text == "original"
        assert got.events[0].custom_metadata == {"k": [1]}
        got.events[0].content.parts[0].text = "changed"
        assert got.events[0].custom_metadata is not None
        got.events[0].custom_metadata["k"].append(2)
    session.events[0].custom_metadata["k"].append(3)  # type: ignore[index]
    assert (await reload(service, session)).events[0].custom_metadata == {"k": [1]}


async def test_a_damaged_stored_event_is_record_invalid(private_dir: Path) -> None:
    path = private_dir / "adk.sqlite"
    async with ToubaSessionService.sqlite(path) as service:
        session = await service.create_session(app_name=APP, user_id="u")
        await service.append_event(session, text_event())

        def damage() -> None:
            with contextlib.closing(sqlite3.connect(path)) as conn, conn:
                conn.execute("UPDATE adk_events SET data = '{\"author\": 5}'")

        await asyncio.to_thread(damage)
        with pytest.raises(DecisionHistoryRecordInvalid):
            await reload(service, session)
        assert (
            await reload(service, session, config=GetSessionConfig(num_recent_events=0))
        ).events == []


# --- bounds and expiry ------------------------------------------------------------------------


async def test_an_event_over_its_bound_is_refused_and_nothing_changes(
    open_backend: BackendOpener,
) -> None:
    service = ToubaSessionService(open_backend(limits=AdkLimits(max_event_bytes=2_000)))
    session = await service.create_session(app_name=APP, user_id="u")
    await service.append_event(session, text_event("small", delta={"k": 1}))
    before = session.model_copy(deep=True)
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await service.append_event(session, text_event("x" * 3_000, delta={"k": 2}))
    assert caught.value.limit == "max_bytes"
    assert session == before
    stored = await reload(service, session)
    assert len(stored.events) == 1
    assert stored.state == {"k": 1}


async def test_max_sessions_refuses_a_new_session(open_backend: BackendOpener) -> None:
    service = ToubaSessionService(open_backend(limits=AdkLimits(max_sessions=2)))
    await service.create_session(app_name=APP, user_id="a")
    await service.create_session(app_name=APP, user_id="b")
    with pytest.raises(DecisionHistoryLimitExceeded) as caught:
        await service.create_session(app_name=APP, user_id="c", state={"user:x": 1})
    assert caught.value.limit == "max_sessions"
    assert await service.get_user_state(app_name=APP, user_id="c") == {}


async def test_a_session_expires_ttl_seconds_after_its_last_write(
    open_backend: BackendOpener, clock: Clock
) -> None:
    service = ToubaSessionService(open_backend(limits=AdkLimits(ttl_seconds=100)), clock=clock)
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    clock.now += 60
    await service.append_event(session, text_event(timestamp=clock.now))
    clock.now += 99
    assert await service.get_session(app_name=APP, user_id="u", session_id="s") is not None
    clock.now += 1
    assert await service.get_session(app_name=APP, user_id="u", session_id="s") is None
    assert (await service.list_sessions(app_name=APP)).sessions == []
    with pytest.raises(SessionNotFoundError):
        await service.append_event(session, text_event(timestamp=clock.now))
    again = await service.create_session(app_name=APP, user_id="u", session_id="s")
    assert (await reload(service, again)).events == []
    clock.now += 100
    assert await service.purge_expired() == 1


# --- one writer ---------------------------------------------------------------------------


async def elsewhere(awaitable: Any) -> Any:
    """Await ``awaitable`` in a task of its own context: another run, outside any exclusive()."""
    return await asyncio.get_running_loop().create_task(awaitable, context=contextvars.Context())


async def test_exclusive_refuses_every_other_writer_until_it_ends(
    open_backend: BackendOpener,
) -> None:
    mine = ToubaSessionService(open_backend())
    other = ToubaSessionService(open_backend()) if open_backend.persistent else mine
    session = await mine.create_session(app_name=APP, user_id="u", session_id="s")
    theirs = await other.get_session(app_name=APP, user_id="u", session_id="s")
    assert theirs is not None
    async with mine.exclusive(app_name=APP, user_id="u", session_id="s"):
        await mine.append_event(session, text_event("mine 1"))
        with pytest.raises(DecisionHistoryBusy):
            await elsewhere(other.append_event(theirs, text_event("theirs")))
        with pytest.raises(DecisionHistoryBusy):
            await elsewhere(mine.append_event(session.model_copy(deep=True), text_event("x")))

        async def enter() -> None:
            async with other.exclusive(app_name=APP, user_id="u", session_id="s"):
                pass

        with pytest.raises(DecisionHistoryBusy):
            await elsewhere(enter())
        await mine.append_event(session, text_event("mine 2"))
    assert theirs.events == []
    fresh = await reload(other, session)
    await other.append_event(fresh, text_event("theirs, after"))
    stored = await reload(mine, session)
    texts = [e.content.parts[0].text for e in stored.events if e.content and e.content.parts]
    assert texts == ["mine 1", "mine 2", "theirs, after"]


async def test_exclusive_is_released_when_its_block_raises_and_is_not_reentrant(
    service: ToubaSessionService,
) -> None:
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")

    async def failing_run() -> None:
        async with service.exclusive(app_name=APP, user_id="u", session_id="s"):
            with pytest.raises(ConfigurationError, match="already holds"):
                async with service.exclusive(app_name=APP, user_id="u", session_id="s"):
                    pass
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        await failing_run()
    await elsewhere(service.append_event(session, text_event("free again")))
    assert not await service.recover(app_name=APP, user_id="u", session_id="s")


async def test_exclusive_of_an_unknown_session_is_refused(service: ToubaSessionService) -> None:
    with pytest.raises(SessionNotFoundError):
        async with service.exclusive(app_name=APP, user_id="u", session_id="nope"):
            pass


async def test_a_hold_left_by_a_crash_is_dropped_by_recover(open_backend: BackendOpener) -> None:
    service = ToubaSessionService(open_backend())
    session = await service.create_session(app_name=APP, user_id="u", session_id="s")
    crashed = service.exclusive(app_name=APP, user_id="u", session_id="s")
    await elsewhere(crashed.__aenter__())  # entered by a run that then "dies": never exits
    with pytest.raises(DecisionHistoryBusy):
        await service.append_event(session, text_event())
    assert await service.recover(app_name=APP, user_id="u", session_id="s")
    assert not await service.recover(app_name=APP, user_id="u", session_id="s")
    await service.append_event(session, text_event())


async def test_concurrent_writers_from_one_snapshot_one_wins_many_times(
    open_backend: BackendOpener,
) -> None:
    services = [
        ToubaSessionService(open_backend()) for _ in range(3 if open_backend.persistent else 1)
    ]
    session = await services[0].create_session(app_name=APP, user_id="u")
    for round_no in range(5):
        latest = await reload(services[0], session)
        copies = [latest.model_copy(deep=True) for _ in range(6)]
        results = await asyncio.gather(
            *(
                services[k % len(services)].append_event(
                    c, text_event(f"r{round_no}w{k}", delta={"w": k})
                )
                for k, c in enumerate(copies)
            ),
            return_exceptions=True,
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert all(
            isinstance(r, StaleSessionError) for r in results if isinstance(r, BaseException)
        )
    stored = await reload(services[0], session)
    assert len(stored.events) == 5


# --- files, tenants, lifecycle -----------------------------------------------------------------


async def test_the_sqlite_file_is_private(private_dir: Path) -> None:
    path = private_dir / "adk.sqlite"
    async with ToubaSessionService.sqlite(path) as service:
        await service.create_session(app_name=APP, user_id="u")
        modes = await asyncio.to_thread(
            lambda: {p.name: stat.S_IMODE(p.stat().st_mode) for p in private_dir.iterdir()}
        )
    assert "adk.sqlite" in modes
    assert set(modes.values()) == {0o600}, modes


async def test_an_unsafe_sqlite_location_is_refused(tmp_path: Path, private_dir: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    async with ToubaSessionService.sqlite(shared / "adk.sqlite") as service:
        with pytest.raises(DecisionHistoryStorageUnsafe):
            await service.create_session(app_name=APP, user_id="u")
    target = private_dir / "real.sqlite"
    target.touch(mode=0o600)
    (private_dir / "link.sqlite").symlink_to(target)
    async with ToubaSessionService.sqlite(private_dir / "link.sqlite") as service:
        with pytest.raises(DecisionHistoryStorageUnsafe):
            await service.create_session(app_name=APP, user_id="u")


async def test_a_file_that_is_not_a_database_is_refused_untouched(private_dir: Path) -> None:
    path = private_dir / "adk.sqlite"
    garbage = b"not a database, " * 512
    await asyncio.to_thread(path.write_bytes, garbage)
    await asyncio.to_thread(path.chmod, 0o600)
    async with ToubaSessionService.sqlite(path) as service:
        with pytest.raises(DecisionHistoryStoreUnavailable):
            await service.create_session(app_name=APP, user_id="u")
    assert await asyncio.to_thread(path.read_bytes) == garbage


async def test_a_file_of_another_schema_version_is_refused_untouched(private_dir: Path) -> None:
    path = private_dir / "adk.sqlite"
    async with ToubaSessionService.sqlite(path) as service:
        await service.create_session(app_name=APP, user_id="u", session_id="s")

    def bump() -> None:
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("UPDATE touba_meta SET value = '99' WHERE name = 'adk_sessions'")

    await asyncio.to_thread(bump)
    async with ToubaSessionService.sqlite(path) as service:
        with pytest.raises(ConfigurationError, match="version '99'"):
            await service.get_session(app_name=APP, user_id="u", session_id="s")


async def test_two_stores_never_see_each_other(open_backend: BackendOpener) -> None:
    tenant_a = ToubaSessionService(open_backend("tenant-a"))
    tenant_b = ToubaSessionService(open_backend("tenant-b"))
    await tenant_a.create_session(app_name=APP, user_id="u", session_id="s", state={"app:k": "a"})
    assert await tenant_b.get_session(app_name=APP, user_id="u", session_id="s") is None
    assert (await tenant_b.list_sessions(app_name=APP)).sessions == []
    created = await tenant_b.create_session(app_name=APP, user_id="u", session_id="s")
    assert created.state == {}


async def test_a_closed_service_refuses_calls(service: ToubaSessionService) -> None:
    await service.create_session(app_name=APP, user_id="u")
    await service.close()
    await service.close()
    with pytest.raises(ConfigurationError):
        await service.list_sessions(app_name=APP)


# --- kill -9 during append_event ---------------------------------------------------------------


def kill_a_writer(backend: str, directory: Path, name: str) -> None:
    """Start ``_writer`` on the test's store and kill -9 it while it appends."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = [
        sys.executable,
        "-m",
        "tests.integrations.adk._writer",
        backend,
        str(directory),
        name,
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env) as writer:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        time.sleep(random.uniform(0.05, 0.3))  # it appends meanwhile
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -9


async def test_kill_during_append_leaves_a_readable_session_and_whole_events(
    open_backend: BackendOpener, backend: str, private_dir: Path, store_name: str
) -> None:
    if not open_backend.persistent:
        pytest.skip("nothing survives a RAM store's process")
    service = ToubaSessionService(open_backend())
    await service.create_session(app_name=APP, user_id="u", session_id="s")
    await asyncio.to_thread(kill_a_writer, backend, private_dir, store_name)
    stored = await service.get_session(app_name=APP, user_id="u", session_id="s")
    assert stored is not None
    n = len(stored.events)
    assert n >= 1
    texts = [e.content.parts[0].text for e in stored.events if e.content and e.content.parts]
    assert texts == [f"event {i} " + "x" * 2000 for i in range(1, n + 1)]
    assert stored.state == {"n": n, "user:n": n}
    # the writer died holding the session: refused until recovered
    with pytest.raises(DecisionHistoryBusy):
        await service.append_event(stored, text_event())
    assert await service.recover(app_name=APP, user_id="u", session_id="s")
    await service.append_event(stored, text_event("after recover"))
    assert len((await reload(service, stored)).events) == n + 1
