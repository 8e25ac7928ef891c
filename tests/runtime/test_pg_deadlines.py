"""The runtime's PostgreSQL stores under a network that goes silent, cuts or lags (issue 29,
item 2): PostgresCheckpointStore and PostgresResourceBinding.

Through a loopback proxy (tests/_pg_deadlines.py), with ``deadline_seconds=1``: a
checkpoint save (and a resource write) under a black hole fails with the store's
retryable error within the deadline + 1 s, writes nothing, and the next one succeeds
once the network is back; a save cut in the middle is whole or absent; 50 ms of added
round-trip time slows saves without failing them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._pg_deadlines import DEADLINE, Behind, behind_proxy, fails_in_time, timed_out
from touba.errors import CheckpointStoreUnavailable, ResourceBindingUnavailable
from touba.runtime import PostgresCheckpointStore, PostgresResourceBinding, ResourceAddress

pytestmark = pytest.mark.postgres
HERE = ResourceAddress("notes", "user", "ada")


@pytest.fixture
def pg() -> Iterator[Behind]:
    with behind_proxy() as behind:
        yield behind


def checkpoints_of(pg: Behind, dsn: str | None = None) -> PostgresCheckpointStore:
    return PostgresCheckpointStore(dsn or pg.dsn, table=pg.table("cp"), deadline_seconds=DEADLINE)


def body(n: int) -> dict[str, object]:
    return {"step": n, "notes": ["x" * 100] * 5}


async def test_a_checkpoint_save_under_a_black_hole_fails_typed_in_time_then_succeeds(
    pg: Behind,
) -> None:
    async with checkpoints_of(pg) as store:
        await store.save("c1", body(1))
        pg.proxy.black_hole()
        error = await fails_in_time(store.save("c2", body(2)), CheckpointStoreUnavailable)
        assert timed_out(error)
        pg.proxy.restore()
        await store.save("c3", body(3))
        assert await store.get("c1") == body(1)
    async with checkpoints_of(pg, pg.direct) as direct:
        assert await direct.get("c1") == body(1)
        assert await direct.get("c2") is None
        assert await direct.get("c3") == body(3)


async def test_a_resource_write_under_a_black_hole_fails_typed_in_time_then_succeeds(
    pg: Behind,
) -> None:
    async with PostgresResourceBinding(
        pg.dsn, table=pg.table("res"), deadline_seconds=DEADLINE
    ) as binding:
        await binding.put(HERE, "a", {"v": 1})
        pg.proxy.black_hole()
        error = await fails_in_time(binding.put(HERE, "a", {"v": 2}), ResourceBindingUnavailable)
        assert timed_out(error)
        pg.proxy.restore()
        item = await binding.get(HERE, "a")
        assert item is not None
        assert item.value == {"v": 1}
        await binding.put(HERE, "a", {"v": 3})


async def test_a_checkpoint_save_cut_in_the_middle_is_whole_or_absent(pg: Behind) -> None:
    async with checkpoints_of(pg) as store, checkpoints_of(pg, pg.direct) as direct:
        failures = 0
        for nth in range(1, 6):
            pg.proxy.cut_on(nth)
            try:
                await store.save(f"c{nth}", body(nth))
                saved = True
            except CheckpointStoreUnavailable:
                failures, saved = failures + 1, False
            pg.proxy.cut_on(0)
            assert await direct.get(f"c{nth}") == (body(nth) if saved else None)
        assert failures >= 2
        await store.save("last", body(9))


async def test_added_latency_slows_checkpoint_saves_without_failing_them(pg: Behind) -> None:
    async with checkpoints_of(pg) as store:
        pg.proxy.delay(50)
        for n in range(3):
            await store.save(f"c{n}", body(n))
        assert await store.get("c2") == body(2)
