"""Many writers at once on PostgreSQL: decisions/s, lock waits and CPU per decision.

For each PostgreSQL store with per-key writes (``history``: conversations,
``memory``: users writing chat turns and key-event updates, ``checkpoints``:
invocations), 1, 2, 4 and 8 worker processes each write their own
conversation (user, invocation) at full speed for ``--seconds``, with the
writers of ``tests/_pg_writers.py`` (the 8 conversations' keys all hash to one
usage shard, the worst case). Meanwhile ``tests/_pg_locks.LockSampler`` reads
``pg_stat_activity`` and ``pg_locks`` every 2 ms on a connection of its own and
records every wait of a writer's backend on a lock and who blocks it.

Printed per store and number of writers:

- decisions/s of all writers together, and the ratio to one writer;
- lock samples taken, samples with two or more writers' statements running at
  once ("busy"), waits seen, and waits of one writer on another ("crossing");
- CPU milliseconds per decision of the client (the worker processes' user +
  system time, ``os.times``, over the timed run) and of the server (the
  workers' PostgreSQL backends, found by their ``application_name``, which is
  what ``pg_backend_pid()`` returns in each: utime + stime from
  ``/proc/<pid>/stat`` before and after); their sum gives the CPU bound of a
  larger machine: ``cores * 1000 / total`` decisions/s, where waits do not
  bound it (0 crossing waits). Background processes (WAL writer, checkpointer)
  are not counted. The server must run on this machine for the server column.

    .venv/bin/python bench/pg_writers.py [--seconds 5] [--writers 1,2,4,8]
        [--stores history,memory,checkpoints] [--quick]

``--quick``: 1 and 8 writers, 1 second each (a smoke run, noisy figures).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from tests._pg_locks import LockSampler, writer_dsn  # noqa: E402
from tests._pg_writers import (  # noqa: E402
    KINDS,
    UNITS,
    drop_schema,
    make_schema,
    names,
    prepare,
    writer,
)

POSTGRES_DSN = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
WARM_UP = 5  # writes per worker before the timed run
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Done:
    decisions: int
    seconds: float
    cpu: float  # client CPU seconds (user + system)


def _work(
    kind: str,
    dsn: str,
    schema: str,
    name: str,
    ready: Queue[Any],
    start: Event,
    stop: Event,
    leave: Event,
) -> None:
    """One worker process: open, warm up, then write from ``start`` until ``stop``."""
    asyncio.run(_work_async(kind, dsn, schema, name, ready, start, stop, leave))


async def _work_async(
    kind: str,
    dsn: str,
    schema: str,
    name: str,
    ready: Queue[Any],
    start: Event,
    stop: Event,
    leave: Event,
) -> None:
    w = writer(kind, dsn, schema, name)
    await w.open()
    try:
        for _ in range(WARM_UP):
            await w.write()
        ready.put("ready")
        await asyncio.to_thread(start.wait)
        before, began, done = os.times(), time.perf_counter(), w.decisions
        while not stop.is_set():
            await w.write()
        after, ended = os.times(), time.perf_counter()
        cpu = (after.user - before.user) + (after.system - before.system)
        ready.put(Done(w.decisions - done, ended - began, cpu))
        await asyncio.to_thread(leave.wait)
    finally:
        await w.close()


def _backend_cpu(dsn: str, run: str) -> dict[int, float]:
    """CPU seconds so far of each backend of the run's writers (``/proc/<pid>/stat``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            row[0]
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
                (f"{run}:%",),
            )
        ]
    seconds = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # not on this machine, or gone
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return seconds


@dataclass(frozen=True)
class Row:
    kind: str
    writers: int
    per_second: float
    samples: int
    busy: int
    waits: int
    crossing: int
    client_ms: float
    server_ms: float | None


