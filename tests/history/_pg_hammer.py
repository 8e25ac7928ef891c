"""One worker process deciding on one PostgreSQL conversation as fast as it can.

``python -m tests.history._pg_hammer DSN TABLE ATTEMPTS`` makes ``ATTEMPTS``
decisions on the conversation of ``WHO`` with a store of its own (a worker),
each a final decision whose text names the worker and the attempt, and prints
one JSON line: how many were saved, refused busy (then it retries after a
short random pause, as a worker would), refused as damaged, or failed
otherwise (their error types). Run by ``test_postgres_contention.py``, several
at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections import Counter

from touba.errors import DecisionHistoryBusy, DecisionHistoryRecordInvalid
from touba.history import (
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)
from touba.history.postgres import PostgresHistoryStore

WHO = ConversationIdentity("n", "openai", "m", "native", "r", "i", "agent")


async def main(dsn: str, table: str, attempts: int) -> dict[str, object]:
    outcomes: Counter[str] = Counter()
    others: Counter[str] = Counter()
    rng = random.Random()
    async with PostgresHistoryStore(dsn, table=table, max_sessions=4) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=6))
        for attempt in range(attempts):

            async def generate(window: HistoryWindow, attempt: int = attempt) -> DecisionMessage:
                return DecisionMessage(text=f"{os.getpid()}-{attempt}", final=True)

            try:
                await history.step(WHO, [], generate)
                outcomes["saved"] += 1
            except DecisionHistoryBusy:
                outcomes["busy"] += 1
                await asyncio.sleep(rng.random() * 0.004)
            except DecisionHistoryRecordInvalid as e:
                outcomes["damaged" if "damaged" in str(e) else "invalid"] += 1
            except Exception as e:  # counted and reported by type
                others[type(e).__name__] += 1
    return {**outcomes, "others": dict(others)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))))
