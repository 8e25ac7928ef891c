"""ToubaSessionService against ADK's own SqliteSessionService, side by side.

For sessions of N = 10, 100, 1,000 and 5,000 events of about 1 KB (a model
text event), in interleaved rounds (every system and size once per round):
one ``append_event`` followed by ``get_session(num_recent_events=20)``, the
step an ADK Runner turn does (it appends, then reads the recent window).
Printed: the median ms of that step per system and N, touba's growth from 10
to 5,000 events and the ratio touba / ADK at 5,000; then a whole-session
``get_session`` at 5,000 events and ``list_sessions`` of an app holding 5,000
sessions. Both on a SQLite file (touba: WAL, ``synchronous=FULL``; ADK's
service as it ships). Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/adk_sessions.py [--quick] [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from google.adk.events.event import Event
from google.adk.sessions import BaseSessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.genai import types

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from touba.integrations.adk import ToubaSessionService

SIZES = (10, 100, 1_000, 5_000)
APP = "bench"
WINDOW = 20
TEXT = "lorem ipsum dolor sit amet " * 34  # ~920 characters: ~1 KB of event JSON


def event(i: int) -> Event:
    return Event(
        author="agent",
        invocation_id=f"inv-{i}",
        content=types.Content(role="model", parts=[types.Part(text=f"{i} {TEXT}")]),
    )


async def fill(service: BaseSessionService, session: Session, n: int) -> Session:
    for i in range(n):
        await service.append_event(session, event(i))
    got = await service.get_session(
        app_name=APP,
        user_id=session.user_id,
        session_id=session.id,
        config=GetSessionConfig(num_recent_events=WINDOW),
    )
    assert got is not None
    return got


async def turn(service: BaseSessionService, session: Session, i: int) -> tuple[float, Session]:
    """One append and a read of the recent window: (ms, the session as read)."""
    start = time.perf_counter()
    await service.append_event(session, event(i))
    fresh = await service.get_session(
        app_name=APP,
        user_id=session.user_id,
        session_id=session.id,
        config=GetSessionConfig(num_recent_events=WINDOW),
    )
    elapsed = (time.perf_counter() - start) * 1000
    assert fresh is not None
    return elapsed, fresh


async def timed(step: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await step()
    return (time.perf_counter() - start) * 1000


def median(samples: list[float]) -> float:
    return statistics.median(samples)


async def main(directory: Path, rounds: int, sizes: tuple[int, ...], sessions_listed: int) -> None:
    systems: dict[str, BaseSessionService] = {
        "touba": ToubaSessionService.sqlite(directory / "touba.sqlite"),
        "adk": SqliteSessionService(str(directory / "adk.sqlite")),
    }
    current: dict[tuple[str, int], Session] = {}
    for name, service in systems.items():
        for n in sizes:
            session = await service.create_session(app_name=APP, user_id=f"u{n}")
            current[(name, n)] = await fill(service, session, n)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in current}
    counter = 10**6
    for round_no in range(rounds):
        order = list(current)
        order = order[round_no % len(order) :] + order[: round_no % len(order)]
        for name, n in order:
            counter += 1
            elapsed, current[(name, n)] = await turn(systems[name], current[(name, n)], counter)
            samples[(name, n)].append(elapsed)

    print(f"append_event + get_session(num_recent_events={WINDOW}), median ms over {rounds} rounds")
    print(f"{'events':>8} {'touba':>9} {'adk':>9} {'ratio':>7}")
    for n in sizes:
        t, a = median(samples[("touba", n)]), median(samples[("adk", n)])
        print(f"{n:>8} {t:>9.2f} {a:>9.2f} {t / a:>7.2f}")
    first, last = sizes[0], sizes[-1]
    for name in systems:
        growth = median(samples[(name, last)]) / median(samples[(name, first)])
        print(f"growth {first} -> {last} events, {name}: {growth:.2f}x")

    whole: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(max(3, rounds // 6)):
        for name, service in systems.items():
            session = current[(name, last)]

            async def read_all(
                service: BaseSessionService = service, session: Session = session
            ) -> None:
                await service.get_session(
                    app_name=APP, user_id=session.user_id, session_id=session.id
                )

            whole[name].append(await timed(read_all))
    t, a = median(whole["touba"]), median(whole["adk"])
    print(
        f"whole get_session at {last} events: touba {t:.1f} ms, adk {a:.1f} ms, ratio {t / a:.2f}"
    )

    listing: dict[str, list[float]] = {name: [] for name in systems}
    for service in systems.values():
        for i in range(sessions_listed):
            await service.create_session(
                app_name="listed", user_id=f"user-{i % 50}", state={"i": i}
            )
    for _ in range(5):
        for name, service in systems.items():

            async def list_all(service: BaseSessionService = service) -> None:
                listed = await service.list_sessions(app_name="listed")
                assert len(listed.sessions) == sessions_listed

            listing[name].append(await timed(list_all))
    t, a = median(listing["touba"]), median(listing["adk"])
    print(
        f"list_sessions of {sessions_listed} sessions: touba {t:.1f} ms, adk {a:.1f} ms, "
        f"ratio {t / a:.2f}"
    )
    touba = systems["touba"]
    assert isinstance(touba, ToubaSessionService)
    await touba.close()
    await systems["adk"].close()  # type: ignore[attr-defined]


def run(rounds: int, sizes: tuple[int, ...], sessions_listed: int) -> None:
    """Run :func:`main` and remove its files."""
    with tempfile.TemporaryDirectory(prefix="touba-bench-adk-") as directory:
        asyncio.run(main(Path(directory), rounds, sizes, sessions_listed))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="10 rounds, 1,000 events at most")
    args = parser.parse_args()
    if args.quick:
        run(10, (10, 100, 1_000), 1_000)
    else:
        run(args.rounds, SIZES, 5_000)
