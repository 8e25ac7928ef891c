"""A worker that dies (kill -9) while it holds a conversation's reservation.

``python -m tests.integrations._holder BACKEND DIRECTORY NAME KEY``: opens the same
store as the test (``conftest.make_factory``; PostgreSQL and Redis by the
environment the test passes), starts a transaction on KEY, prints ``held``
and kills itself inside it, as a worker crashing in the middle of an
operation would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tests.integrations.conftest import make_factory


async def main(backend: str, directory: str, name: str, key: str) -> None:
    factory, _ = make_factory(backend, Path(directory), name, create=False)
    store = factory()

    async def die(record: Any) -> tuple[Any, None]:
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(60)
        return record, None

    await store.transact(key, die)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
