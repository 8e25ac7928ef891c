"""What only the Redis backend of ToubaSessionService has (the shared rules are test_backend.py).

Each script stays atomic under many clients at once; Redis's own expiry removes a
session's keys; prefixes (and ids with any character) never mix, all in one cluster
slot; a connection cut mid-step leaves the step whole or absent, and the client
made from the url sends it again safely; each step is one round trip, a list of
5,000 sessions included. Every test works under its own prefix and deletes its keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from tests._services import redis_url
from tests._tcp_cut import tcp_cut
from tests.integrations._stores import delete_keys
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.integrations.adk import _redis
from touba.integrations.adk._backend import AdkLimits, AppendRequest, SessionKey, StoredEvent
from touba.integrations.adk._redis import RedisAdkBackend

pytestmark = pytest.mark.redis

SRC = str(Path(__file__).resolve().parents[3] / "src")
T0 = 1_765_000_000.25
KEY = SessionKey("app", "alice", "s1")


def event(event_id: str, timestamp: float, text: str = "") -> StoredEvent:
    return StoredEvent(event_id, timestamp, json.dumps({"id": event_id, "text": text}))


def req(ev: StoredEvent, *, revision: int | None = None, **kw: Any) -> AppendRequest:
    kw.setdefault("now", ev.timestamp)
    return AppendRequest(event=ev, update_time=ev.timestamp, expected_revision=revision, **kw)


async def create(backend: RedisAdkBackend, key: SessionKey = KEY, now: float = T0) -> None:
    await backend.create(key, state={}, app_delta={}, user_delta={}, create_time=now, now=now)


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
async def raw(url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"touba-adk-redis-test:{uuid.uuid4().hex}:"
    yield prefix
    delete_keys(prefix)


@pytest.fixture
async def opener(url: str, prefix: str) -> AsyncIterator[Callable[..., RedisAdkBackend]]:
    """Backends on the test's prefix (each with its own client), closed after the test."""
    opened: list[RedisAdkBackend] = []

    def open_backend(limits: AdkLimits | None = None, **kw: Any) -> RedisAdkBackend:
        kw.setdefault("prefix", prefix)
        backend = RedisAdkBackend(None if "client" in kw else url, limits, **kw)
        opened.append(backend)
        return backend

    yield open_backend
    for backend in opened:
        await backend.close()


async def keys_of(raw: Redis, prefix: str) -> list[str]:
    return sorted([k.decode() async for k in raw.scan_iter(match=prefix + "*", count=1000)])


# -- atomicity under concurrent clients ------------------------------------------------


