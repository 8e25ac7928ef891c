"""The Redis backend of ToubaSessionService on a real Redis Cluster (three masters).

Every key of a backend shares one hash tag, so one slot: each script (which touches
the app state, the user state and the session together, and builds the names of
the sessions it lists or purges) runs on the node that owns it. The cluster is the
one ``tests/history/test_redis_cluster.py`` starts (this machine's ``redis-server``
on free loopback ports).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from google.adk.errors import StaleSessionError
from redis.asyncio import RedisCluster

from tests.history.test_redis_cluster import cluster  # noqa: F401 - the fixture
from touba.errors import DecisionHistoryBusy
from touba.integrations.adk import ToubaSessionService
from touba.integrations.adk._backend import AdkLimits, AppendRequest, SessionKey, StoredEvent
from touba.integrations.adk._redis import RedisAdkBackend

pytestmark = pytest.mark.redis

T0 = 1_765_000_000.5


@pytest.fixture
async def client(cluster: list[int]) -> AsyncIterator[RedisCluster]:  # noqa: F811
    connection = RedisCluster(host="127.0.0.1", port=cluster[0])
    try:
        yield connection
    finally:
        await connection.aclose()


def req(event_id: str, at: float, revision: int | None, **kw: Any) -> AppendRequest:
    event = StoredEvent(event_id, at, json.dumps({"id": event_id}))
    return AppendRequest(event=event, update_time=at, now=at, expected_revision=revision, **kw)


async def test_every_step_of_the_backend_runs_on_a_cluster(
    client: RedisCluster, request: pytest.FixtureRequest
) -> None:
    limits = AdkLimits(ttl_seconds=100, max_sessions=10, hold_seconds=30)
    backend = RedisAdkBackend(client=client, prefix=f"{request.node.name}:", limits=limits)
    keys = [SessionKey("app", user, f"s-{user}") for user in ("alice", "bob", "carol")]
    for key in keys:
        await backend.create(
            key, state={"k": key.user_id}, app_delta={"a": 1}, user_delta={}, create_time=T0, now=T0
        )
    alice = keys[0]
    for i in range(5):
        await backend.append(alice, req(f"e{i}", T0 + 1 + i, i, user_delta={"n": i}))
    with pytest.raises(StaleSessionError):
        await backend.append(alice, req("late", T0 + 9, 2))
    got = await backend.read(alice, recent=2, after=None, now=T0 + 9)
    assert got is not None
    assert [e.event_id for e in got.events] == ["e3", "e4"]
    assert (dict(got.app_state), dict(got.user_state)) == ({"a": 1}, {"n": 4})
    listed = await backend.list_sessions("app", None, now=T0 + 9)
    assert [s.key for s in listed.sessions] == [keys[1], keys[2], alice]
    assert dict(await backend.read_user_state("app", "alice")) == {"n": 4}
    await backend.hold(keys[1], "run-a", now=T0 + 9)
    with pytest.raises(DecisionHistoryBusy):
        await backend.append(keys[1], req("b", T0 + 9, 0))
    assert await backend.release(keys[1], "run-a")
    assert await backend.recover(alice) is False
    await backend.delete(keys[2])
    assert await backend.purge_expired(now=T0 + 101) == 1  # bob's; alice lives to T0 + 105
    assert [s.key for s in (await backend.list_sessions("app", None, now=T0 + 101)).sessions] == [
        alice
    ]
    await backend.close()


async def test_the_service_on_a_cluster_client(
    client: RedisCluster, request: pytest.FixtureRequest
) -> None:
    from google.adk.events.event import Event
    from google.adk.events.event_actions import EventActions

    backend = RedisAdkBackend(client=client, prefix=f"{request.node.name}:")
    async with ToubaSessionService(backend) as service:
        session = await service.create_session(app_name="app", user_id="u", state={"k": 1})
        event = Event(author="user", actions=EventActions(state_delta={"app:x": 1, "user:y": 2}))
        await service.append_event(session, event)
        again = await service.get_session(app_name="app", user_id="u", session_id=session.id)
        assert again is not None
        assert again.state == {"k": 1, "app:x": 1, "user:y": 2}
        assert [e.id for e in again.events] == [event.id]
