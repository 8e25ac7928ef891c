"""ToubaSessionService against ADK's own session services, side by side in one run.

The rows of issue 28, each the median of interleaved rounds (every system once per
round, the order rotating):

- ``append_event`` of one ~1 KB event, then ``get_session(config=GetSessionConfig(
  num_recent_events=20))``, on a session already holding N = 10, 100, 1,000 and 5,000
  events of ~1 KB (what a ``Runner`` does at each step once it reads a bounded
  session); the growth from 10 to 5,000 events;
- a whole-session ``get_session`` (no config) at 5,000 events, again and again by the
  same service object ("again"), and first by a new service object on the same
  storage, its store already opened ("first"); ``touba/sqlite shared`` is
  ``share_events=True`` (opt-in: "again" reuses the events an earlier read decoded);
- ``list_sessions`` of one user holding 5,000 sessions (one event each).

Systems: ``ToubaSessionService.sqlite`` (also with ``share_events=True``; and
``.postgres`` / ``.redis`` when their server answers and their backend is present),
ADK 2.13's ``SqliteSessionService`` (aiosqlite, its own defaults) and
``DatabaseSessionService`` on ``sqlite+aiosqlite``. Ratios are touba's time over
ADK's ``SqliteSessionService`` (``/sqlite``) and over ``DatabaseSessionService``
(``/database``): below 1, touba is faster. Everything is seeded through each
service's public API. Each timed call starts after a full garbage collection
(untimed): the rotation always runs the same system after the same other one, and a
collection triggered by the garbage of the one before (``DatabaseSessionService``
makes the most) would land in the next one's time; the collections a call's own
objects trigger stay in its time. Benchmarks are not tests: nothing here asserts a
time.

    .venv/bin/python bench/adk_sessions.py [--quick] [--sizes 10,100,1000,5000]
        [--rounds 30] [--sessions 5000] [--stores sqlite,postgres,redis]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from google.adk.events import Event
from google.adk.sessions import BaseSessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.sessions.database_session_service import DatabaseSessionService
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.genai import types

from bench.peers import DSN, REDIS_URL, available_stores
from touba.integrations.adk import ToubaSessionService

SIZES = (10, 100, 1_000, 5_000)
RECENT = 20
EVENT_TEXT = 1000  # characters of text per event: ~1 KB of event JSON with its envelope
APP = "bench"
USER = "ann"
THEIRS = ("SqliteSessionService", "DatabaseSessionService")


def event(n: int) -> Event:
    text = f"event {n} " + "x" * (EVENT_TEXT - 12)
    return Event(
        author="user",
        invocation_id=f"inv-{n}",
        content=types.Content(role="user", parts=[types.Part(text=text)]),
    )


@dataclass
class System:
    """One session service, with its sessions by size and its timings by row."""

    name: str
    service: BaseSessionService
    close: Callable[[], Awaitable[None]]
    reopen: Callable[[], Any]  # a new service object on the same storage (its close() async)
    sessions: dict[int, Session] = field(default_factory=dict)
    timings: dict[str, list[float]] = field(default_factory=dict)

    def time(self, row: str, seconds: float) -> None:
        self.timings.setdefault(row, []).append(seconds)

    async def seed(self, sizes: Sequence[int]) -> None:
        for size in sizes:
            session = await self.service.create_session(
                app_name=APP, user_id=USER, session_id=f"s{size}"
            )
            for n in range(size):
                await self.service.append_event(session, event(n))
            self.sessions[size] = await self._recent(size)

    async def _recent(self, size: int) -> Session:
        session = await self.service.get_session(
            app_name=APP,
            user_id=USER,
            session_id=f"s{size}",
            config=GetSessionConfig(num_recent_events=RECENT),
        )
        assert session is not None
        return session

    async def step(self, size: int, n: int) -> None:
        """append_event + get_session(num_recent_events=20), timed together."""
        started = time.perf_counter()
        await self.service.append_event(self.sessions[size], event(10_000_000 + n))
        session = await self._recent(size)
        self.time(f"step {size}", time.perf_counter() - started)
        if not min(RECENT, size + 1) <= len(session.events) <= RECENT:
            raise SystemExit(f"{self.name}: {len(session.events)} recent events at N={size}")
        self.sessions[size] = session

    async def whole(self, size: int) -> None:
        started = time.perf_counter()
        session = await self.service.get_session(app_name=APP, user_id=USER, session_id=f"s{size}")
        self.time("whole", time.perf_counter() - started)
        assert session is not None
        if len(session.events) < size:
            raise SystemExit(f"{self.name}: the whole session has {len(session.events)} events")

    async def first_whole(self, size: int) -> None:
        """A whole-session read by a service object that has read nothing yet (no cache)."""
        fresh = self.reopen()
        try:  # open the store first: the timed read is the read, not the connection
            await fresh.get_session(
                app_name=APP,
                user_id=USER,
                session_id=f"s{size}",
                config=GetSessionConfig(num_recent_events=1),
            )
            started = time.perf_counter()
            session = await fresh.get_session(app_name=APP, user_id=USER, session_id=f"s{size}")
            self.time("first", time.perf_counter() - started)
            assert session is not None
        finally:
            await fresh.close()

    async def seed_users_sessions(self, count: int) -> None:
        user = "lister"
        for k in range(count):
            session = await self.service.create_session(
                app_name=APP, user_id=user, session_id=f"l{k}"
            )
            await self.service.append_event(session, event(k))

    async def listing(self, count: int) -> None:
        started = time.perf_counter()
        answer = await self.service.list_sessions(app_name=APP, user_id="lister")
        self.time("list", time.perf_counter() - started)
        if len(answer.sessions) != count:
            raise SystemExit(f"{self.name}: list_sessions gave {len(answer.sessions)} sessions")


@contextlib.asynccontextmanager
async def systems(kinds: Sequence[str], directory: Path) -> AsyncIterator[list[System]]:
    run = uuid.uuid4().hex[:8]
    opened: list[System] = []
    cleanups: list[Callable[[], Awaitable[None]]] = []
    try:
        for kind in kinds:
            made = await _touba(kind, run, directory, cleanups)
            if made is not None:
                opened.append(made)
        if "sqlite" in kinds:
            shared_path = directory / "touba-shared.sqlite"
            shared = ToubaSessionService.sqlite(shared_path, share_events=True)
            opened.append(
                System(
                    "touba/sqlite shared",
                    shared,
                    shared.close,
                    lambda: ToubaSessionService.sqlite(shared_path, share_events=True),
                )
            )
        path = str(directory / "adk-sqlite.db")
        sqlite = SqliteSessionService(path)
        opened.append(System(THEIRS[0], sqlite, sqlite.close, lambda: SqliteSessionService(path)))
        url = f"sqlite+aiosqlite:///{directory / 'adk-database.db'}"
        database = DatabaseSessionService(url)
        opened.append(
            System(THEIRS[1], database, database.close, lambda: DatabaseSessionService(url))
        )
        yield opened
    finally:
        for system in opened:
            await system.close()
        for cleanup in cleanups:
            await cleanup()


async def _touba(
    kind: str, run: str, directory: Path, cleanups: list[Callable[[], Awaitable[None]]]
) -> System | None:
    name = f"touba/{kind}"
    if kind == "sqlite":
        path = directory / "touba.sqlite"
        service = ToubaSessionService.sqlite(path)
        return System(name, service, service.close, lambda: ToubaSessionService.sqlite(path))
    module = f"touba.integrations.adk._{kind}"
    if importlib.util.find_spec(module) is None:
        print(f"({name} skipped: {module} is not in this checkout)")
        return None
    if kind == "postgres":
        import psycopg
        from psycopg import sql

        schema = f"bench_adk_{run}"
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))

        async def drop() -> None:
            async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
                await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

        cleanups.append(drop)
        table_prefix = f"{schema}.adk"
        service = ToubaSessionService.postgres(DSN, table_prefix=table_prefix)
        return System(
            name,
            service,
            service.close,
            lambda: ToubaSessionService.postgres(DSN, table_prefix=table_prefix),
        )
    assert kind == "redis"
    import redis.asyncio

    prefix = f"touba-bench-adk:{run}:"

    async def delete() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        keys = [key async for key in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    cleanups.append(delete)
    service = ToubaSessionService.redis(REDIS_URL, prefix=prefix)
    return System(
        name, service, service.close, lambda: ToubaSessionService.redis(REDIS_URL, prefix=prefix)
    )


async def _step(size: int, offset: int, system: System, r: int) -> None:
    await system.step(size, offset + r)


async def interleaved(
    systems: list[System], rounds: int, action: Callable[[System, int], Awaitable[None]]
) -> None:
    for r in range(rounds):
        shift = r % len(systems)
        for system in systems[shift:] + systems[:shift]:
            gc.collect()  # untimed: no system pays for the garbage of the one before it
            await action(system, r)


def median_ms(system: System, row: str) -> float:
    return statistics.median(system.timings[row]) * 1e3


def table(title: str, rows: Sequence[tuple[str, str]], systems: list[System]) -> None:
    print(f"\n{title}")
    ours = [s for s in systems if s.name.startswith("touba/")]
    theirs = [s for s in systems if s.name in THEIRS]
    names = [s.name for s in systems]
    names += [f"{o.name} /{t}" for o in ours for t in ("sqlite", "database")]
    widths = [max(len(n) + 2, 10) for n in names]
    header = f"{'':>12}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    print(header)
    print("-" * len(header))
    for label, row in rows:
        cells = [f"{median_ms(s, row):.2f}" for s in systems]
        for o in ours:
            mine = median_ms(o, row)
            cells += [f"{mine / median_ms(t, row):.2f}" for t in theirs]
        print(f"{label:>12}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))


async def main_async(args: argparse.Namespace) -> None:
    kinds = [k for k in available_stores(args.stores) if k != "memory"]
    print(
        f"ToubaSessionService vs google-adk 2.13's session services, ~1 KB events, "
        f"median of {args.rounds} interleaved rounds (ms)"
    )
    with tempfile.TemporaryDirectory(prefix="touba-bench-adk-") as tmp:
        directory = Path(tmp)  # mkdtemp makes it 0700, as touba's SQLite files require
        async with systems(kinds, directory) as opened:
            for system in opened:
                started = time.perf_counter()
                await system.seed(args.sizes)
                print(f"  seeded {system.name} in {time.perf_counter() - started:.1f} s")
            for size in args.sizes:  # warm up
                await interleaved(opened, 3, functools.partial(_step, size, -1000))
            for system in opened:
                system.timings.clear()
            for size in args.sizes:
                await interleaved(opened, args.rounds, functools.partial(_step, size, 0))
            rows = [(f"{size:,}", f"step {size}") for size in args.sizes]
            table(
                f"append_event + get_session(num_recent_events={RECENT}) on a session of N events",
                rows,
                opened,
            )
            low, high = min(args.sizes), max(args.sizes)
            growth = "  ".join(
                f"{s.name} {median_ms(s, f'step {high}') / median_ms(s, f'step {low}'):.2f}x"
                for s in opened
            )
            print(f"growth {low:,} -> {high:,} events: {growth}")
            await interleaved(opened, max(3, args.rounds // 3), lambda s, r: s.whole(high))
            await interleaved(opened, max(3, args.rounds // 3), lambda s, r: s.first_whole(high))
            table(
                f"whole-session get_session at {high:,} events (again; first by a new object)",
                [("again", "whole"), ("first", "first")],
                opened,
            )
            for system in opened:
                started = time.perf_counter()
                await system.seed_users_sessions(args.sessions)
                print(
                    f"  seeded {args.sessions:,} sessions in {system.name} in "
                    f"{time.perf_counter() - started:.1f} s"
                )
            await interleaved(
                opened, max(3, args.rounds // 3), lambda s, r: s.listing(args.sessions)
            )
            table(
                f"list_sessions of one user's {args.sessions:,} sessions",
                [(f"{args.sessions:,}", "list")],
                opened,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, sizes and sessions")
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--sizes", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None)
    args = parser.parse_args()
    default_sizes = (10, 100, 1_000) if args.quick else SIZES
    args.sizes = [int(s) for s in (args.sizes or ",".join(map(str, default_sizes))).split(",")]
    args.rounds = args.rounds or (8 if args.quick else 30)
    args.sessions = args.sessions or (500 if args.quick else 5_000)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
