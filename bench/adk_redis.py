"""ToubaSessionService on Redis against ADK's own ``RedisSessionService``, side by side.

ADK 2.13 ships a Redis session service (``google.adk.integrations.redis``) that keeps
a session as one JSON value: ``get_session`` reads and parses every event, and
``append_event`` reads, parses and rewrites them all in a WATCH transaction. touba's
Redis backend keeps the events as a log (a sorted set of ids beside their texts):
an append writes one event, ``num_recent_events=k`` reads k.

Sessions holding N = 10, 100, 1,000 and 5,000 events of ~1 KiB run in interleaved
rounds (every system and size once per round): one agent step, ``get_session(
num_recent_events=20)`` then ``append_event`` of a 1 KiB event; then a whole
``get_session`` at each size; then ``list_sessions`` of an app holding 5,000
sessions. Printed: the median of each in ms, touba's then ADK's, and their ratio
(touba / ADK), with each system's growth from the smallest to the largest
session. ADK's sessions are written directly as the JSON value its service
stores (building 5,000 events through its append would rewrite the session 5,000
times). Both use the same server and redis-py. Benchmarks are not tests:
nothing here asserts a time.

    .venv/bin/python bench/adk_redis.py [--quick] [--sizes 10,100,1000,5000]
        [--rounds 30] [--sessions 5000]

Needs the Redis server of ``TOUBA_REDIS_URL`` (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from google.adk.events.event import Event
from google.adk.integrations.redis import RedisSessionService, RedisSessionServiceConfig
from google.adk.sessions import BaseSessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.genai import types
from redis.asyncio import Redis
from redis.exceptions import RedisError

from touba.integrations.adk import ToubaSessionService

URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")
APP, USER = "bench", "u"
RECENT = 20


def one_event(i: int, timestamp: float) -> Event:
    """A model event of ~1 KiB of text."""
    return Event(
        author="model",
        invocation_id=f"inv-{i // 10}",
        timestamp=timestamp,
        content=types.Content(role="model", parts=[types.Part(text=f"{i:06d} " + "x" * 1000)]),
    )


async def timed(samples: list[float], run: Awaitable[Any]) -> None:
    """Await ``run``, adding its time in ms to ``samples``."""
    start = time.perf_counter()
    await run
    samples.append((time.perf_counter() - start) * 1000)


async def fill_touba(service: ToubaSessionService, session_id: str, n: int, t0: float) -> None:
    session = await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
    for i in range(n):
        await service.append_event(session, one_event(i, t0 + i))
    session.events.clear()


async def fill_adk(
    service: RedisSessionService, raw: Redis, session_id: str, n: int, t0: float
) -> None:
    await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
    session = Session(
        id=session_id,
        app_name=APP,
        user_id=USER,
        state={},
        events=[one_event(i, t0 + i) for i in range(n)],
        last_update_time=t0 + n,
    )
    key = service._session_key(APP, USER, session_id)  # its own layout
    await raw.set(key, session.model_dump_json(), ex=3600)


async def step(service: BaseSessionService, session_id: str, i: int) -> None:
    """One agent step: the recent events, then one appended."""
    session = await service.get_session(
        app_name=APP,
        user_id=USER,
        session_id=session_id,
        config=GetSessionConfig(num_recent_events=RECENT),
    )
    assert session is not None
    await service.append_event(session, one_event(10**6 + i, time.time()))


async def whole(service: BaseSessionService, session_id: str) -> None:
    session = await service.get_session(app_name=APP, user_id=USER, session_id=session_id)
    assert session is not None


def row(label: str, ours: list[float], theirs: list[float]) -> tuple[float, float]:
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{label:<34} {a:>10.2f} {b:>10.2f} {a / b:>8.2f}")
    return a, b


async def main(sizes: list[int], rounds: int, sessions: int) -> None:
    run = uuid.uuid4().hex[:8]
    ours_prefix, theirs_prefix = f"touba-bench-adk:{run}:", f"adk-bench:{run}:"
    raw = Redis.from_url(URL)
    try:
        await raw.ping()
    except RedisError as e:
        await raw.aclose()
        print(f"bench/adk_redis.py skipped: Redis is not reachable at {URL} ({e})")
        return
    touba = ToubaSessionService.redis(URL, prefix=ours_prefix)
    adk = RedisSessionService(RedisSessionServiceConfig(uri=URL, key_prefix=theirs_prefix))
    try:
        t0 = time.time() - 10**6
        for n in sizes:
            await fill_touba(touba, f"s{n}", n, t0)
            await fill_adk(adk, raw, f"s{n}", n, t0)
        step_ours: dict[int, list[float]] = {n: [] for n in sizes}
        step_theirs: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(rounds):
            for n in sizes if r % 2 == 0 else reversed(sizes):
                await timed(step_ours[n], step(touba, f"s{n}", r))
                await timed(step_theirs[n], step(adk, f"s{n}", r))
        print(f"{'median ms (touba, ADK, ratio)':<34} {'touba':>10} {'ADK':>10} {'ratio':>8}")
        firsts = [row(f"step at {n} events", step_ours[n], step_theirs[n]) for n in sizes]
        growth = [firsts[-1][k] / firsts[0][k] for k in (0, 1)]
        label = f"step growth {sizes[0]} -> {sizes[-1]}"
        print(f"{label:<34} {growth[0]:>10.2f} {growth[1]:>10.2f}")
        for n in sizes:
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(max(3, rounds // 3)):
                await timed(ours, whole(touba, f"s{n}"))
                await timed(theirs, whole(adk, f"s{n}"))
            row(f"whole get_session at {n}", ours, theirs)
        for i in range(sessions):
            sid = f"l{i:05d}"
            await touba.create_session(app_name="listed", user_id=f"u{i % 50}", session_id=sid)
            await adk.create_session(app_name="listed", user_id=f"u{i % 50}", session_id=sid)
        ours, theirs = [], []
        for _ in range(5):
            await timed(ours, touba.list_sessions(app_name="listed"))
            await timed(theirs, adk.list_sessions(app_name="listed"))
        row(f"list_sessions of {sessions}", ours, theirs)
    finally:
        await touba.close()
        await adk._get_redis().aclose()  # it has no close
        for prefix in (ours_prefix, theirs_prefix):
            keys = [k async for k in raw.scan_iter(match=prefix + "*", count=1000)]
            for start in range(0, len(keys), 1000):
                await raw.delete(*keys[start : start + 1000])
        await raw.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="sizes 10,1000; 6 rounds; 500 sessions"
    )
    parser.add_argument("--sizes", default="10,100,1000,5000")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=5000)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.sessions = "10,1000", 6, 500
    asyncio.run(main([int(s) for s in args.sizes.split(",")], args.rounds, args.sessions))
    sys.exit(0)
