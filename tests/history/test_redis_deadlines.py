"""Deadlines of every Redis store (issue 29, item 2), through a loopback proxy
(tests/_netproxy.py) that black-holes, cuts or slows the traffic.

For ``RedisHistoryStore`` (a decision through ``DecisionHistory``), the ADK session
backend and the LangGraph saver backend: a network gone silent fails the operation
with the retryable ``DecisionHistoryStoreUnavailable`` within ``deadline_seconds`` + 1 s,
on the client the store makes from ``url=`` and on a client of the host's that has no
timeout at all; the next operation after the network returns succeeds, and nothing
acknowledged is lost. A connection cut mid-command is a typed error (with a client that
does not retry) and writes nothing; 50 ms of round-trip time changes nothing. A command
that timed out never leaves its late reply to be read as the answer to the next one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tests._netproxy import NetProxy, net_proxy
from tests._services import redis_url
from tests.integrations._stores import delete_keys
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryStoreUnavailable,
)
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)
from touba.history.redis import RedisHistoryStore

pytestmark = pytest.mark.redis

DEADLINE = 1.0
SLACK = 1.0  # the bound: a silent network fails within deadline + 1 s
IDENTITY = ConversationIdentity("ns", "openai", "m", "native", "r", "i", "a")


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"touba-test-deadline:{uuid.uuid4().hex[:12]}:"
    yield prefix
    delete_keys(prefix)


@pytest.fixture
def proxy(url: str) -> Iterator[NetProxy]:
    parts = urlsplit(url)
    with net_proxy(parts.hostname or "127.0.0.1", parts.port or 6379) as p:
        yield p


def bare_client(url: str) -> Redis:
    """A host's client with no timeout and no retry: only the store's deadline bounds it."""
    return Redis.from_url(url, retry=Retry(NoBackoff(), 0))


async def timed_failure(
    call: Callable[[], Awaitable[Any]],
) -> tuple[DecisionHistoryStoreUnavailable, float]:
    started = time.monotonic()
    with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
        await call()
    return caught.value, time.monotonic() - started


def texts(record: dict[str, Any] | None) -> list[str]:
    assert record is not None
    return [m["text"] for ex in record["exchanges"] for m in ex if m.get("kind") == "decision"]


class Decisions:
    """Decisions of one conversation through ``DecisionHistory`` on ``store``."""

    def __init__(self, store: RedisHistoryStore) -> None:
        self.history = DecisionHistory(HistoryConfig(store=store, namespace="ns"))

    async def decide(self, text: str, during: Callable[[], None] | None = None) -> None:
        async def generate(window: HistoryWindow) -> DecisionMessage:
            if during is not None:
                during()
            return DecisionMessage(text=text, final=True)

        await self.history.step(IDENTITY, [], generate)


@pytest.fixture
async def direct(url: str, prefix: str) -> AsyncIterator[RedisHistoryStore]:
    """The same store, reached without the proxy: what is really stored."""
    async with RedisHistoryStore(url, prefix=prefix) as store:
        yield store


# -- RedisHistoryStore ---------------------------------------------------------------------


def test_the_deadline_is_checked_at_construction(url: str) -> None:
    for bad in (0, -1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ConfigurationError, match="deadline_seconds"):
            RedisHistoryStore(url, deadline_seconds=bad)  # type: ignore[arg-type]
    assert RedisHistoryStore(url).deadline_seconds == 10.0


@pytest.mark.parametrize("client", ["the store's own client", "a host's client, no timeout"])
async def test_a_decision_under_a_black_hole_fails_in_time_and_the_next_succeeds(
    url: str, prefix: str, proxy: NetProxy, direct: RedisHistoryStore, client: str
) -> None:
    host = None if client.startswith("the store") else bare_client(proxy.url(url))
    store = (
        RedisHistoryStore(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE)
        if host is None
        else RedisHistoryStore(client=host, prefix=prefix, deadline_seconds=DEADLINE)
    )
    try:
        async with store:
            decisions = Decisions(store)
            await decisions.decide("d0")
            await decisions.decide("d1")
            proxy.black_hole()
            error, elapsed = await timed_failure(lambda: decisions.decide("lost"))
            assert error.retryable
            assert elapsed < DEADLINE + SLACK, elapsed
            assert "deadline_seconds" in str(error)
            proxy.restore()
            await decisions.decide("d2")  # a fresh connection: the silent one was dropped
    finally:
        if host is not None:
            await host.aclose()
    assert texts(await direct.read(IDENTITY.key)) == ["d0", "d1", "d2"]


async def test_a_black_hole_during_the_model_call_leaves_the_reservation_to_its_worker(
    url: str, prefix: str, proxy: NetProxy, direct: RedisHistoryStore
) -> None:
    """The claim went through, the save and its release meet the silence: the decision
    fails within the deadline (the release gets a short one of its own), the saved
    record stays as it was, another worker finds the conversation busy (never a
    reservation silently reused), and the live worker releases its own reservation at
    its next decision, without recover (issue 29, 7c)."""
    async with RedisHistoryStore(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE) as store:
        decisions = Decisions(store)
        await decisions.decide("d0")
        error, elapsed = await timed_failure(lambda: decisions.decide("lost", proxy.black_hole))
        assert error.retryable
        assert elapsed < DEADLINE + SLACK, elapsed
        proxy.restore()
        with pytest.raises(DecisionHistoryBusy):
            await Decisions(direct).decide("refused")  # another worker
        await decisions.decide("d1")  # this one releases what it owes first
    assert texts(await direct.read(IDENTITY.key)) == ["d0", "d1"]


async def test_a_cut_mid_save_is_a_typed_error_that_writes_nothing(
    url: str, prefix: str, proxy: NetProxy, direct: RedisHistoryStore
) -> None:
    host = bare_client(proxy.url(url))
    try:
        async with RedisHistoryStore(client=host, prefix=prefix, deadline_seconds=DEADLINE) as s:
            decisions = Decisions(s)
            await decisions.decide("d0")
            with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                await decisions.decide("lost", lambda: proxy.cut_on(1))  # the commit's send
            assert caught.value.retryable
            assert texts(await direct.read(IDENTITY.key)) == ["d0"]
            await decisions.decide("d1")  # released: free at once
    finally:
        await host.aclose()
    assert texts(await direct.read(IDENTITY.key)) == ["d0", "d1"]


async def test_decisions_through_50_ms_of_latency_work(
    url: str, prefix: str, proxy: NetProxy, direct: RedisHistoryStore
) -> None:
    proxy.delay(50)
    async with RedisHistoryStore(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE) as store:
        decisions = Decisions(store)
        for n in range(3):
            await decisions.decide(f"d{n}")
    assert texts(await direct.read(IDENTITY.key)) == ["d0", "d1", "d2"]


@pytest.mark.parametrize("client", ["the store's own client", "a host's client, no timeout"])
async def test_a_late_reply_is_never_read_as_the_next_answer(
    url: str, prefix: str, proxy: NetProxy, direct: RedisHistoryStore, client: str
) -> None:
    """A read times out while its reply is on the way (the proxy holds it 1.6 s): redis-py
    drops that connection (socket timeout or cancellation), so the next read, of another
    conversation, gets its own reply on a new connection, not the late one."""
    for key, value in (("a", {"who": "a"}), ("b", {"who": "b"})):
        await direct.transact(key, _put(value))
    host = None if client.startswith("the store") else bare_client(proxy.url(url))
    store = (
        RedisHistoryStore(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE)
        if host is None
        else RedisHistoryStore(client=host, prefix=prefix, deadline_seconds=DEADLINE)
    )
    try:
        async with store:
            assert await store.read("a") == {"who": "a"}
            proxy.delay(3200)
            error, elapsed = await timed_failure(lambda: store.read("a"))
            assert error.retryable
            assert elapsed < DEADLINE + SLACK
            proxy.delay(0)
            connections = proxy.connections
            assert await store.read("b") == {"who": "b"}
            assert proxy.connections == connections + 1  # the timed-out one was not reused
            assert await store.read("a") == {"who": "a"}
    finally:
        if host is not None:
            await host.aclose()


def _put(value: dict[str, Any]) -> Callable[[Any], Awaitable[tuple[Any, None]]]:
    async def operation(snapshot: Any) -> tuple[Any, None]:
        return value, None

    return operation


# -- the ADK session backend ---------------------------------------------------------------


async def test_adk_steps_under_a_black_hole_a_cut_and_latency(
    url: str, prefix: str, proxy: NetProxy
) -> None:
    pytest.importorskip("google.adk")
    from touba.integrations.adk import ToubaSessionService
    from touba.integrations.adk._backend import AppendRequest, SessionKey, StoredEvent
    from touba.integrations.adk._redis import RedisAdkBackend

    key = SessionKey("app", "alice", "s1")
    t0 = 1_765_000_000.0

    def request(n: int) -> AppendRequest:
        event = StoredEvent(f"e{n}", t0 + n, json.dumps({"id": f"e{n}"}))
        return AppendRequest(event=event, update_time=t0 + n, expected_revision=None, now=t0 + n)

    with pytest.raises(ConfigurationError, match="deadline_seconds"):
        ToubaSessionService.redis(url, prefix=prefix, deadline_seconds=0)
    service = ToubaSessionService.redis(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE)
    assert service._backend.deadline_seconds == DEADLINE  # type: ignore[attr-defined]
    await service.close()

    host = bare_client(proxy.url(url))
    backend = RedisAdkBackend(client=host, prefix=prefix, deadline_seconds=DEADLINE)
    direct = RedisAdkBackend(url, prefix=prefix)
    try:
        await backend.create(key, state={}, app_delta={}, user_delta={}, create_time=t0, now=t0)
        await backend.append(key, request(1))
        proxy.black_hole()
        error, elapsed = await timed_failure(lambda: backend.append(key, request(2)))
        assert error.retryable
        assert elapsed < DEADLINE + SLACK, elapsed
        proxy.restore()
        await backend.append(key, request(3))
        proxy.cut_on(1)
        with pytest.raises(DecisionHistoryStoreUnavailable):
            await backend.append(key, request(4))
        proxy.delay(50)
        await backend.append(key, request(5))
        read = await direct.read(key, recent=None, after=None, now=t0 + 10)
        assert read is not None
        assert [e.event_id for e in read.events] == ["e1", "e3", "e5"]
    finally:
        await backend.close()
        await direct.close()
        await host.aclose()


# -- the LangGraph saver backend ---------------------------------------------------------


def request(checkpoint_id: str, *, parent_id: str | None = None, base: Any = (), texts: Any) -> Any:
    """A put of checkpoint ``checkpoint_id`` on thread "t" appending ``texts`` to its log."""
    from touba.integrations.langgraph._backend import LogAppend, PutCheckpoint

    return PutCheckpoint(
        thread_id="t",
        checkpoint_ns="",
        checkpoint_id=checkpoint_id,
        parent_id=parent_id,
        checkpoint=("json", checkpoint_id.encode()),
        metadata=("json", b"{}"),
        metadata_json="{}",
        run_id=None,
        versions={},
        blobs=(),
        logs=(LogAppend("messages", base, tuple(("json", t.encode()) for t in texts)),),
    )


def texts_of(page: Any) -> list[str]:
    """The messages of the page's latest checkpoint."""
    from touba.integrations.langgraph._backend import LogKey

    record = page.rows[0].record
    entries = page.logs[LogKey(record.thread_id, record.checkpoint_ns, "messages")].entries
    return [entries[p][1].decode() for s in record.logs["messages"] for p in range(s.start, s.end)]


