"""A process that erases a user and is killed midway: ``python -m tests.data._erase_child
POINT DIRECTORY USER``.

It opens the SQLite stores of ``tests.data._world`` (``sqlite`` kind) in DIRECTORY and
runs ``erase_user(USER)``, with one store slowed at POINT: ``after_histories`` (the
history store's erase returns, then the process waits) or ``in_memory_transaction`` (the
memory store's erase transaction has deleted its rows and waits before its COMMIT). At
that point it creates ``DIRECTORY/at-point`` and sleeps, for the test to ``kill -9`` it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from touba.data import Stores, erase_user
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.memory._sql import Db
from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding

R = TypeVar("R")


def main(point: str, directory: Path, user: str) -> None:
    flag = directory / "at-point"

    class SlowHistory(SqliteHistoryStore):
        async def erase(self, keys: Collection[str]) -> int:
            erased = await super().erase(keys)
            if point == "after_histories":
                flag.touch()
                await asyncio.sleep(120)
            return erased

    class SlowMemory(SqliteMemoryStore):
        async def _erase_atomic(self, body: Callable[[Db], Awaitable[R]]) -> R:
            async def slow(db: Db) -> R:
                result = await body(db)
                if point == "in_memory_transaction":
                    flag.touch()
                    time.sleep(120)  # noqa: ASYNC251 - the store's thread, inside the transaction
                return result

            return await super()._erase_atomic(slow)

    async def run() -> None:
        stores: Any = Stores(
            memory=SlowMemory(directory / "memory.db"),
            histories=(SlowHistory(directory / "history.db"),),
            checkpoints=SqliteCheckpointStore(directory / "checkpoints.db"),
            resources=SqliteResourceBinding(directory / "resources.db"),
        )
        await erase_user(user, stores)
        print("finished", flush=True)  # the test fails if it gets here

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