def _measure(kind: str, count: int, seconds: float) -> Row:
    dsn = POSTGRES_DSN
    schema = f"touba_pgw_{uuid.uuid4().hex[:10]}"
    run = f"pgw{uuid.uuid4().hex[:8]}"
    make_schema(dsn, schema)
    context = mp.get_context("spawn")
    ready: Queue[Any] = context.Queue()
    start, stop, leave = context.Event(), context.Event(), context.Event()
    workers = []
    try:
        asyncio.run(prepare(kind, dsn, schema))
        for name in names(kind, dsn, count):
            args = (kind, writer_dsn(dsn, run, name), schema, name, ready, start, stop, leave)
            process = context.Process(target=_work, args=args, daemon=True)
            process.start()
            workers.append(process)
        for _ in workers:
            ready.get(timeout=120)
        cpu_before = _backend_cpu(dsn, run)
        with LockSampler(dsn, run) as sampler:
            start.set()
            time.sleep(seconds)
            stop.set()
            done: list[Done] = [ready.get(timeout=60) for _ in workers]
        cpu_after = _backend_cpu(dsn, run)
        leave.set()
        for process in workers:
            process.join(30)
    finally:
        for process in workers:
            if process.is_alive():
                process.kill()
        drop_schema(dsn, schema)
    decisions = sum(d.decisions for d in done)
    server = sum(cpu_after[pid] - cpu_before.get(pid, 0.0) for pid in cpu_after)
    summary = sampler.summary()
    return Row(
        kind=kind,
        writers=count,
        per_second=sum(d.decisions / d.seconds for d in done),
        samples=summary["samples"],
        busy=summary["busy_samples"],
        waits=summary["waits"],
        crossing=summary["crossing"],
        client_ms=1000 * sum(d.cpu for d in done) / decisions,
        server_ms=1000 * server / decisions if cpu_after else None,
    )


def _table(rows: list[Row]) -> list[str]:
    head = (
        f"{'store':<12} {'writers':>7} {'decisions/s':>11} {'vs 1':>5} {'samples':>7} "
        f"{'busy':>5} {'waits':>5} {'crossing':>8} {'client ms':>9} {'server ms':>9} "
        f"{'/s per core':>11}"
    )
    lines = [head, "-" * len(head)]
    base: dict[str, float] = {}
    for r in rows:
        base.setdefault(r.kind, r.per_second)
        server = "-" if r.server_ms is None else f"{r.server_ms:.2f}"
        per_core = "-" if r.server_ms is None else f"{1000 / (r.client_ms + r.server_ms):.0f}"
        lines.append(
            f"{r.kind:<12} {r.writers:>7} {r.per_second:>11.0f} "
            f"{r.per_second / base[r.kind]:>5.2f} {r.samples:>7} {r.busy:>5} {r.waits:>5} "
            f"{r.crossing:>8} {r.client_ms:>9.2f} {server:>9} {per_core:>11}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--writers", default="1,2,4,8")
    parser.add_argument("--stores", default=",".join(KINDS))
    parser.add_argument("--quick", action="store_true", help="1 and 8 writers, 1 s each")
    args = parser.parse_args()
    seconds, counts = args.seconds, [int(n) for n in args.writers.split(",")]
    if args.quick:
        seconds, counts = 1.0, [1, 8]
    print(
        f"PostgreSQL writers at once: {seconds:g} s per run, {os.cpu_count()} cores on this machine"
    )
    rows = []
    for kind in args.stores.split(","):
        for count in counts:
            rows.append(_measure(kind, count, seconds))
            print(f"  {kind} ({UNITS[kind]}s) x {count}: {rows[-1].per_second:.0f}/s", flush=True)
    print()
    print("\n".join(_table(rows)))
    print(
        "\nbusy: samples with 2+ writers' statements running; crossing: waits of one "
        "writer on another;\nclient/server ms: CPU per decision; /s per core: "
        "1000 / (client + server), the CPU bound per core"
    )


if __name__ == "__main__":
    main()