async def test_of_many_clients_appending_from_one_revision_exactly_one_wins(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    clients = [opener() for _ in range(8)]
    await create(clients[0])
    for round_ in range(4):
        outcomes = await asyncio.gather(
            *(
                c.append(KEY, req(event(f"r{round_}c{i}", T0 + 1 + round_), revision=round_))
                for i, c in enumerate(clients)
            ),
            return_exceptions=True,
        )
        wins = [o for o in outcomes if not isinstance(o, BaseException)]
        assert len(wins) == 1, outcomes
        assert all(isinstance(o, StaleSessionError) for o in outcomes if o not in wins)
    got = await clients[1].read(KEY, recent=None, after=None, now=T0 + 10)
    assert got is not None
    assert got.session.revision == got.session.event_count == len(got.events) == 4


async def test_of_many_clients_creating_one_key_exactly_one_wins(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    clients = [opener() for _ in range(8)]
    outcomes = await asyncio.gather(
        *(
            c.create(KEY, state={"by": i}, app_delta={}, user_delta={}, create_time=T0, now=T0)
            for i, c in enumerate(clients)
        ),
        return_exceptions=True,
    )
    wins = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(wins) == 1, outcomes
    assert sum(isinstance(o, AlreadyExistsError) for o in outcomes) == 7
    got = await clients[0].read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    assert dict(got.session.state) == dict(wins[0].session.state)


async def test_max_sessions_holds_under_concurrent_creates(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    clients = [opener(AdkLimits(max_sessions=3)) for _ in range(8)]
    outcomes = await asyncio.gather(
        *(create(c, SessionKey("app", f"u{i}", "s")) for i, c in enumerate(clients)),
        return_exceptions=True,
    )
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(refused) == 5, outcomes
    assert all(isinstance(o, DecisionHistoryLimitExceeded) for o in refused)
    assert len((await clients[0].list_sessions("app", None, now=T0)).sessions) == 3


async def test_of_many_owners_one_holds_the_session(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    clients = [opener() for _ in range(6)]
    await create(clients[0])
    outcomes = await asyncio.gather(
        *(
            c.append(KEY, req(event(f"e{i}", T0 + 1), owner=f"run-{i}"))
            for i, c in enumerate(clients)
        ),
        return_exceptions=True,
    )
    wins = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    assert len(wins) == 1, outcomes
    assert all(isinstance(o, DecisionHistoryBusy) for i, o in enumerate(outcomes) if i != wins[0])
    got = await clients[0].read(KEY, recent=None, after=None, now=T0 + 1)
    assert got is not None
    assert got.session.holder == f"run-{wins[0]}"
    assert [e.event_id for e in got.events] == [f"e{wins[0]}"]


async def test_of_many_clients_holding_one_session_one_wins_and_release_frees_it(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    clients = [opener(AdkLimits(hold_seconds=60)) for _ in range(6)]
    await create(clients[0])
    outcomes = await asyncio.gather(
        *(c.hold(KEY, f"run-{i}", now=T0) for i, c in enumerate(clients)),
        return_exceptions=True,
    )
    wins = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    assert len(wins) == 1, outcomes
    assert sum(isinstance(o, DecisionHistoryBusy) for o in outcomes) == 5
    released = await asyncio.gather(*(c.release(KEY, f"run-{i}") for i, c in enumerate(clients)))
    assert released == [i == wins[0] for i in range(6)]
    got = await clients[0].read(KEY, recent=0, after=None, now=T0)
    assert got is not None
    assert got.session.holder is None


async def test_reads_and_lists_racing_appends_see_whole_appends(
    opener: Callable[..., RedisAdkBackend],
) -> None:
    """Each append writes an event, its session delta, the app and user deltas and the
    counters together; a read or a list in between sees all of one append or none."""
    writer, reader = opener(), opener()
    await create(writer)
    seen: list[tuple[int, int, Any, Any, Any]] = []
    done = asyncio.Event()

    async def write() -> None:
        for i in range(1, 61):
            delta = {"n": i}
            await writer.append(
                KEY,
                req(
                    event(f"e{i:03d}", T0 + i),
                    revision=i - 1,
                    session_delta=delta,
                    app_delta=delta,
                    user_delta=delta,
                ),
            )
        done.set()

    async def read() -> None:
        while not done.is_set():
            got = await reader.read(KEY, recent=None, after=None, now=T0)
            assert got is not None
            seen.append(
                (
                    got.session.revision,
                    len(got.events),
                    got.session.state.get("n"),
                    got.app_state.get("n"),
                    got.user_state.get("n"),
                )
            )
            listed = await reader.list_sessions("app", "alice", now=T0)
            (session,) = listed.sessions
            assert session.state.get("n") == listed.app_state.get("n") or session.revision == 0
            assert session.state.get("n", 0) == session.revision == session.event_count

    await asyncio.gather(write(), read())
    assert seen
    for revision, events, *values in seen:
        assert events == revision
        assert values == ([None] * 3 if revision == 0 else [revision] * 3)


async def test_a_delete_racing_appends_leaves_no_event_behind(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    writer, deleter = opener(), opener()
    await create(writer)

    async def write() -> int:
        for i in range(200):
            try:
                await writer.append(KEY, req(event(f"e{i}", T0 + i)))
            except SessionNotFoundError:
                return i
        return 200

    async def delete() -> None:
        await asyncio.sleep(0.005)
        await deleter.delete(KEY)

    written, _ = await asyncio.gather(write(), delete())
    assert written < 200
    assert await writer.read(KEY, recent=None, after=None, now=T0) is None
    assert [k for k in await keys_of(raw, prefix) if ":s:" in k] == []
    assert (await writer.list_sessions("app", None, now=T0)).sessions == []


# -- TTL: Redis's own expiry -------------------------------------------------------------


async def test_redis_expires_a_sessions_keys_ttl_after_its_last_write(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    backend = opener(AdkLimits(ttl_seconds=600))
    await backend.create(
        KEY, state={"k": 1}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
    )
    await backend.append(KEY, req(event("e1", T0 + 1)))
    names = await keys_of(raw, prefix)
    session_keys = [k for k in names if ":s:" in k]
    assert len(session_keys) == 4  # row, state, events, data
    for name in session_keys:
        ms = await raw.pttl(name)
        assert 600_000 < ms <= 600_000 + _redis.GRACE_MS, name
    for name in set(names) - set(session_keys):  # app/user state and the indexes stay
        assert await raw.pttl(name) == -1, name


async def test_without_a_ttl_nothing_expires(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    backend = opener()
    await backend.create(KEY, state={"k": 1}, app_delta={}, user_delta={}, create_time=T0, now=T0)
    await backend.append(KEY, req(event("e1", T0 + 1), session_delta={"k": 2}))
    names = await keys_of(raw, prefix)
    assert names
    assert [await raw.pttl(name) for name in names] == [-1] * len(names)


async def test_an_abandoned_session_vanishes_from_redis_and_its_entries_are_purged(
    opener: Callable[..., RedisAdkBackend],
    raw: Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody reads or purges: Redis removes the session's keys by itself (after a
    ttl counted on its own clock, whatever the caller's clock says); the session is
    gone for every read, and a purge later takes its index entries."""
    monkeypatch.setattr(_redis, "GRACE_MS", 0)
    backend = opener(AdkLimits(ttl_seconds=0.2))
    now = time.time()
    await create(backend, KEY, now=now)
    await backend.append(KEY, req(event("e1", now), now=now, session_delta={"k": 1}))
    await asyncio.sleep(0.5)
    assert [k for k in await keys_of(raw, prefix) if ":s:" in k] == []
    # a caller whose clock says it is still alive finds it gone all the same
    assert await backend.read(KEY, recent=None, after=None, now=now) is None
    assert (await backend.list_sessions("app", None, now=now)).sessions == []
    with pytest.raises(SessionNotFoundError):
        await backend.append(KEY, req(event("e2", now), now=now))
    assert await backend.purge_expired(now=now + 1) == 1
    assert [k for k in await keys_of(raw, prefix) if k.endswith(("index", "all"))] == []


async def test_a_purge_of_many_expired_sessions_runs_in_bounded_scripts(
    opener: Callable[..., RedisAdkBackend],
    raw: Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_redis, "PURGE_BATCH", 7)
    backend = opener(AdkLimits(ttl_seconds=10))
    for i in [*range(23, 30), *range(23)]:  # (a create purges a few expired sessions too)
        await create(backend, SessionKey("app", "u", f"s{i}"), now=T0 + (i >= 23) * 100)
    assert await backend.purge_expired(now=T0 + 50) == 23
    listed = await backend.list_sessions("app", None, now=T0 + 100)
    assert [s.key.session_id for s in listed.sessions] == [f"s{i}" for i in range(23, 30)]
    assert len([k for k in await keys_of(raw, prefix) if ":s:" in k]) == 7
    assert await backend.purge_expired(now=T0 + 50) == 0


# -- prefixes, ids and cluster slots -----------------------------------------------------


async def test_nested_prefixes_never_see_each_other(
    opener: Callable[..., RedisAdkBackend], prefix: str
) -> None:
    outer = opener(prefix=prefix)
    inner = opener(prefix=prefix + "x:")
    await outer.create(
        KEY, state={"k": 1}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
    )
    await outer.append(KEY, req(event("e1", T0 + 1)))
    assert await inner.read(KEY, recent=None, after=None, now=T0) is None
    assert dict((await inner.list_sessions("app", None, now=T0)).app_state) == {}
    assert dict(await inner.read_user_state("app", "alice")) == {}
    await create(inner)
    await inner.delete(KEY)
    assert await inner.purge_expired(now=T0 + 10**9) == 0
    got = await outer.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    assert len(got.events) == 1


async def test_ids_with_any_character_are_kept_apart_and_every_key_is_in_one_slot(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    backend = opener()
    keys = [
        SessionKey("a:b", "c", "d"),
        SessionKey("a", "b:c", "d"),
        SessionKey("a", "b", "c:d"),
        SessionKey("{x}", "*?[", 'nul\x00, quote", 中文 🙂'),
    ]
    for i, key in enumerate(keys):
        await backend.create(
            key, state={"i": i}, app_delta={"k": i}, user_delta={"k": i}, create_time=T0, now=T0
        )
        await backend.append(key, req(event(f"e{i}", T0 + 1)))
    for i, key in enumerate(keys):
        got = await backend.read(key, recent=None, after=None, now=T0)
        assert got is not None
        assert got.session.key == key
        assert dict(got.session.state) == {"i": i}
        assert [e.event_id for e in got.events] == [f"e{i}"]
    listed = await backend.list_sessions("a", None, now=T0)
    assert {s.key for s in listed.sessions} == set(keys[1:3])
    names = await keys_of(raw, prefix)
    assert len({key_slot(name.encode()) for name in names}) == 1
    layout = re.compile(re.escape(prefix) + r"\{[0-9a-f]{10}\}:[a-z0-9:]+")
    assert all(layout.fullmatch(name) for name in names), names


def test_a_prefix_with_braces_or_a_bad_location_is_refused(url: str) -> None:
    for prefix in ("", "a{b", "a}b"):
        with pytest.raises(ConfigurationError, match="prefix"):
            RedisAdkBackend(url, prefix=prefix)
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisAdkBackend()
    with pytest.raises(ConfigurationError, match="url"):
        RedisAdkBackend("http://127.0.0.1:6379")
    with pytest.raises(ConfigurationError, match="limits"):
        RedisAdkBackend(url, {"ttl_seconds": 1})  # type: ignore[arg-type]


# -- a cut connection --------------------------------------------------------------------


@pytest.mark.parametrize("retries", ["the backend's own client", "a client without retries"])
async def test_a_command_cut_before_redis_gets_it(url: str, prefix: str, retries: str) -> None:
    """The backend's client sends the lost append again on a new connection: stored
    once. A client without retries fails it with DecisionHistoryStoreUnavailable
    (retryable, redis-py's error chained), nothing written, and the next append works."""
    own = retries == "the backend's own client"
    parts = urlsplit(url)
    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        relayed = parts._replace(netloc=f"127.0.0.1:{relay.port}").geturl()
        client = None if own else Redis.from_url(relayed, retry=Retry(NoBackoff(), 0))
        async with contextlib.AsyncExitStack() as stack:
            if client is not None:
                stack.push_async_callback(client.aclose)
            backend = RedisAdkBackend(relayed if own else None, prefix=prefix, client=client)
            stack.push_async_callback(backend.close)
            await create(backend)
            relay.arm()
            if own:
                result = await backend.append(KEY, req(event("e1", T0 + 1), revision=0))
                assert result.appended
            else:
                with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                    await backend.append(KEY, req(event("e1", T0 + 1), revision=0))
                assert caught.value.retryable
                assert isinstance(caught.value.__cause__, RedisConnectionError)
                got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
                assert got is not None
                assert (got.events, got.session.revision) == ([], 0)
                await backend.append(KEY, req(event("e1", T0 + 1), revision=0))
            assert relay.cuts == 1
            await backend.append(KEY, req(event("e2", T0 + 2), revision=1))
            got = await backend.read(KEY, recent=None, after=None, now=T0 + 2)
            assert got is not None
            assert [e.event_id for e in got.events] == ["e1", "e2"]
            assert got.session.revision == 2


async def test_a_reply_cut_after_redis_ran_the_step_is_retried_safely(
    url: str, prefix: str
) -> None:
    """The script ran and its reply was lost: the backend's client sends it again, and
    the second run finds the step done (an append its event id, a create its token),
    so the caller sees it succeed once, never a false AlreadyExistsError or
    StaleSessionError, and nothing is written twice."""
    parts = urlsplit(url)
    async with tcp_cut(parts.hostname or "127.0.0.1", parts.port or 6379) as relay:
        relayed = parts._replace(netloc=f"127.0.0.1:{relay.port}").geturl()
        async with contextlib.AsyncExitStack() as stack:
            backend = RedisAdkBackend(relayed, prefix=prefix)
            stack.push_async_callback(backend.close)
            relay.arm("reply")
            made = await backend.create(
                KEY, state={"k": 1}, app_delta={}, user_delta={}, create_time=T0, now=T0
            )
            assert relay.cuts == 1
            assert made.session.revision == 0
            relay.arm("reply")
            result = await backend.append(
                KEY, req(event("e1", T0 + 1), revision=0, session_delta={"k": 2})
            )
            assert relay.cuts == 2
            assert not result.appended  # the second run found it stored
            assert (result.revision, result.event_count) == (1, 1)
            got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
            assert got is not None
            assert [e.event_id for e in got.events] == ["e1"]
            assert (got.session.revision, dict(got.session.state)) == (1, {"k": 2})


async def test_an_unreachable_server_is_a_retryable_store_error() -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
    backend = RedisAdkBackend(client=client)
    try:
        with pytest.raises(DecisionHistoryStoreUnavailable, match="Redis failed") as caught:
            await backend.read(KEY, recent=None, after=None, now=T0)
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, RedisConnectionError)
    finally:
        await backend.close()
        await client.aclose()  # a given client is the caller's to close


# -- round trips and what is read ----------------------------------------------------------


class _Counting:
    """Counts the commands a client sends (each one round trip here: no pipelines)."""

    def __init__(self, client: Redis) -> None:
        self.commands: list[str] = []
        original = client.execute_command

        async def counted(*args: Any, **kw: Any) -> Any:
            self.commands.append(str(args[0]))
            return await original(*args, **kw)

        client.execute_command = counted  # type: ignore[method-assign]


async def test_every_step_is_one_round_trip_and_a_read_brings_only_what_is_asked(
    url: str, opener: Callable[..., RedisAdkBackend]
) -> None:
    client = Redis.from_url(url)
    counting = _Counting(client)
    backend = opener(client=client)
    try:
        await create(backend)
        for i in range(300):
            await backend.append(KEY, req(event(f"e{i:04d}", T0 + i, "x" * 100)))
        await backend.list_sessions("warm", None, now=T0)  # every script is loaded now
        counting.commands.clear()
        got = await backend.read(KEY, recent=3, after=None, now=T0)
        assert got is not None
        assert [e.event_id for e in got.events] == ["e0297", "e0298", "e0299"]
        assert got.session.event_count == 300
        await backend.append(KEY, req(event("e9999", T0 + 999)))
        await backend.list_sessions("app", None, now=T0)
        assert counting.commands == ["EVALSHA"] * 3
    finally:
        await client.aclose()


async def test_a_list_of_5000_sessions_is_one_round_trip_without_events(
    url: str, opener: Callable[..., RedisAdkBackend], raw: Redis
) -> None:
    client = Redis.from_url(url)
    backend = opener(client=client)
    try:
        for first in range(0, 5000, 50):  # 50 at a time, over as many connections
            await asyncio.gather(
                *(
                    backend.create(
                        SessionKey("app", f"u{i % 50}", f"s{i:04d}"),
                        state={"i": i},
                        app_delta={},
                        user_delta={"n": i % 50} if i < 50 else {},
                        create_time=T0 + (4999 - i),
                        now=T0,
                    )
                    for i in range(first, first + 50)
                )
            )
        await backend.append(SessionKey("app", "u0", "s0000"), req(event("e", T0 + 10**6)))
        await backend.list_sessions("warm", None, now=T0)  # the script is loaded now
        counting = _Counting(client)
        listed = await backend.list_sessions("app", None, now=T0)
        assert counting.commands == ["EVALSHA"]
        assert len(listed.sessions) == 5000
        order = [s.key.session_id for s in listed.sessions]
        assert order == [f"s{i:04d}" for i in range(4999, 0, -1)] + ["s0000"]
        assert listed.sessions[0].state == {"i": 4999}
        assert {u: dict(s) for u, s in listed.user_states.items()} == {
            f"u{n}": {"n": n} for n in range(50)
        }
        mine = await backend.list_sessions("app", "u7", now=T0)
        assert len(mine.sessions) == 100
        assert set(mine.user_states) == {"u7"}
    finally:
        await client.aclose()


# -- damaged data ----------------------------------------------------------------------------


async def test_a_tampered_state_value_is_a_typed_record_error(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    backend = opener()
    await backend.create(KEY, state={"k": 1}, app_delta={}, user_delta={}, create_time=T0, now=T0)
    (state,) = [k for k in await keys_of(raw, prefix) if k.endswith(":state") and ":s:" in k]
    await raw.hset(state, "k", "{not json")
    with pytest.raises(DecisionHistoryRecordInvalid, match="app/alice/s1"):
        await backend.read(KEY, recent=None, after=None, now=T0)
    with pytest.raises(DecisionHistoryRecordInvalid):
        await backend.list_sessions("app", None, now=T0)


async def test_a_value_redis_cannot_take_back_is_refused_before_anything_is_written(
    opener: Callable[..., RedisAdkBackend], raw: Redis, prefix: str
) -> None:
    backend = opener()
    with pytest.raises(ConfigurationError, match=r"state\['bad'\]"):
        await backend.create(
            KEY, state={"bad": float("nan")}, app_delta={}, user_delta={}, create_time=T0, now=T0
        )
    await create(backend)
    with pytest.raises(ConfigurationError, match=r"app state\['s'\]"):
        await backend.append(KEY, req(event("e1", T0 + 1), app_delta={"s": {1, 2}}))
    with pytest.raises(ConfigurationError, match="UTF-8"):
        await backend.append(KEY, req(event("e1", T0 + 1), session_delta={"s": "\ud800"}))
    with pytest.raises(ConfigurationError, match="UTF-8"):
        await backend.append(KEY, req(StoredEvent("e1", T0 + 1, '"\ud800"')))
    with pytest.raises(ConfigurationError, match=r"event\.timestamp"):
        await backend.append(KEY, req(StoredEvent("e1", math.nan, "{}"), now=T0))
    with pytest.raises(ConfigurationError, match="after"):
        await backend.read(KEY, recent=None, after=math.inf, now=T0)
    got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
    assert got is not None
    assert (list(got.events), dict(got.app_state), dict(got.session.state)) == ([], {}, {})
    assert got.session.revision == 0


# -- a writer killed mid-append ------------------------------------------------------------

_APPENDER = """
import asyncio, json, sys
from touba.integrations.adk._backend import AppendRequest, SessionKey, StoredEvent
from touba.integrations.adk._redis import RedisAdkBackend

async def main(url, prefix, t0):
    backend = RedisAdkBackend(url, prefix=prefix)
    key = SessionKey("app", "alice", "s1")
    i = 0
    while True:
        ev = StoredEvent(f"e{i:06d}", t0 + i, json.dumps({"i": i, "pad": "x" * 4000}))
        await backend.append(key, AppendRequest(
            event=ev, update_time=ev.timestamp, now=t0, expected_revision=i, owner="crashed",
            session_delta={"n": i + 1}, app_delta={"n": i + 1}, user_delta={"n": i + 1}))
        i += 1
        if i == 1:
            print("appending", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def test_kill_9_mid_append_leaves_every_append_whole_and_the_session_held(
    url: str, prefix: str, opener: Callable[..., RedisAdkBackend]
) -> None:
    """A process appending as fast as it can is killed -9: the session reads back with
    each append whole (event, its deltas, the counters) or absent, and stays held by
    the dead run until recover, after which a writer from the stored revision goes on."""
    backend = opener()
    await create(backend)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _APPENDER,
        url,
        prefix,
        repr(T0),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"appending"
        await asyncio.sleep(0.1)  # it appends meanwhile
    finally:
        with contextlib.suppress(ProcessLookupError):  # (it died on its own: a failure)
            child.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 30) == -9
    got = await backend.read(KEY, recent=None, after=None, now=T0)
    assert got is not None
    n = got.session.revision
    assert n >= 1
    assert [e.event_id for e in got.events] == [f"e{i:06d}" for i in range(n)]
    assert got.session.event_count == n
    assert got.session.byte_count == sum(len(e.data.encode()) for e in got.events)
    assert (got.session.state["n"], got.app_state["n"], got.user_state["n"]) == (n, n, n)
    assert got.session.holder == "crashed"
    with pytest.raises(DecisionHistoryBusy):
        await backend.append(KEY, req(event("next", T0 + n), revision=n, now=T0))
    assert await backend.recover(KEY)
    result = await backend.append(KEY, req(event("next", T0 + n), revision=n, now=T0))
    assert result.revision == n + 1


async def test_a_given_client_that_decodes_replies_works_and_is_left_open(
    url: str, prefix: str
) -> None:
    client = Redis.from_url(url, decode_responses=True)
    try:
        backend = RedisAdkBackend(client=client, prefix=prefix)
        await backend.create(
            KEY, state={"k": [1]}, app_delta={"a": 1}, user_delta={"u": 1}, create_time=T0, now=T0
        )
        await backend.append(KEY, req(event("é1", T0 + 1, "ünï"), session_delta={"k": 2}))
        got = await backend.read(KEY, recent=None, after=None, now=T0 + 1)
        assert got is not None
        assert [(e.event_id, e.timestamp) for e in got.events] == [("é1", T0 + 1)]
        assert json.loads(got.events[0].data)["text"] == "ünï"
        assert (dict(got.session.state), dict(got.app_state)) == ({"k": 2}, {"a": 1})
        listed = await backend.list_sessions("app", None, now=T0 + 1)
        assert [s.key for s in listed.sessions] == [KEY]
        assert dict(await backend.read_user_state("app", "alice")) == {"u": 1}
        await backend.close()
        assert await client.ping()  # the caller's client stays open
    finally:
        await client.aclose()
