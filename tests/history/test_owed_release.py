"""A live worker frees its own reservation after a store outage (issue 29, item 7c).

When the store fails during a decision and fails its release too, the worker's
store object remembers that reservation (key and token) and releases it, checked
by token, before its next operation on that key: the worker needs no ``recover``
for its own conversation, while another worker's reservation (taken after a
``recover``) is never touched. The outage is real: the stores' connections go
through a loopback proxy that resets every connection, new ones included, as a
server that is down does (``tests/_netproxy.py``). SQLite's disk faults are in
``test_sqlite_faults.py``; a PostgreSQL server killed for real in
``test_server_crash_release.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from tests._netproxy import NetProxy, net_proxy
from tests._services import postgres_address, postgres_dsn, redis_url
from tests.history._stores import holding
from touba.errors import DecisionHistoryBusy, DecisionHistoryStoreUnavailable
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)

WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")


def _history(store: Any) -> DecisionHistory:
    return DecisionHistory(HistoryConfig(store=store, namespace="n"))


def _saying(text: str, during: Callable[[], None] = lambda: None) -> Any:
    async def generate(window: HistoryWindow) -> DecisionMessage:
        during()  # the key is reserved here, as while a model is called
        return DecisionMessage(text=text, final=True)

    return generate


async def _failing_with_its_release(history: DecisionHistory, proxy: NetProxy) -> str:
    """A decision whose save fails (the server goes down while the model answers) and
    whose release fails too; returns its error's text."""
    with pytest.raises(DecisionHistoryStoreUnavailable) as failed:
        await history.step(WHO, [], _saying("lost", proxy.refuse))
    message = str(failed.value)
    assert "could not be released either" in message
    assert "releases it before its next operation" in message
    return message


