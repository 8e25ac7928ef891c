"""Retention on the SQLite memory store: what an application costs as history grows.

``touba.data.Retention`` is applied every hour by the worker. What it reads must not
grow with what is kept: memory schema 4 indexes what each purge reads (turns by
creation, turns that still hold a trace or a context, ended sessions, closed events).
Printed, for stores holding N = 1,000, 10,000 and 100,000 turns (1 KiB each, spread
over sessions of 20 turns):

- ``no-op``: an application when nothing is due (every bound set, nothing old enough;
  half the turns older than ``traces_days`` but already stripped), median ms, and its
  ratio to N = 1,000's (flat: it reads only what goes);
- ``purge``: turns deleted per second when all N are older than ``turns_days`` (batches
  of 500, each its own transaction);
- ``append``: the median ``append_turn`` with the retention indexes against the same
  file without them (the price every turn pays for them), as a ratio.

    .venv/bin/python bench/retention.py [--quick] [--rounds 15]

Benchmarks are not tests: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from touba.memory.sqlite import _RETENTION_INDEXES, SqliteMemoryStore

SIZES = (1_000, 10_000, 100_000)
PER_SESSION = 20
TEXT = "x" * 1024
NOW = datetime(2026, 6, 1, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TRACE = '[[{"call_id":"c","name":"n","arguments":{},"status":"ok","result":1,"error":null}]]'


def _us(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def _fill(path: Path, turns: int, *, age_days: float, stripped_half: bool) -> None:
    """``turns`` turns ``age_days`` old (plus a minute per session), written directly;
    with ``stripped_half``, every other session's turns have no trace left and the
    others are one day old."""

    async def make() -> None:
        async with SqliteMemoryStore(path, clock=lambda: NOW):
            pass

    asyncio.run(make())
    base = NOW - timedelta(days=age_days)
    with sqlite3.connect(path) as conn:
        sessions: list[tuple[object, ...]] = []
        rows: list[tuple[object, ...]] = []
        for s in range(turns // PER_SESSION):
            stripped = stripped_half and s % 2 == 0
            young = stripped_half and not stripped  # one day old, its trace kept
            at = _us((NOW - timedelta(days=1) if young else base) + timedelta(minutes=s))
            sessions.append((f"s{s}", "user:u", "a", "live", at, None, PER_SESSION))
            trace, context = ("[]", None) if stripped else (TRACE, '{"prompt_bytes":10}')
            rows.extend(
                (f"s{s}", i, f'"{TEXT}"', '["r"]', trace, None, at, context)
                for i in range(PER_SESSION)
            )
        conn.executemany("INSERT INTO touba_memory_sessions VALUES (?, ?, ?, ?, ?, ?, ?)", sessions)
        conn.executemany(
            "INSERT INTO touba_memory_turns (session_id, idx, user_text, replies, trace,"
            " invocation_id, created_at, context) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )


async def _noop(paths: dict[int, Path], rounds: int) -> dict[int, float]:
    """Median ms, per size, of an application that finds nothing (turns 10 days old or
    younger, bounds of 30 days for turns and events, 5 days for traces: those older are
    stripped already), the sizes interleaved round after round."""
    times: dict[int, list[float]] = {n: [] for n in paths}
    async with contextlib.AsyncExitStack() as stack:
        stores = {
            n: await stack.enter_async_context(SqliteMemoryStore(path, clock=lambda: NOW))
            for n, path in paths.items()
        }
        for round_ in range(rounds):
            order = list(stores)[round_ % len(stores) :] + list(stores)[: round_ % len(stores)]
            for n in order:
                start = time.perf_counter()
                counts = await stores[n].purge_before(
                    turns=NOW - timedelta(days=30),
                    events_closed=NOW - timedelta(days=30),
                    traces=NOW - timedelta(days=5),
                )
                times[n].append(time.perf_counter() - start)
                assert not any(counts.values()), counts
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


async def _purge(path: Path) -> float:
    async with SqliteMemoryStore(path, clock=lambda: NOW) as store:
        start = time.perf_counter()
        counts = await store.purge_before(turns=NOW - timedelta(days=30))
        elapsed = time.perf_counter() - start
    return counts["turns"] / elapsed


async def _append_pair(with_path: Path, without_path: Path, rounds: int) -> tuple[float, float]:
    """Median ms of ``append_turn`` on a file with the retention indexes and on its twin
    whose indexes are dropped (after opening: opening makes them), interleaved."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    async with (
        SqliteMemoryStore(with_path, clock=lambda: NOW) as indexed,
        SqliteMemoryStore(without_path, clock=lambda: NOW) as bare,
    ):

        async def drop() -> None:
            for statement in _RETENTION_INDEXES:
                bare._conn.execute("DROP INDEX " + statement.split()[5])

        await asyncio.wrap_future(bare._submit(drop()))
        stores = {"with": indexed, "without": bare}
        for store in stores.values():
            await store.open_session("bench", owner="user:u", agent_ref="a", mode="live")
        for i in range(rounds):
            for name in ("with", "without") if i % 2 else ("without", "with"):
                start = time.perf_counter()
                await stores[name].append_turn("bench", user=f"{TEXT}{i}", replies=["r"])
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["with"]) * 1000, statistics.median(times["without"]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 and 10,000 turns only")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        kept = {n: Path(tmp) / f"kept-{n}.db" for n in sizes}
        for n, path in kept.items():
            _fill(path, n, age_days=10, stripped_half=True)
        noop = asyncio.run(_noop(kept, args.rounds))
        print(f"{'turns':>8} {'no-op ms':>9} {'ratio':>6} {'purge turns/s':>14}")
        for n in sizes:
            old = Path(tmp) / f"old-{n}.db"
            _fill(old, n, age_days=60, stripped_half=False)
            rate = asyncio.run(_purge(old))
            ratio = noop[n] / noop[sizes[0]]
            print(f"{n:>8} {noop[n]:>9.3f} {ratio:>6.2f} {rate:>14,.0f}")
        with_indexes, without = Path(tmp) / "append.db", Path(tmp) / "append-bare.db"
        for path in (with_indexes, without):
            _fill(path, sizes[-1], age_days=10, stripped_half=True)
        indexed, bare = asyncio.run(_append_pair(with_indexes, without, args.rounds * 10))
        print(
            f"append_turn with the retention indexes: {indexed:.3f} ms, without: "
            f"{bare:.3f} ms, ratio {indexed / bare:.2f}"
        )


if __name__ == "__main__":
    main()
