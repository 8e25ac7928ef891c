"""Soak: resident memory and open file descriptors under a steady chat workload, per store.

For each history store (RAM, SQLite, PostgreSQL, Redis), a process of its own
runs ``--workers`` chat workers (bench/_chat.py: ``ChatSession`` turns of two
decisions each, a new session every 10 turns) for ``--minutes``, with
``--pause`` seconds between a worker's turns (a steady load that leaves the
machine's other work its share). The chat memory is a SQLite memory store,
a PostgreSQL one beside the PostgreSQL history store. Every ``--every``
seconds the process samples its own resident memory (``VmRSS`` of
``/proc/self/status``) and its open descriptors (``/proc/self/fd``).

Printed per store: decisions made and failed turns; the values at the end of
the warm-up (the first fifth of the run, at least 10 s), at the end, and the
growth between them (target: at most 5 %), plus the largest RSS seen.

    .venv/bin/python bench/soak.py [--minutes 1] [--stores memory,sqlite,postgres,redis]
    nice .venv/bin/python bench/soak.py --minutes 30 --stores postgres   # the 30-minute soak

PostgreSQL and Redis: ``TOUBA_POSTGRES_DSN`` / ``TOUBA_REDIS_URL`` (the
machine's defaults otherwise); the bench's tables and keys carry a random
prefix and are dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._chat import chat_runtime, chat_worker, drop_redis_keys, drop_tables  # noqa: E402
from touba.history import HistoryStore, MemoryHistoryStore  # noqa: E402
from touba.memory import SqliteMemoryStore  # noqa: E402
from touba.memory._store import MemoryStore  # noqa: E402

STORES = ("memory", "sqlite", "postgres", "redis")
TARGET_GROWTH = 0.05


@dataclass
class Sample:
    """One sample: seconds since the start, resident KiB, open descriptors, decisions."""

    at: float
    rss_kib: int
    fds: int
    decisions: int


@dataclass
class SoakReport:
    """One store's soak: its samples and what the workers did."""

    store: str
    seconds: float = 0.0
    decisions: int = 0
    failures: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


