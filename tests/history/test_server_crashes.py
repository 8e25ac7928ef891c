"""The database server kill -9ed while workers write: nothing acknowledged is lost (issue 29, 3).

A private PostgreSQL cluster and a private ``redis-server`` (``tests/_private_servers.py``:
fsync on; ``appendonly yes`` with ``appendfsync always``) are each killed 30 times at
seeded random moments and restarted while worker processes make decisions, store
transactions, chat turns and key-event updates (``bench/server_crashes.py``, which runs
many more kills). The seed is printed; ``TOUBA_CRASH_SEED`` replays one.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from bench.server_crashes import CrashReport, run_crashes

from tests._private_servers import (
    PrivatePostgres,
    PrivateRedis,
    private_postgres_or_skip,
    private_redis_or_skip,
)

KILLS = 30


@pytest.fixture
def seed() -> int:
    chosen = os.environ.get("TOUBA_CRASH_SEED")
    value = int(chosen) if chosen else random.SystemRandom().randrange(2**31)
    print(f"server crashes: seed {value} (replay with TOUBA_CRASH_SEED={value})")
    return value


@pytest.fixture
def postgres_server() -> Iterator[PrivatePostgres]:
    with private_postgres_or_skip() as server:
        yield server


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    with private_redis_or_skip() as server:
        yield server


def check(report: CrashReport) -> None:
    print(report.row())
    assert report.kills == KILLS
    assert report.lost == []
    assert report.half_written == []
    assert report.untyped == []  # only DecisionHistoryStoreUnavailable, ...Busy, MemoryStore...
    assert report.timeouts == 0
    assert report.stalled == []  # every worker wrote before the first kill and after the last
    assert report.unrecoverable == []
    assert report.acked > KILLS
    assert sum(report.errors.values()) > 0  # the kills did strike writes


def test_postgres_killed_30_times_loses_no_acknowledged_write(
    postgres_server: PrivatePostgres, seed: int
) -> None:
    report = run_crashes(
        "postgres", postgres_server, kills=KILLS, seed=seed, up=(0.1, 0.8), down=(0.0, 0.3)
    )
    check(report)
    assert {w["kind"] for w in report.workers} == {"decide", "chat", "events"}


def test_redis_killed_30_times_loses_no_acknowledged_write(
    redis_server: PrivateRedis, seed: int
) -> None:
    report = run_crashes(
        "redis", redis_server, kills=KILLS, seed=seed, up=(0.1, 0.8), down=(0.0, 0.3)
    )
    check(report)
    assert {w["kind"] for w in report.workers} == {"decide", "transact"}
