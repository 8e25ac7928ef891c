"""PostgresHistoryStore under a network that goes silent, cuts or lags (issue 29, item 2).

Through a loopback proxy (tests/_pg_deadlines.py), with ``deadline_seconds=1``:

- a black hole (packets dropped, nothing closed): a decision fails with the retryable
  ``DecisionHistoryStoreUnavailable`` within the deadline + 1 s; once the network is back
  the next one succeeds and every acknowledged decision is stored. Silence that starts
  while the operation runs (after the reservation) fails the save and its release
  together within that bound (issue item 7c: the release no longer waits for the pool's
  timeout); the reservation it held is left for ``recover``, never reused by another
  worker;
- a connection cut in the middle of a transaction: a typed error or success, never half
  a write; the store goes on;
- 50 ms of added round-trip time: decisions still succeed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from tests._pg_deadlines import DEADLINE, GRACE, Behind, behind_proxy, fails_in_time, timed_out
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryStoreUnavailable,
)
from touba.history import HistoryConfig
from touba.history.postgres import PostgresHistoryStore
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

pytestmark = pytest.mark.postgres
KEY = "dl:one"


@pytest.fixture
def pg() -> Iterator[Behind]:
    with behind_proxy() as behind:
        yield behind


def store_of(pg: Behind, dsn: str | None = None) -> PostgresHistoryStore:
    return PostgresHistoryStore(dsn or pg.dsn, table=pg.table("h"), deadline_seconds=DEADLINE)


async def bump(record: Any) -> tuple[Any, int]:
    n = (record or {}).get("n", 0) + 1
    return {"n": n}, n


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_a_deadline_that_is_not_a_positive_number_is_refused_at_construction(
    deadline: Any,
) -> None:
    with pytest.raises(ConfigurationError, match="deadline_seconds"):
        PostgresHistoryStore("postgresql://localhost/x", deadline_seconds=deadline)


async def test_a_decision_under_a_black_hole_fails_typed_in_time_and_the_next_succeeds(
    pg: Behind,
) -> None:
    async with store_of(pg) as store:
        provider = ScriptedProvider(
            ScriptedProvider.final("one"),
            ScriptedProvider.final("two"),
            history=HistoryConfig(store=store, namespace="dl"),
        )
        program = Program()
        program.agent("helper", provider=provider)
        runtime = Runtime(program)
        first = await runtime.invoke("helper", input="first", run_id="r1")
        assert first.status == "completed"

        pg.proxy.black_hole()
        start = time.monotonic()
        silent = await runtime.invoke("helper", input="second", run_id="r2")
        took = time.monotonic() - start
        assert silent.status == "failed"
        assert isinstance(silent.error, DecisionHistoryStoreUnavailable)
        assert silent.error.retryable
        assert timed_out(silent.error)
        assert took < DEADLINE + GRACE, took

        pg.proxy.restore()
        third = await runtime.invoke("helper", input="third", run_id="r3")
        assert (third.status, third.output) == ("completed", "two")
    async with store_of(pg, pg.direct) as direct:
        stored = await direct.list("dl")
    assert len(stored) == 2  # both acknowledged decisions, neither reserved
    assert not any(c.active for c in stored)


async def test_silence_during_the_operation_fails_save_and_release_within_the_deadline(
    pg: Behind,
) -> None:
    async with store_of(pg) as store, store_of(pg, pg.direct) as other:
        assert await store.transact(KEY, bump) == 1

        async def bump_in_silence(record: Any) -> tuple[Any, int]:
            pg.proxy.black_hole()  # after the reservation, before the save
            return await bump(record)

        error = await fails_in_time(
            store.transact(KEY, bump_in_silence), DecisionHistoryStoreUnavailable
        )
        assert timed_out(error)
        assert "recover" in str(error)  # what the operator does about the reservation
        pg.proxy.restore()
        with pytest.raises(DecisionHistoryBusy):  # another worker never takes it over
            await other.transact(KEY, bump)
        await other.recover(KEY, worker_stopped=True)
        assert await store.transact(KEY, bump) == 2  # the acknowledged 1 kept, nothing half
        assert await other.read(KEY) == {"n": 2}


async def test_a_cut_in_the_middle_of_a_transaction_fails_typed_and_writes_nothing(
    pg: Behind,
) -> None:
    async with store_of(pg) as store, store_of(pg, pg.direct) as direct:
        acknowledged = await store.transact(KEY, bump)
        failures = 0
        error: DecisionHistoryStoreUnavailable | None = None
        for nth in range(1, 8):  # the reservation, each statement of the save, the COMMIT
            pg.proxy.cut_on(nth)
            try:
                acknowledged = await store.transact(KEY, bump)
            except DecisionHistoryStoreUnavailable as e:  # retryable by its class
                failures += 1
                error = e
            pg.proxy.cut_on(0)
            assert await direct.read_saved(KEY) == {"n": acknowledged}  # whole or absent
            await direct.recover(KEY, worker_stopped=True)  # a release the cut also hit
        assert failures >= 3
        assert error is not None
        assert error.retryable
        assert await store.transact(KEY, bump) == acknowledged + 1


async def test_added_latency_slows_decisions_without_failing_them(pg: Behind) -> None:
    async with store_of(pg) as store:
        assert await store.transact(KEY, bump) == 1
        pg.proxy.delay(50)
        for n in range(2, 5):
            assert await store.transact(KEY, bump) == n
        assert await store.read(KEY) == {"n": 4}


async def test_a_task_cancelled_in_a_silent_statement_ends_by_the_deadline(pg: Behind) -> None:
    """psycopg answers a cancellation during a statement by sending a cancel request on
    a new connection and waiting for the statement (up to 10 s, both swallowed by a
    black hole); the deadline cuts that short, and a host's own ``asyncio.timeout``
    still raises TimeoutError (its cancellation is not confused with ours)."""
    async with store_of(pg) as store:
        assert await store.transact(KEY, bump) == 1
        pg.proxy.black_hole()
        start = time.monotonic()
        task = asyncio.create_task(store.transact(KEY, bump))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - start < DEADLINE + GRACE
        pg.proxy.restore()  # the pool's connections that lived through it are not reused
        await store.recover(KEY, worker_stopped=True)
        assert await store.transact(KEY, bump) == 2
        pg.proxy.black_hole()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await store.transact("dl:two", bump)
        assert time.monotonic() - start < DEADLINE + GRACE
        pg.proxy.restore()
        assert await store.transact("dl:three", bump) == 1


async def test_a_pool_given_by_the_host_is_bounded_too_and_gets_the_cut_connection_back(
    pg: Behind,
) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(pg.dsn, open=False, min_size=2, max_size=2)
    await pool.open(wait=True)
    try:
        store = PostgresHistoryStore(pool=pool, table=pg.table("h"), deadline_seconds=DEADLINE)
        async with store:
            assert await store.transact(KEY, bump) == 1
            pg.proxy.black_hole()
            error = await fails_in_time(store.transact(KEY, bump), DecisionHistoryStoreUnavailable)
            assert timed_out(error)
            pg.proxy.restore()
        assert pool.get_stats()["returns_bad"] >= 1  # discarded, never lent again
    finally:
        await pool.close()


async def test_a_host_pools_own_shorter_timeout_bounds_the_wait_for_a_connection(
    pg: Behind,
) -> None:
    """The host gave its pool ``timeout=0.2``, shorter than the store's deadline: while
    the server refuses connections, a call fails on the pool's own timeout (its
    ``PoolTimeout`` chained, not the store's deadline), as the pool's owner chose."""
    from psycopg_pool import PoolTimeout

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg.dsn, open=False, min_size=1, max_size=1, timeout=0.2
    )
    await pool.open(wait=True)
    try:
        store = PostgresHistoryStore(pool=pool, table=pg.table("h"), deadline_seconds=30)
        async with store:
            assert await store.transact(KEY, bump) == 1
            pg.proxy.refuse()
            with pytest.raises(DecisionHistoryStoreUnavailable):  # its connection is cut
                await store.transact(KEY, bump)
            with pytest.raises(DecisionHistoryStoreUnavailable) as failed:  # none to be had
                await store.transact(KEY, bump)
            assert isinstance(failed.value.__cause__, PoolTimeout)
            assert not timed_out(failed.value)
            pg.proxy.restore()
    finally:
        await pool.close()


def test_the_own_pools_link_options_follow_the_deadline_unless_the_dsn_sets_them() -> None:
    from psycopg import pq

    from touba.history._pg import _link_options

    options = _link_options("postgresql://u@h/db", 1.0)
    assert options["connect_timeout"] == 2  # libpq's floor
    assert (options["keepalives"], options["keepalives_idle"]) == (1, 1)
    assert options["keepalives_count"] == 3
    if pq.version() >= 120000:
        assert options["tcp_user_timeout"] == 1000
    assert _link_options("postgresql://u@h/db", 7.5)["connect_timeout"] == 8
    given = _link_options("host=h connect_timeout=30 keepalives_idle=60 tcp_user_timeout=9", 1)
    assert "connect_timeout" not in given
    assert "tcp_user_timeout" not in given
    assert not any(name.startswith("keepalives") for name in given)  # the DSN's policy stays
