"""ToubaSaver's PostgreSQL backend under a network that goes silent, cuts or lags (issue 29,
item 2).

Through a loopback proxy (tests/_pg_deadlines.py), with ``deadline_seconds=1``: a put
under a black hole fails with the retryable ``DecisionHistoryStoreUnavailable`` within
the deadline + 1 s and stores nothing; once the network is back the next put succeeds
and every acknowledged checkpoint is there; a put cut on its way is whole or absent;
50 ms of added round-trip time slows puts without failing them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._pg_deadlines import DEADLINE, Behind, behind_proxy, fails_in_time, timed_out
from tests.integrations.langgraph.test_backend import T, messages, put_request
from touba.errors import ConfigurationError, DecisionHistoryStoreUnavailable
from touba.integrations.langgraph import ToubaSaver
from touba.integrations.langgraph._postgres import PostgresSaverBackend

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg() -> Iterator[Behind]:
    with behind_proxy() as behind:
        yield behind


def backend_of(pg: Behind, dsn: str | None = None) -> PostgresSaverBackend:
    return PostgresSaverBackend(
        dsn or pg.dsn, table_prefix=pg.table("lg"), deadline_seconds=DEADLINE
    )


async def stored_ids(pg: Behind) -> list[str]:
    """The thread's checkpoint ids among 0000-0005, read straight from the server."""
    direct = backend_of(pg, pg.direct)
    try:
        found = []
        for n in range(6):
            page = await direct.get(T, "", f"000{n}", {})
            found += [r.record.checkpoint_id for r in page.rows]
        return found
    finally:
        await direct.close()


def test_the_saver_passes_its_deadline_and_refuses_a_bad_one() -> None:
    saver = ToubaSaver.postgres("postgresql://localhost/x", deadline_seconds=2.5)
    assert isinstance(saver.backend, PostgresSaverBackend)
    assert saver.backend._pg.deadline == 2.5
    with pytest.raises(ConfigurationError, match="deadline_seconds"):
        ToubaSaver.postgres("postgresql://localhost/x", deadline_seconds=-1)


async def test_a_put_under_a_black_hole_fails_typed_in_time_then_the_next_succeeds(
    pg: Behind,
) -> None:
    backend = backend_of(pg)
    try:
        one = await backend.put(put_request("0001", logs=[messages((), "a")]))
        pg.proxy.black_hole()
        error = await fails_in_time(
            backend.put(
                put_request("0002", parent_id="0001", logs=[messages(one.spans["messages"], "b")])
            ),
            DecisionHistoryStoreUnavailable,
        )
        assert timed_out(error)
        pg.proxy.restore()
        await backend.put(
            put_request("0003", parent_id="0001", logs=[messages(one.spans["messages"], "c")])
        )
    finally:
        await backend.close()
    assert await stored_ids(pg) == ["0001", "0003"]


async def test_a_put_cut_on_its_way_is_whole_or_absent(pg: Behind) -> None:
    backend = backend_of(pg)
    try:
        await backend.put(put_request("0000", logs=[messages((), "m0")]))  # opened
        saved, failures = ["0000"], 0
        for nth in range(1, 5):
            pg.proxy.cut_on(nth)
            try:
                await backend.put(put_request(f"000{nth}", logs=[messages((), f"m{nth}")]))
                saved.append(f"000{nth}")
            except DecisionHistoryStoreUnavailable:
                failures += 1
            pg.proxy.cut_on(0)
            assert await stored_ids(pg) == saved
        assert failures >= 1
    finally:
        await backend.close()


async def test_added_latency_slows_puts_without_failing_them(pg: Behind) -> None:
    backend = backend_of(pg)
    try:
        await backend.put(put_request("0001", logs=[messages((), "a")]))
        pg.proxy.delay(50)
        await backend.put(put_request("0002", logs=[messages((), "b")]))
        await backend.put(put_request("0003", logs=[messages((), "c")]))
    finally:
        await backend.close()
    assert await stored_ids(pg) == ["0001", "0002", "0003"]
