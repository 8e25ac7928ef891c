"""Round trips per decision, counted by a proxy, pinned for each networked store.

A decision (``DecisionHistory.step``: reserve, read the window, save) reaches its
store through ``tests/_netproxy.py``'s ``NetProxy``, which counts the round trips it
relays. What each store guarantees, flat from 10 to 500 retained exchanges:

- PostgreSQL: 2 (the reservation, which reads the tail with it; the save, one
  statement each on the store's own autocommit pool);
- Redis: 2 (the claim with an LRANGE pipelined after it; the commit);
- Redis Cluster: 2 (the claim's script brings the rows itself, as a cluster client
  cannot pipeline a script), and a wide session read 1 (the peek).

And on PostgreSQL: a delete 1, a release 1 or 2, a chat turn at most 10 to the
memory store and 11 to the history store.

Counting is deterministic where time is not: a store that spends one more round
trip per decision fails here. ``bench/latency.py`` measures the same with added
latency, and decisions per second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.latency import (
    Reached,
    cluster_history,
    cluster_through_proxies,
    conversation,
    measure_decisions,
    postgres_chat,
    postgres_history,
    redis_history,
)

from tests._redis_cluster import missing
from tests._services import postgres_dsn, redis_url, unavailable
from touba.integrations.openai_agents import ToubaSession

DECISIONS = 10
SIZES = (10, 500)  # retained exchanges: a short conversation and a long one


async def _trips_per_decision(reached: Reached) -> dict[int, float]:
    found = {}
    for size in SIZES:
        talk = await conversation(reached.store, f"trips-{size}", size)
        measured = await measure_decisions(talk, DECISIONS, reached.proxies)
        assert measured.trips is not None
        found[size] = measured.trips
    return found


@pytest.mark.postgres
async def test_a_postgres_decision_is_two_round_trips_whatever_the_history() -> None:
    async with postgres_history(postgres_dsn()) as reached:
        assert await _trips_per_decision(reached) == {10: 2.0, 500: 2.0}


@pytest.mark.redis
async def test_a_redis_decision_is_two_round_trips_whatever_the_history() -> None:
    async with redis_history(redis_url()) as reached:
        assert await _trips_per_decision(reached) == {10: 2.0, 500: 2.0}


@pytest.mark.redis
async def test_on_a_redis_cluster_a_decision_is_two_round_trips_and_a_wide_read_one(
    tmp_path: Path,
) -> None:
    reason = missing()
    if reason is not None:
        unavailable(reason)
    with cluster_through_proxies(tmp_path) as (proxies, remap):
        async with cluster_history(proxies, remap) as reached:
            assert await _trips_per_decision(reached) == {10: 2.0, 500: 2.0}
            session = ToubaSession("wide", store=reached.store, namespace="trips")
            items: list[Any] = [{"role": "user", "content": f"q{n}"} for n in range(40)]
            await session.add_items(items)
            for _ in range(2):  # the reads settle wider than OPTIMISTIC_READ exchanges
                assert await session.get_items() == items
            for proxy in proxies:
                proxy.reset_counts()
            assert await session.get_items() == items
            assert sum(proxy.round_trips for proxy in proxies) == 1  # the peek


@pytest.mark.postgres
async def test_a_postgres_delete_or_release_is_one_round_trip() -> None:
    """Deleting an unreserved conversation is one statement (it was a transaction of
    four, six round trips with its BEGIN and COMMIT); deleting a reserved one is one,
    and releasing a conversation that has a record two (it was a transaction each)."""
    async with postgres_history(postgres_dsn()) as reached:
        store, [proxy] = reached.store, reached.proxies
        talk = await conversation(store, "deleted", 3)
        await measure_decisions(talk, 1, reached.proxies)
        proxy.reset_counts()
        assert await store.delete(talk.identity.key)
        assert proxy.round_trips == 1
        assert await store.read(talk.identity.key) is None

        talk = await conversation(store, "dropped", 3)
        proxy.reset_counts()

        async def drop(record: dict[str, Any] | None) -> tuple[None, None]:
            return None, None

        await store.transact(talk.identity.key, drop)  # reserve, then delete
        assert proxy.round_trips == 2
        assert await store.read(talk.identity.key) is None

        talk = await conversation(store, "kept", 3)
        proxy.reset_counts()

        async def keep(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
            raise LookupError("refused")  # the reservation is released, nothing written

        with pytest.raises(LookupError):
            await store.transact(talk.identity.key, keep)
        assert proxy.round_trips == 3  # reserve; release: not bare, then clear the token
        assert await store.read(talk.identity.key) is not None


@pytest.mark.postgres
async def test_a_postgres_chat_turn_takes_at_most_ten_and_eleven_round_trips() -> None:
    """A chat turn (two decisions and a call, one invocation whose conversation is new
    and deleted at its end): at most 10 round trips to the memory store and 11 to the
    history store (a new conversation's reservation is a transaction of four
    statements, six round trips; the delete one)."""
    turns = 3
    warm_up = 8  # psycopg prepares a statement at its sixth run (a round trip, once)
    async with postgres_chat(postgres_dsn(), turns=turns + warm_up) as chat:
        for _ in range(warm_up):  # prepared statements, the first purge
            await chat.turn()
        for proxy in chat.proxies:
            proxy.reset_counts()
        for _ in range(turns):
            await chat.turn()
        assert chat.memory.round_trips <= 10 * turns
        assert chat.history.round_trips <= 11 * turns
