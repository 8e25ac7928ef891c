"""``ToubaSession.get_items`` reads without a reservation (issue 29, item 7f).

A read of the whole session used to take the session's reservation whenever the
store object did not hold all it read (a fresh store object, a read beyond the
cached tail): a worker killed there left the session busy until ``recover``. It now
peeks (``read_log``): one atomic read, without a reservation, that renews the expiry.
Tested by SIGKILLing a worker that adds and reads, a few dozen times on each store,
and by a reader that must never see a torn session while a writer appends.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._zygote import Zygote
from touba.errors import DecisionHistoryBusy
from touba.integrations.openai_agents import ToubaSession

from ._reader import NAMESPACE, numbers, pair

SESSION = "read-and-added"

KILLS = 12  # per store; seeded


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """One forking process for the module (its start costs seconds on a busy machine)."""
    with Zygote("tests.integrations._reader") as forking:
        yield forking


def test_a_worker_killed_while_it_adds_and_reads_leaves_no_reservation(
    backend: str, private_dir: Path, store_name: str, store_factory: Any, zygote: Zygote
) -> None:
    rng = random.Random(2976)
    where = (backend, str(private_dir), store_name)

    async def start(session_id: str) -> None:
        async with store_factory() as store:
            await ToubaSession(session_id, store=store, namespace=NAMESPACE).add_items(pair(0))

    async def check(session_id: str) -> int:
        async with store_factory() as store:
            session = ToubaSession(session_id, store=store, namespace=NAMESPACE)
            # A reservation left behind would refuse this read, and the raw one below.
            await store.read(session.session_key, purge=False)
            found = numbers(await session.get_items())
            assert found == list(range(len(found))), found[-3:]
            return len(found)

    counts = []
    asyncio.run(start("warm"))
    ended = zygote.run("warm", *where, "warm", kill_after=None, fork=False)
    assert ended.code == 0
    for n in range(KILLS):
        session_id = f"killed-{n}"
        asyncio.run(start(session_id))  # its first add, which reserves, done here
        ended = zygote.run("work", *where, session_id, kill_after=rng.uniform(0.05, 0.3))
        assert ended.code == -9, ended  # (0: it stopped by itself; 1: it failed)
        counts.append(asyncio.run(check(session_id)))
    assert sum(c > 2 for c in counts) >= KILLS // 2, counts  # it had read and added


async def test_a_read_never_sees_a_half_written_session(store_factory: Any) -> None:
    """A reader on its own store object (its own connection, its own cache) reads
    the whole session again and again while a writer appends pairs: every read
    holds whole pairs, from the first, at least all the pairs whose ``add_items``
    had returned before the read began."""
    pairs = 60
    async with store_factory() as writer_store, store_factory() as reader_store:
        writer = ToubaSession(SESSION, store=writer_store, namespace=NAMESPACE)
        reader = ToubaSession(SESSION, store=reader_store, namespace=NAMESPACE)
        added = 0
        seen: list[int] = []
        busy = 0

        async def write() -> None:
            nonlocal added
            for n in range(pairs):
                await writer.add_items(pair(n))
                added = n + 1
                await asyncio.sleep(0.002)  # (the readers' turn)

        async def read() -> None:
            nonlocal busy
            while added < pairs:
                before = added
                try:
                    found = numbers(await reader.get_items())
                except DecisionHistoryBusy:  # (the writer's first add reserves)
                    busy += 1
                    await asyncio.sleep(0)
                    continue
                assert found == list(range(len(found))), found[-3:]
                assert len(found) >= before
                seen.append(len(found))

        await asyncio.gather(write(), read(), read())
        assert len(seen) >= 10, (seen, busy)
        assert numbers(await reader.get_items()) == list(range(pairs))
