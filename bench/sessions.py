"""ToubaSession against openai-agents' own sessions, operation by operation.

An openai-agents program can keep its ``Runner`` and swap its session for
touba's :class:`~touba.integrations.openai_agents.ToubaSession`. This measures
what that costs per session operation, store by store, against the SDK's
session for the same store (``SQLiteSession(":memory:")`` beside touba's RAM
store, ``SQLiteSession`` on a file, ``SQLAlchemySession`` on PostgreSQL through
asyncpg, ``RedisSession``), with the stores and settings of ``bench/peers.py``
(SQLite WAL with ``synchronous=FULL`` for both, the same PostgreSQL and Redis
servers).

Sessions holding N = 100, 1,000 and 10,000 items (1 KiB Responses items, a
function call then its output, as ``bench/peers.py`` builds them) run, in
interleaved rounds (every system and size once per round, the order
rotating): ``add_items`` of one item, ``get_items(limit=128)``, then
``pop_item`` of that item, so N stays what the row says. Printed: the median
of each operation in ms, touba's then the peer's, and their ratio.
``ToubaSession`` does more in each (one reservation per operation, a
concurrent one refused instead of interleaved; calls and outputs kept
together, never half an exchange handed back; the bounds); the SDK's sessions
take no reservation. Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/sessions.py [--quick] [--stores memory,sqlite,postgres,redis]
        [--sizes 100,1000,10000] [--rounds 40]

Needs the ``bench`` extra: ``pip install -e ".[all,dev,bench]"``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import (
    NAMESPACE,
    STORES,
    WINDOW,
    Backend,
    _settings,
    agents_call,
    agents_output,
    available_stores,
    backend,
)
from touba.history._common import MiB
from touba.integrations.openai_agents import ToubaSession

SIZES = (100, 1_000, 10_000)
OPERATIONS = ("add_items(1)", f"get_items({WINDOW})", "pop_item")
SEED_BATCH = 500


@dataclass
class Side:
    """One session (touba's or the peer's) at one size, with its timings per operation."""

    system: str
    size: int
    session: Any
    timings: dict[str, list[float]] = field(default_factory=lambda: {o: [] for o in OPERATIONS})

    async def seed(self) -> None:
        await self.session.clear_session()
        items: list[dict[str, Any]] = []
        for n in range((self.size + 1) // 2):
            items += [agents_call(n), agents_output(n)]
        items = items[: self.size]
        for start in range(0, len(items), SEED_BATCH):
            await self.session.add_items(items[start : start + SEED_BATCH])

    async def round(self, n: int) -> None:
        item = agents_call(1_000_000 + n)
        steps: Sequence[tuple[str, Callable[[], Awaitable[Any]]]] = (
            (OPERATIONS[0], lambda: self.session.add_items([item])),
            (OPERATIONS[1], lambda: self.session.get_items(limit=WINDOW)),
            (OPERATIONS[2], self.session.pop_item),
        )
        for name, step in steps:
            started = time.perf_counter()
            result = await step()
            self.timings[name].append(time.perf_counter() - started)
            if name == OPERATIONS[2] and result != item:
                raise SystemExit(f"{self.system}: pop_item gave back another item than the last")


async def _sides(b: Backend, sizes: Sequence[int]) -> list[Side]:
    store = await b.touba_store()
    b._closers.append(store.close)
    sides = []
    for size in sizes:
        name = f"{b.run}-{size}"
        touba = ToubaSession(name, store=store, namespace=NAMESPACE, max_retained_bytes=4096 * MiB)
        sides.append(Side("touba", size, touba))
        peer = await b.peer(name, size)
        if peer is not None:
            sides.append(Side("peer", size, peer.session))
    for side in sides:
        await side.seed()
    return sides


async def run_store(kind: str, args: argparse.Namespace, report: Callable[[str], None]) -> None:
    async with backend(kind, uuid.uuid4().hex[:8]) as b:
        sides = await _sides(b, args.sizes)
        for n in range(3):  # warm up
            for side in sides:
                await side.round(n)
        for side in sides:
            side.timings = {o: [] for o in OPERATIONS}
        for r in range(args.rounds):
            shift = r % len(sides)
            for side in sides[shift:] + sides[:shift]:
                await side.round(r)
        _report(kind, b.peer_name, sides, report)


def _report(kind: str, peer: str, sides: list[Side], report: Callable[[str], None]) -> None:
    report(f"\n{kind}: median ms per operation, ToubaSession / {peer} (ratio)")
    header = f"{'N':>8}" + "".join(f"{o:>24}" for o in OPERATIONS)
    report(header)
    report("-" * len(header))
    by = {(s.system, s.size): s for s in sides}
    for size in sorted({s.size for s in sides}):
        line = f"{size:>8,}"
        for operation in OPERATIONS:
            touba = statistics.median(by["touba", size].timings[operation])
            other = by.get(("peer", size))
            if other is None:
                line += f"{touba * 1e3:>24.2f}"
                continue
            theirs = statistics.median(other.timings[operation])
            cell = f"{touba * 1e3:.2f} / {theirs * 1e3:.2f} ({touba / theirs:.2f})"
            line += f"{cell:>24}"
        report(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.rounds = args.rounds or (10 if args.quick else 40)
    available = available_stores(args.stores)

    async def run() -> None:
        print(
            f"ToubaSession vs openai-agents 0.24's sessions, 1 KiB items, {args.rounds} "
            "interleaved rounds; SQLite WAL + synchronous=FULL for both"
        )
        await _settings(print, available)
        for kind in available:
            await run_store(kind, args, print)

    asyncio.run(run())


if __name__ == "__main__":
    main()
