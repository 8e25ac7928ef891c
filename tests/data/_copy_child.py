"""A copy process for the kill tests: ``python -m tests.data._copy_child MODE SRC_KIND
DST_KIND SRC... -- DST...``.

``copy``: copies the source's histories into the target (built with
``worker_id=copy_worker_id()``), printing ``done N`` after each conversation, slowly
enough that the parent can kill it midway. ``hold KEY``: reserves ``KEY`` in the target
as a copy would, prints ``held`` and waits to be killed.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from tests.history._stores import build
from touba.data import Stores, copy_stores, copy_worker_id


async def main(mode: str, argument: str, src_kind: str, dst_kind: str, *where: str) -> None:
    cut = where.index("--")
    source = build(src_kind, *where[:cut])
    target = build(dst_kind, *where[cut + 1 :], worker_id=copy_worker_id(), max_sessions=1000)
    if mode == "hold":
        inside = asyncio.Event()

        async def hang(snapshot: Any) -> Any:
            inside.set()
            await asyncio.sleep(600)
            return snapshot, None

        task = asyncio.create_task(target.transact(argument, hang))
        await inside.wait()
        print("held", flush=True)
        await task
        return

    def progress(kind: str, done: int, total: int) -> None:
        print(f"done {done}", flush=True)

    await copy_stores(Stores(histories=[source]), Stores(histories=[target]), progress=progress)
    print("finished", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