async def test_saver_steps_under_a_black_hole_a_cut_and_latency(
    url: str, prefix: str, proxy: NetProxy
) -> None:
    pytest.importorskip("langgraph.checkpoint")
    from touba.integrations.langgraph import ToubaSaver
    from touba.integrations.langgraph._redis import RedisSaverBackend

    with pytest.raises(ConfigurationError, match="deadline_seconds"):
        ToubaSaver.redis(url, prefix=prefix, deadline_seconds=-1)

    backend = RedisSaverBackend(proxy.url(url), prefix=prefix, deadline_seconds=DEADLINE)
    direct = RedisSaverBackend(url, prefix=prefix)
    try:
        spans = (await backend.put(request("0001", texts=("a",)))).spans["messages"]
        proxy.black_hole()
        error, elapsed = await timed_failure(
            lambda: backend.put(request("0002", parent_id="0001", base=spans, texts=("lost",)))
        )
        assert error.retryable
        assert elapsed < DEADLINE + SLACK, elapsed
        proxy.restore()
        assert texts_of(await backend.get("t", "", None, {})) == ["a"]
        spans = (
            await backend.put(request("0002", parent_id="0001", base=spans, texts=("b",)))
        ).spans["messages"]
        proxy.delay(50)
        await backend.put(request("0003", parent_id="0002", base=spans, texts=("c",)))
        page = await direct.get("t", "", None, {})
        assert texts_of(page) == ["a", "b", "c"]
    finally:
        await backend.close()
        await direct.close()


async def test_a_saver_put_cut_past_a_clients_retries_writes_nothing(
    url: str, prefix: str, proxy: NetProxy
) -> None:
    pytest.importorskip("langgraph.checkpoint")
    from touba.integrations.langgraph._redis import RedisSaverBackend

    host = bare_client(proxy.url(url))
    backend = RedisSaverBackend(client=host, prefix=prefix, deadline_seconds=DEADLINE)
    try:
        spans = (await backend.put(request("0001", texts=("a",)))).spans["messages"]
        proxy.cut_on(1)
        with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
            await backend.put(request("0002", parent_id="0001", base=spans, texts=("b",)))
        assert caught.value.retryable
        page = await backend.get("t", "", None, {})
        assert [r.record.checkpoint_id for r in page.rows] == ["0001"]
        assert texts_of(page) == ["a"]
    finally:
        await backend.close()
        await host.aclose()
