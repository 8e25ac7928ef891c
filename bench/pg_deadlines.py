"""The PostgreSQL stores' deadline under a network that goes silent, measured through a proxy.

Each store (history: one decision through ``transact``; memory: a key-event update;
checkpoints: a save) runs through ``tests/_netproxy.py``'s loopback proxy with
``deadline_seconds=D``. Each round: one call on a healthy network, then a black hole
(packets dropped, nothing closed) and a call under it (seconds until its typed
error), then the network back and the next call (seconds until it succeeds: the store
replaces its pool of connections that lived through the outage). History also runs
the silence starting inside the operation (the save and the release it triggers fail
together) and a call its host cancels 0.2 s into the silence (psycopg's own cancel
request would wait 5 to 10 s). Printed: the median and the worst of each, in seconds,
over ``--rounds`` rounds. Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/pg_deadlines.py [--deadline 1.0] [--rounds 5]

Needs the PostgreSQL server of ``TOUBA_POSTGRES_DSN`` (default
postgresql://postgres@127.0.0.1:5432/test); works in a schema of its own, dropped at
the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from psycopg import sql
from tests._netproxy import NetProxy, net_proxy
from tests._services import postgres_address

from touba.errors import ToubaError
from touba.history.postgres import PostgresHistoryStore
from touba.memory import owner_for
from touba.memory.postgres import PostgresMemoryStore
from touba.runtime import PostgresCheckpointStore

DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
OWNER = owner_for("u-1", "s-1")


async def _bump(record: Any) -> tuple[Any, int]:
    n = (record or {}).get("n", 0) + 1
    return {"n": n}, n


async def _timed(call: Awaitable[Any]) -> tuple[float, str]:
    start = time.monotonic()
    try:
        await call
        outcome = "ok"
    except ToubaError as e:
        outcome = type(e).__name__
    except asyncio.CancelledError:
        outcome = "cancelled"
    return time.monotonic() - start, outcome


async def _outage(
    proxy: NetProxy, call: Callable[[], Awaitable[Any]], rows: dict[str, list[float]], name: str
) -> None:
    """A healthy call, one under a black hole, one once the network is back."""
    await call()
    proxy.black_hole()
    took, outcome = await _timed(call())
    rows.setdefault(f"{name}: fails under a black hole ({outcome})", []).append(took)
    proxy.restore()
    took, outcome = await _timed(call())
    rows.setdefault(f"{name}: next call after restore ({outcome})", []).append(took)


async def _history(proxy: NetProxy, dsn: str, table: str, deadline: float, rows: Any) -> None:
    async with PostgresHistoryStore(dsn, table=table, deadline_seconds=deadline) as store:
        key = f"k{uuid.uuid4().hex[:6]}"
        await _outage(proxy, lambda: store.transact(key, _bump), rows, "history decision")

        async def silent(record: Any) -> tuple[Any, int]:
            proxy.black_hole()
            return await _bump(record)

        took, outcome = await _timed(store.transact(key, silent))
        rows.setdefault(f"history: silence in the operation ({outcome})", []).append(took)
        proxy.restore()
        await store.recover(key, worker_stopped=True)  # the reservation it left
        proxy.black_hole()
        start = time.monotonic()
        task = asyncio.create_task(store.transact(key, _bump))
        await asyncio.sleep(0.2)
        task.cancel()
        _, outcome = await _timed(task)
        took = time.monotonic() - start
        rows.setdefault(f"history: cancelled by its host at 0.2 s ({outcome})", []).append(took)
        proxy.restore()
        await store.transact(key, _bump)


async def _memory(proxy: NetProxy, dsn: str, prefix: str, deadline: float, rows: Any) -> None:
    async with PostgresMemoryStore(dsn, prefix=prefix, deadline_seconds=deadline) as store:
        event = await store.create_event(
            owner=OWNER, type="t", title="t0", details="d", session_id="s-1"
        )
        titles = iter(range(10**6))

        def update() -> Awaitable[Any]:
            change = {"title": f"t{next(titles)}"}
            return store.update_event(OWNER, event.id, change, session_id="s-1")

        await _outage(proxy, update, rows, "memory key-event update")


async def _checkpoints(proxy: NetProxy, dsn: str, table: str, deadline: float, rows: Any) -> None:
    async with PostgresCheckpointStore(dsn, table=table, deadline_seconds=deadline) as store:

        def save() -> Awaitable[Any]:
            return store.save(uuid.uuid4().hex, {"step": 1})

        await _outage(proxy, save, rows, "checkpoint save")


async def main(deadline: float, rounds: int) -> None:
    schema = "bdl" + uuid.uuid4().hex[:10]
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    rows: dict[str, list[float]] = {}
    try:
        with net_proxy(*postgres_address(DSN)) as proxy:
            dsn = proxy.dsn(DSN)
            for _ in range(rounds):
                await _history(proxy, dsn, f"{schema}.h", deadline, rows)
                await _memory(proxy, dsn, f"{schema}.m", deadline, rows)
                await _checkpoints(proxy, dsn, f"{schema}.cp", deadline, rows)
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    print(f"deadline_seconds={deadline:g}, {rounds} rounds: median and worst, seconds")
    for name, times in rows.items():
        print(f"  {name:<70} {statistics.median(times):6.2f} {max(times):6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.deadline, args.rounds))
