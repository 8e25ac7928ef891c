"""A worker appending to one session until it is killed (kill -9, from the test).

``python -m tests.integrations._appender BACKEND DIRECTORY NAME START``: opens the
same store as the test (``conftest.make_factory``), then adds ``item(START)``,
``item(START + 1)``, ... one ``add_items`` each (the first reserved, the rest
optimistic once the store object holds the tail), printing each number once
its ``add_items`` has returned.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from tests.integrations.conftest import make_factory
from touba.integrations.openai_agents import ToubaSession

SESSION = "appended"


def item(n: int) -> Any:
    return {"role": "user", "content": f"message {n:06d}"}


async def main(backend: str, directory: str, name: str, start: str) -> None:
    factory, _ = make_factory(backend, Path(directory), name, create=False)
    async with factory() as store:
        session = ToubaSession(SESSION, store=store, namespace="ns")
        n = int(start)
        while True:
            await session.add_items([item(n)])
            print(n, flush=True)
            n += 1


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
