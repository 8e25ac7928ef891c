"""What ``bench/adk_postgres.py`` and ``bench/adk_redis.py`` share: the events, the
agent step, the side-by-side measurement and its printed table, the command line.

Each script supplies only its two services (touba's and ADK's own on the same
server), how each is filled, and its cleanup.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from google.adk.events.event import Event
from google.adk.sessions import BaseSessionService
from google.adk.sessions.base_session_service import GetSessionConfig
from google.genai import types

APP, USER = "bench", "u"
RECENT = 20

Fill = Callable[[str, int, float], Awaitable[None]]  # (session id, events, first timestamp)


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


async def compare(
    touba: BaseSessionService,
    adk: BaseSessionService,
    fills: tuple[Fill, Fill],
    sizes: list[int],
    rounds: int,
    sessions: int,
) -> None:
    """Fill a session of each size on both (``fills``: touba's, ADK's), then print the
    medians of the agent step, the whole read and ``list_sessions``, in interleaved rounds."""
    t0 = time.time() - 10**6
    for n in sizes:
        await fills[0](f"s{n}", n, t0)
        await fills[1](f"s{n}", n, t0)
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


def run(doc: str, main: Callable[[list[int], int, int], Coroutine[Any, Any, None]]) -> None:
    """Parse the command line (``--quick``, ``--sizes``, ``--rounds``, ``--sessions``)
    and run ``main(sizes, rounds, sessions)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
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
