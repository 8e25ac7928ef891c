"""ToubaSessionService on PostgreSQL against ADK's own ``DatabaseSessionService``, side by side.

ADK's ``DatabaseSessionService`` (SQLAlchemy, here on PostgreSQL through psycopg 3)
stores events as rows too, but ``get_session`` with ``num_recent_events`` has no
index on ``(session, timestamp)`` to read the newest k by (adk-python #4827), and
its ``list_sessions`` reads the user states of the app one session at a time.
touba's PostgreSQL backend reads the newest k backwards on ``(sid, ts,
event_id)`` in the statement that reads the session and both states, and lists
an app in one statement.

Sessions holding N = 10, 100, 1,000 and 5,000 events of ~1 KiB (built through
each service's own ``append_event``) run in interleaved rounds (every system and
size once per round): one agent step, ``get_session(num_recent_events=20)`` then
``append_event`` of a 1 KiB event; then a whole ``get_session`` at each size;
then ``list_sessions`` of an app holding 5,000 sessions (50 users). Printed: the
median of each in ms, touba's then ADK's, and their ratio (touba / ADK), with
each system's growth from the smallest to the largest session. Both use the
same server, each in a schema of its own, dropped at the end. Benchmarks are
not tests: nothing here asserts a time.

    .venv/bin/python bench/adk_postgres.py [--quick] [--sizes 10,100,1000,5000]
        [--rounds 30] [--sessions 5000]

Needs the PostgreSQL server of ``TOUBA_POSTGRES_DSN`` (default
postgresql://postgres@127.0.0.1:5432/test) and ``sqlalchemy[asyncio]`` (the
``dev`` extra).
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

import psycopg
from google.adk.events.event import Event
from google.adk.sessions import BaseSessionService
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.sessions.database_session_service import DatabaseSessionService
from google.genai import types
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from touba.integrations.adk import ToubaSessionService

DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
APP, USER = "bench", "u"
RECENT = 20


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg 3, async) of a libpq DSN."""
    info = conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    password = f":{info['password']}" if info.get("password") else ""
    host, port = info.get("host", "127.0.0.1"), info.get("port", "5432")
    return f"postgresql+psycopg://{user}{password}@{host}:{port}/{info.get('dbname', 'test')}"


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


async def fill(service: BaseSessionService, session_id: str, n: int, t0: float) -> None:
    session = await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
    for i in range(n):
        await service.append_event(session, one_event(i, t0 + i))


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
    print(f"{label:<34} {a:>10.2f} {b:>10.2f} {a / b:>8.2f}", flush=True)
    return a, b


async def main(sizes: list[int], rounds: int, sessions: int) -> None:
    run = uuid.uuid4().hex[:8]
    ours_schema, theirs_schema = f"touba_bench_adk_{run}", f"adk_bench_{run}"
    try:
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for schema in (ours_schema, theirs_schema):
                await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    except psycopg.OperationalError as e:
        print(f"bench/adk_postgres.py skipped: PostgreSQL is not reachable at {DSN} ({e})")
        return
    touba = ToubaSessionService.postgres(DSN, table_prefix=f"{ours_schema}.adk")
    adk = DatabaseSessionService(
        sqlalchemy_url(DSN), connect_args={"options": f"-csearch_path={theirs_schema}"}
    )
    try:
        t0 = time.time() - 10**6
        for n in sizes:
            await fill(touba, f"s{n}", n, t0)
            await fill(adk, f"s{n}", n, t0)
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
            sid, user = f"l{i:05d}", f"u{i % 50}"
            await touba.create_session(app_name="listed", user_id=user, session_id=sid)
            await adk.create_session(app_name="listed", user_id=user, session_id=sid)
        ours, theirs = [], []
        for _ in range(5):
            await timed(ours, touba.list_sessions(app_name="listed"))
            await timed(theirs, adk.list_sessions(app_name="listed"))
        row(f"list_sessions of {sessions}", ours, theirs)
    finally:
        await touba.close()
        await adk.close()
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            for schema in (ours_schema, theirs_schema):
                await conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


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
