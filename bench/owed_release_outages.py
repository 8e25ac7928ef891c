"""A live worker's own conversation across PostgreSQL server crashes (issue 29, 7c).

One worker decides in a loop on one conversation while a private PostgreSQL cluster
(``tests/_private_servers.py``: fsync on, a free loopback port) is kill -9ed at seeded
random moments and restarted. Printed: decisions saved, failures with
``DecisionHistoryStoreUnavailable`` (of which how many said the release failed too),
and how many outages left the worker refused ``DecisionHistoryBusy`` on its own
conversation (0: it releases its own reservation at its next decision; before that
change, it stayed busy until ``recover``). The worker's pool waits 1 s for a
connection, so that a call fails soon while the server is down.

    .venv/bin/python bench/owed_release_outages.py [--outages 20] [--seed 7]

Benchmarks are not tests: nothing here asserts anything.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from psycopg_pool import AsyncConnectionPool
from tests._private_servers import ServerUnavailable, running_postgres

from touba.errors import DecisionHistoryBusy, DecisionHistoryStoreUnavailable
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)
from touba.history.postgres import PostgresHistoryStore

WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")


async def run(outages: int, seed: int) -> dict[str, Any]:
    counts = {"saved": 0, "unavailable": 0, "release_failed": 0, "busy": 0}
    busy_outages: set[int] = set()
    with running_postgres() as server:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            server.dsn, min_size=1, max_size=2, timeout=1.0, open=False
        )
        await pool.open(wait=True)
        store = PostgresHistoryStore(pool=pool, table="h")
        history = DecisionHistory(HistoryConfig(store=store, namespace="n"))
        outage = 0
        stop = asyncio.Event()

        async def generate(window: HistoryWindow) -> DecisionMessage:
            return DecisionMessage(text="x", final=True)

        async def work() -> None:
            while not stop.is_set():
                try:
                    await history.step(WHO, [], generate)
                    counts["saved"] += 1
                except DecisionHistoryStoreUnavailable as e:
                    counts["unavailable"] += 1
                    counts["release_failed"] += "could not be released either" in str(e)
                    await asyncio.sleep(0.05)
                except DecisionHistoryBusy:
                    counts["busy"] += 1
                    busy_outages.add(outage)
                    await asyncio.sleep(0.05)

        worker = asyncio.create_task(work())
        rng = random.Random(seed)
        try:
            for outage in range(outages):  # noqa: B007 - read by work()
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                server.kill9()
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                await asyncio.to_thread(server.restart)
            await asyncio.sleep(3)  # the pool reconnects; the worker goes on
        finally:
            stop.set()
            await worker
            await store.close()
            await pool.close()
    return {**counts, "outages": outages, "outages_with_own_key_busy": len(busy_outages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outages", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args()
    try:
        report = asyncio.run(run(options.outages, options.seed))
    except ServerUnavailable as e:
        print(f"skipped: {e}")
        return
    print(
        f"{report['outages']} kill -9 (seed {options.seed}): {report['saved']} decisions "
        f"saved, {report['unavailable']} DecisionHistoryStoreUnavailable "
        f"({report['release_failed']} with the release failed too), {report['busy']} "
        f"DecisionHistoryBusy on the worker's own conversation, after "
        f"{report['outages_with_own_key_busy']} of {report['outages']} outages"
    )


if __name__ == "__main__":
    main()