def rss_kib() -> int:
    """This process's resident memory, KiB (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def warm_index(samples: list[Sample], seconds: float) -> int:
    """The first sample at or after the warm-up: a fifth of the run, at least 10 s."""
    warm = max(seconds / 5, 10.0)
    for index, sample in enumerate(samples):
        if sample.at >= warm:
            return index
    return len(samples) - 1


def growth(start: float, end: float) -> float:
    return (end - start) / start if start else 0.0


@contextlib.asynccontextmanager
async def stores(kind: str, directory: Path) -> AsyncIterator[tuple[HistoryStore, MemoryStore]]:
    """The history store of ``kind`` and a memory store beside it; removed at the end."""
    tag = uuid.uuid4().hex[:8]
    if kind == "postgres":
        from touba.history.postgres import PostgresHistoryStore
        from touba.memory import PostgresMemoryStore

        dsn = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
        prefix = f"soak_{tag}"
        try:
            async with (
                PostgresHistoryStore(dsn, table=f"{prefix}_h") as history,
                PostgresMemoryStore(dsn, prefix=f"{prefix}_m") as pg_memory,
            ):
                yield history, pg_memory
        finally:
            await drop_tables(dsn, prefix)
        return
    async with SqliteMemoryStore(directory / f"memory-{kind}.sqlite") as memory:
        if kind == "memory":
            yield MemoryHistoryStore(), memory
        elif kind == "sqlite":
            from touba.history.sqlite import SqliteHistoryStore

            async with SqliteHistoryStore(directory / "history.sqlite") as store:
                yield store, memory
        elif kind == "redis":
            from touba.history.redis import RedisHistoryStore

            url = os.environ.get("TOUBA_REDIS_URL", "redis://127.0.0.1:6379/0")
            prefix = f"soak-{tag}:"
            try:
                async with RedisHistoryStore(url, prefix=prefix) as redis_store:
                    yield redis_store, memory
            finally:
                await drop_redis_keys(url, prefix)
        else:
            raise SystemExit(f"unknown store {kind!r}: one of {', '.join(STORES)}")


async def soak(
    kind: str, *, seconds: float, workers: int, pause: float, every: float
) -> SoakReport:
    """Run the workload on ``kind`` for ``seconds``, sampling every ``every`` seconds."""
    report = SoakReport(kind)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "state"
        directory.mkdir(mode=0o700)
        async with stores(kind, directory) as (history, memory):
            runtime, model = chat_runtime(history)
            stop = asyncio.Event()
            began = time.perf_counter()

            async def sampler() -> None:
                while not stop.is_set():
                    report.samples.append(
                        Sample(
                            time.perf_counter() - began,
                            rss_kib(),
                            open_fds(),
                            model.counts.decisions,
                        )
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), every)

            async def timer() -> None:
                await asyncio.sleep(seconds)
                stop.set()

            async with asyncio.TaskGroup() as group:
                group.create_task(sampler())
                group.create_task(timer())
                for number in range(workers):
                    group.create_task(
                        chat_worker(runtime, model, memory, f"soak-{number}", stop, pause=pause)
                    )
            report.samples.append(
                Sample(time.perf_counter() - began, rss_kib(), open_fds(), model.counts.decisions)
            )
            report.seconds = time.perf_counter() - began
            report.decisions = model.counts.decisions
            report.failures = model.counts.failures[:20]
    return report


def summary(report: SoakReport) -> dict[str, Any]:
    samples = report.samples
    warm = samples[warm_index(samples, report.seconds)]
    end = samples[-1]
    return {
        "store": report.store,
        "minutes": report.seconds / 60,
        "decisions": report.decisions,
        "decisions/s": report.decisions / report.seconds if report.seconds else 0.0,
        "failures": len(report.failures),
        "rss warm MiB": warm.rss_kib / 1024,
        "rss end MiB": end.rss_kib / 1024,
        "rss max MiB": max(s.rss_kib for s in samples) / 1024,
        "rss growth": growth(warm.rss_kib, end.rss_kib),
        "fds warm": warm.fds,
        "fds end": end.fds,
        "fds growth": growth(warm.fds, end.fds),
    }


def _child(kind: str, options: argparse.Namespace) -> None:
    report = asyncio.run(
        soak(
            kind,
            seconds=options.minutes * 60,
            workers=options.workers,
            pause=options.pause,
            every=options.every,
        )
    )
    print(json.dumps({"summary": summary(report), "samples": [asdict(s) for s in report.samples]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between turns")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--samples", type=Path, help="write every sample here (JSON lines)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        _child(options.child, options)
        return
    print(
        f"soak: {options.workers} chat workers per store, {options.minutes:g} min each, "
        f"{options.pause:g} s between a worker's turns; growth after warm-up "
        f"(target <= {TARGET_GROWTH:.0%})"
    )
    print(
        f"{'store':<9} {'min':>5} {'dec/s':>6} {'failed':>6} {'RSS warm':>9} {'RSS end':>8} "
        f"{'RSS max':>8} {'growth':>7} {'fds warm':>8} {'fds end':>7} {'growth':>7}"
    )
    for kind in options.stores.split(","):
        # A process per store: one store's allocations do not blur another's figures.
        argv = [sys.executable, __file__, "--child", kind]
        for name in ("minutes", "workers", "pause", "every"):
            argv += [f"--{name}", str(getattr(options, name))]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{kind:<9} failed: {done.stderr.strip()[-2000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        row = result["summary"]
        if options.samples is not None:
            with options.samples.open("a") as out:
                for sample in result["samples"]:
                    out.write(json.dumps({"store": kind, **sample}) + "\n")
        print(
            f"{kind:<9} {row['minutes']:>5.1f} {row['decisions/s']:>6.0f} {row['failures']:>6} "
            f"{row['rss warm MiB']:>7.1f}Mi {row['rss end MiB']:>6.1f}Mi "
            f"{row['rss max MiB']:>6.1f}Mi {row['rss growth']:>+7.1%} {row['fds warm']:>8} "
            f"{row['fds end']:>7} {row['fds growth']:>+7.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