async def _until_up(attempt: Callable[[], Awaitable[Any]], seconds: float = 20) -> Any:
    """``attempt()`` until the store answers (its pool may take a moment to reconnect):
    a store failure in between is retried, anything else (busy) raises."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await attempt()
        except DecisionHistoryStoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _texts(record: Any) -> list[str]:
    return [m["text"] for ex in record["exchanges"] for m in ex if m.get("text")]


# -- PostgreSQL ----------------------------------------------------------------------------


@pytest.fixture
def pg_table() -> Iterator[str]:
    schema = f"t{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    yield f"{schema}.h"
    with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
async def postgres_proxied(pg_table: str) -> AsyncIterator[tuple[Any, Any, NetProxy]]:
    """A store behind the proxy (on a host pool that waits 1 s for a connection, so
    that a call fails soon while the server is down) and one that reaches the server
    directly: two workers."""
    from touba.history.postgres import PostgresHistoryStore

    with net_proxy(*postgres_address(postgres_dsn())) as proxy:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            proxy.dsn(postgres_dsn()),
            min_size=1,
            max_size=2,
            timeout=1.0,
            reconnect_timeout=1.0,  # psycopg_pool backs off for seconds otherwise (test time)
            open=False,
        )
        await pool.open(wait=True)
        worker = PostgresHistoryStore(pool=pool, table=pg_table)
        other = PostgresHistoryStore(postgres_dsn(), table=pg_table)
        try:
            yield worker, other, proxy
        finally:
            await worker.close()
            await other.close()
            await pool.close()


@pytest.fixture(
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def proxied(request: pytest.FixtureRequest) -> tuple[Any, Any, NetProxy]:
    """``postgres_proxied`` or ``redis_proxied``: a worker behind the proxy, and another."""
    found: tuple[Any, Any, NetProxy] = request.getfixturevalue(f"{request.param}_proxied")
    return found


async def test_a_worker_releases_its_own_reservation_after_an_outage(
    proxied: tuple[Any, Any, NetProxy],
) -> None:
    worker, other, proxy = proxied
    history = _history(worker)
    await history.step(WHO, [], _saying("first"))
    await _failing_with_its_release(history, proxy)
    with pytest.raises(DecisionHistoryBusy):  # the reservation outlived the outage
        await other.read(WHO.key)
    proxy.restore()
    # The live worker's next decision frees its own reservation first: no recover.
    await _until_up(lambda: history.step(WHO, [], _saying("second")))
    record = await other.read(WHO.key)
    assert _texts(record) == ["first", "second"]
    assert not (await other.list())[0].active
    assert len(worker._reservations.owed) == 0


@pytest.mark.postgres
async def test_postgres_worker_never_releases_a_reservation_another_worker_took(
    postgres_proxied: tuple[Any, Any, NetProxy],
) -> None:
    """After ``recover``, another worker holds the key: the failed worker's owed release
    (its own token) leaves that reservation alone, and its decision is refused busy."""
    worker, other, proxy = postgres_proxied
    history = _history(worker)
    await history.step(WHO, [], _saying("first"))
    await _failing_with_its_release(history, proxy)
    assert await other.recover(WHO.key, worker_stopped=True)
    record = await other.read(WHO.key)
    task, leave = await holding(other, WHO.key, lambda record: (record, None))
    proxy.restore()
    try:
        with pytest.raises(DecisionHistoryBusy):
            await _until_up(lambda: history.step(WHO, [], _saying("second")))
        assert len(worker._reservations.owed) == 0  # its own release was written: no-op
        assert (await other.list())[0].active  # the other worker still holds it
    finally:
        leave.set()
    await task  # its save went through: its reservation was never touched
    assert await other.read(WHO.key) == record
    await history.step(WHO, [], _saying("second"))
    assert _texts(await other.read(WHO.key)) == ["first", "second"]


@pytest.mark.postgres
async def test_postgres_delete_after_an_outage_frees_the_own_reservation_first(
    postgres_proxied: tuple[Any, Any, NetProxy],
) -> None:
    worker, other, proxy = postgres_proxied
    history = _history(worker)
    await history.step(WHO, [], _saying("first"))
    await _failing_with_its_release(history, proxy)
    proxy.restore()
    assert await _until_up(lambda: history.discard(WHO)) is True
    assert await other.read(WHO.key) is None


# -- Redis ---------------------------------------------------------------------------------


@pytest.fixture
async def redis_proxied() -> AsyncIterator[tuple[Any, Any, NetProxy]]:
    from redis.asyncio import Redis

    from touba.history.redis import RedisHistoryStore

    url = redis_url()
    prefix = f"touba-owed:{uuid.uuid4().hex[:12]}:"
    client = Redis.from_url(url)
    host, port = (
        client.connection_pool.connection_kwargs.get("host", "127.0.0.1"),
        int(client.connection_pool.connection_kwargs.get("port", 6379)),
    )
    with net_proxy(host, port) as proxy:
        worker = RedisHistoryStore(proxy.url(url), prefix=prefix)
        other = RedisHistoryStore(url, prefix=prefix)
        try:
            yield worker, other, proxy
        finally:
            await worker.close()
            await other.close()
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


# -- the bookkeeping -----------------------------------------------------------------------


def test_owed_releases_are_per_key_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    from touba.history._reservations import MAX_OWED, Owed

    owed = Owed()
    owed.add("k", "t1")
    owed.add("k", "t2")
    assert sorted(owed.of("k")) == ["t1", "t2"]
    assert owed.of("other") == ()
    owed.paid("k", "t1")
    assert owed.of("k") == ("t2",)
    assert "k" in owed
    owed.paid("k", "t2")
    assert "k" not in owed
    assert len(owed) == 0
    for n in range(MAX_OWED + 1):
        owed.add(f"k{n}", "t")
    assert len(owed) == MAX_OWED
    assert "k0" not in owed
    assert f"k{MAX_OWED}" in owed
    assert "stays busy until store.recover" in caplog.text


@pytest.mark.redis
async def test_a_worker_releases_a_conversation_it_never_visits_again_at_its_next_decision(
    redis_proxied: tuple[Any, Any, NetProxy],
) -> None:
    """A chat turn is an invocation of its own: when a store failure cuts its decision
    and the release fails too, no later turn visits that key. The worker's next
    decision, on another key, releases it first (found by the crash tests: the
    reservations a dead turn left held a place among max_sessions until recover)."""
    worker, other, proxy = redis_proxied
    history = _history(worker)
    await _failing_with_its_release(history, proxy)
    with pytest.raises(DecisionHistoryBusy):
        await other.read(WHO.key)
    proxy.restore()
    next_turn = ConversationIdentity("n", "openai", "m", "native", "r", "i2", "agent")
    await _until_up(lambda: history.step(next_turn, [], _saying("next turn")))
    assert await other.read(WHO.key) is None  # released: a new conversation, never saved
    assert len(worker._reservations.owed) == 0
    assert _texts(await other.read(next_turn.key)) == ["next turn"]
