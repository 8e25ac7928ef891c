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

import functools
import os
import sys
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.adk.integrations.redis import RedisSessionService, RedisSessionServiceConfig
from google.adk.sessions import Session
from redis.asyncio import Redis
from redis.exceptions import RedisError

from bench._adk import APP, USER, compare, one_event, run
from touba.integrations.adk import ToubaSessionService

URL = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")


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


async def main(sizes: list[int], rounds: int, sessions: int) -> None:
    tag = uuid.uuid4().hex[:8]
    ours_prefix, theirs_prefix = f"touba-bench-adk:{tag}:", f"adk-bench:{tag}:"
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
        fills = (functools.partial(fill_touba, touba), functools.partial(fill_adk, adk, raw))
        await compare(touba, adk, fills, sizes, rounds, sessions)
    finally:
        await touba.close()
        await adk._get_redis().aclose()  # it has no close
        for prefix in (ours_prefix, theirs_prefix):
            keys = [k async for k in raw.scan_iter(match=prefix + "*", count=1000)]
            for start in range(0, len(keys), 1000):
                await raw.delete(*keys[start : start + 1000])
        await raw.aclose()


if __name__ == "__main__":
    run(__doc__ or "", main)
