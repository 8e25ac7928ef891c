"""A process racing others for the same checkpoints or resource keys (``python -m``).

``python -m tests.runtime._race WHAT COUNT KIND WHERE...`` opens a checkpoint
store (``WHAT=checkpoints``) or resource binding (``WHAT=resources``) on the
storage ``KIND WHERE...`` names (see :meth:`tests.runtime._stores.Place.argv`),
prints ``ready``, waits for a line on stdin, then takes checkpoints (or
deletes keys) ``item-0`` .. ``item-<COUNT-1>`` in order, and prints the JSON
list of those it won.
"""

from __future__ import annotations

import asyncio
import json
import sys

from tests.runtime._stores import open_checkpoints, open_resources
from touba.runtime import ResourceAddress

ADDRESS = ResourceAddress("notes", "user", "ada")


async def race(what: str, count: int, kind: str, *where: str) -> list[str]:
    opener = open_checkpoints if what == "checkpoints" else open_resources
    async with opener(kind, *where) as store:
        if kind == "postgres":
            await store.open()  # connected before the start, so the race is the statements
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        won = []
        for i in range(count):
            item = f"item-{i}"
            if what == "checkpoints":
                if await store.take(item) is not None:
                    won.append(item)
            elif await store.delete(ADDRESS, item):
                won.append(item)
        return won


if __name__ == "__main__":
    what, count, *location = sys.argv[1:]
    print(json.dumps(asyncio.run(race(what, int(count), *location))), flush=True)
