"""Per-decision cost of encryption at rest: encrypted SQLite against unencrypted.

Two SQLite history stores, one with ``encryption=touba.Encryption(...)`` (AES-GCM,
every head and message sealed) and one without, each holding conversations of 10
and 1,000 retained exchanges, run decisions side by side in interleaved rounds,
in one process, through the real history step (reservation, window, commit; the
model a function returning a fixed decision). The issue's bar: a decision on
encrypted SQLite costs at most 1.15x the unencrypted one.

Printed: median microseconds per decision on each store, their ratio, and the
median of each round's ratio (the two decisions of a round run back to back, so
a load that comes and goes sways it less).

    .venv/bin/python bench/encryption_cost.py [--rounds 300] [--stores sqlite,postgres,redis]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.history_cost import POSTGRES_DSN, REDIS_URL, _Conversation, _drop_tables, _seed
from touba import Encryption
from touba.history import ConversationIdentity, DecisionHistory, HistoryConfig
from touba.history._common import MiB

SIZES = (10, 1_000)
NAMESPACE = "bench-encryption"


@asynccontextmanager
async def _store(kind: str, directory: Path, name: str, encryption: Any) -> AsyncIterator[Any]:
    limits: dict[str, Any] = {"max_sessions": 16, "max_store_bytes": 512 * MiB}
    if kind == "sqlite":
        from touba.history.sqlite import SqliteHistoryStore

        path = directory / f"{name}.sqlite"
        async with SqliteHistoryStore(path, encryption=encryption, **limits) as sqlite_store:
            yield sqlite_store
    elif kind == "postgres":
        from touba.history.postgres import PostgresHistoryStore

        table = f"bench_{name}_{uuid.uuid4().hex[:8]}"
        pg = PostgresHistoryStore(POSTGRES_DSN, table=table, encryption=encryption, **limits)
        async with pg:
            try:
                yield pg
            finally:
                await _drop_tables(pg, table)
    elif kind == "redis":
        from touba.history.redis import RedisHistoryStore

        prefix = f"bench-{name}-{uuid.uuid4().hex[:8]}:"
        async with RedisHistoryStore(
            REDIS_URL, prefix=prefix, encryption=encryption, **limits
        ) as redis_store:
            yield redis_store
    else:
        raise SystemExit(f"unknown store {kind!r}")


def _identity(name: str, size: int) -> ConversationIdentity:
    return ConversationIdentity(NAMESPACE, "bench", "m", "native", "run", f"{name}-{size}", "a")


async def _run(kind: str, rounds: int) -> None:
    encryption = Encryption(keys={"k1": os.urandom(32)}, current="k1")
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            _store(kind, Path(tmp), "plain", None) as plain,
            _store(kind, Path(tmp), "sealed", encryption) as sealed,
        ):
            drivers: dict[tuple[str, int], _Conversation] = {}
            for name, store in (("plain", plain), ("sealed", sealed)):
                config = HistoryConfig(
                    store=store, namespace=NAMESPACE, max_messages=16, max_retained_bytes=256 * MiB
                )
                history = DecisionHistory(config)
                for size in SIZES:
                    await _seed(store, _identity(name, size), size)
                    drivers[name, size] = _Conversation(history, _identity(name, size))
            for driver in drivers.values():  # warm up
                for _ in range(5):
                    await driver.decide()
            timings: dict[tuple[str, int], list[float]] = {key: [] for key in drivers}
            for _ in range(rounds):
                for key, driver in drivers.items():
                    timings[key].append(await driver.decide())
    print(f"\n{kind} store, {rounds} decisions per conversation (window of 16 messages)")
    print(
        f"{'retained exchanges':>20} {'plain µs':>10} {'encrypted µs':>13} {'ratio':>7}"
        f" {'paired ratio':>13}"
    )
    for size in SIZES:
        plain, sealed = timings["plain", size], timings["sealed", size]
        plain_median, sealed_median = statistics.median(plain), statistics.median(sealed)
        ratio = sealed_median / plain_median
        # each round's two decisions ran back to back: their ratio, less swayed by load
        paired = statistics.median(s / p for s, p in zip(sealed, plain, strict=True))
        print(
            f"{size:>20,} {plain_median * 1e6:>10.0f} {sealed_median * 1e6:>13.0f} {ratio:>7.2f}"
            f" {paired:>13.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--stores", default="sqlite")
    args = parser.parse_args()
    for kind in args.stores.split(","):
        asyncio.run(_run(kind, args.rounds))


if __name__ == "__main__":
    main()
